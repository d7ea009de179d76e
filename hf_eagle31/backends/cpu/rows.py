"""Products of a few rows on a linear layer's own weights (fp32, and bf16 where the CPU has AVX512-BF16 or AVX2 alone),
built once per machine and compiler (rows_linear.cpp, or rows_avx2.cpp; rows_held.cpp their ops), and in the same
library the attention of a few query rows over a cache (rows_attention.cpp: a one-token step's, `lean._attention`)
and a Llama-family forward of a few tokens a row whole (rows_step.cpp: `lean._whole_step`), an EAGLE drafter's too
(`draft.whole_forward`).

Why: on a CPU a decoding step multiplies 1 row, and a verify forward 2-16 rows, by every weight of the target, so a
step is bound by streaming the weights. torch's fp32 path (MKL) and oneDNN's reordered copies compute the rows while
the memory waits, or stream slowly (MKL's one-row GEMV on AMD CPUs); this kernel reads each weight once for up to 16
rows and prefetches the next into L2 while it multiplies, on the weights as they are: nothing to pack, no second copy.
Which of them serves which row count is measured on the machine (routes.py), not assumed.

It is compiled with torch's C++ extension builder (a C++ compiler and ninja) on a CPU with AVX-512 or AVX2, the first
time a process on the machine asks for it (announced), into a folder keyed by everything the library depends on (its
source and flags, the compiler and its version, torch's version, the CPU: `build_key`), under a lock the operating
system releases when its holder dies. Later processes, from any virtual environment with the same torch and
compiler, load the finished library directly: torch's builder, called again, rebuilds whenever its command line
changes (another environment's include paths, another checkout's source path). A build killed halfway leaves no
library (it is moved into place whole), and torch's own lock file, which it would wait on forever, is cleared under
that lock. A thread that asks while another builds computes without the kernel meanwhile; a failure to build (no
compiler, one that fails) falls back to torch's and oneDNN's products with one warning. Elsewhere `rows_kernel()`
is False.

A CPU with AVX2 but not AVX-512 (Intel's laptop chips since Alder Lake, AMD's before Zen 4) gets the same library
built for AVX2 (`AVX2`: rows.h's 16-lane vectors as two AVX2 vectors), its products by rows_avx2.cpp's kernel: there
MKL's product took 1.6-2.8 one row's time for 2-16 fp32 rows (the same weights read), so that a verify block cost two
decoding steps, and streamed bf16 weights at half fp32's rate.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_ROWS = 16  # the row counts of verify blocks, each measured (routes.py); a prefill's are measured at a few counts
# past it, and a compiled verify block's go to the kernel where it serves every count up to it (serves_every_count)
AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")  # where the CPU and the compiler have them: AMX's tiles (rows_linear.cpp)


@dataclass(frozen=True)
class Build:
    """A library of this folder's C++: `name`, its ops' namespace; `capability`, torch's name for the instructions
    it is built for (`torch.backends.cpu.get_cpu_capability()`); `header`, what one source calls in another (part of
    the build key too)."""

    name: str
    capability: str
    sources: tuple[Path, ...]
    header: Path | None = None

    @property
    def library(self) -> str:
        return f"{self.name}.so"


def _sources(kernel: str) -> tuple[Path, ...]:
    return tuple(Path(__file__).with_name(name) for name in ("rows_held.cpp", kernel, "rows_attention.cpp",
                                                             "rows_step.cpp"))


# the same library (ops, attention, whole forwards) on either instruction set, its products by a kernel of each's own
ROWS = Build("hf_eagle31_rows", "AVX512", _sources("rows_linear.cpp"), Path(__file__).with_name("rows.h"))
AVX2 = Build("hf_eagle31_rows", "AVX2", _sources("rows_avx2.cpp"), Path(__file__).with_name("rows.h"))

logger = logging.getLogger(__name__)
_LOADED: list[Build | None] = []  # [the build] once loaded, [None] where none can be; empty until tried
_BUILDING = threading.Lock()


def rows_kernel() -> bool:
    """Whether the rows library (`torch.ops.hf_eagle31_rows`: products, attention, whole forwards) is loaded: built
    here if this CPU has AVX-512, or AVX2, and a compiler. False while another thread of this process builds it (that
    call computes without it, rather than wait)."""
    return _loaded() is not None


def reads_ways() -> bool:
    """Whether the loaded library's products read the weights in the ways `routes.ways` chooses among (the AVX-512
    kernel, rows_linear.cpp); the AVX2 kernel reads them one way."""
    return _loaded() is ROWS


def for_this_cpu() -> Build | None:
    """The library built for the instructions torch uses here, if any."""
    capability = torch.backends.cpu.get_cpu_capability()
    return next((build for build in (ROWS, AVX2) if build.capability == capability), None)


def _loaded() -> Build | None:
    if _LOADED:
        return _LOADED[0]
    build = for_this_cpu()
    if build is None or shutil.which(_compiler()) is None:
        _LOADED.append(None)
        return None
    if not _BUILDING.acquire(blocking=False):
        return None
    try:
        if not _LOADED:
            _LOADED.append(build if _load(build, build_directory(build)) else None)
            if _LOADED[0] is not None:
                warn_if_threads_sleep()
    finally:
        _BUILDING.release()
    return _LOADED[0]


def warn_if_threads_sleep() -> None:
    """Warn where the environment makes OpenMP's worker threads sleep whenever they wait.

    Why: a decoding step on the kernel waits for its threads about 210 times (SmolLM2's: a barrier after each
    product, new keys, attention and gate of its forward's one parallel region, rows_step.cpp; a region a product
    elsewhere), microseconds apart (a few to some tens); a worker woken each time adds to every one
    (`OMP_WAIT_POLICY=PASSIVE`: a SmolLM2 bf16 step's forward 1.3x slower, 2.4-2.9x with a region a product).
    OpenMP reads the setting when the process starts, so only the user can change it."""
    if os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE":
        warnings.warn("OMP_WAIT_POLICY=PASSIVE makes OpenMP's worker threads sleep whenever they wait, and a decoding "
                      "step on the CPU backend waits for them after each product: fast_decoding and EAGLE run slower. "
                      "Unset it (or set OMP_WAIT_POLICY=ACTIVE) before Python starts.", RuntimeWarning, stacklevel=3)


def kernel_decided() -> bool:
    """Whether `rows_kernel()` has its answer (False only while another thread of this process builds)."""
    return bool(_LOADED)


def bf16_kernel() -> bool:
    """Whether the loaded kernel multiplies bf16 too (the AVX2 kernel, or the AVX-512 one where the CPU has
    AVX512-BF16)."""
    return rows_kernel() and torch.ops.hf_eagle31_rows.bf16()


@functools.cache
def amx_kernel() -> bool:
    """Whether the loaded kernel multiplies bf16 blocks on AMX's tiles too (built where the CPU has them, and Linux
    lets the process use them)."""
    return bf16_kernel() and reads_ways() and torch.ops.hf_eagle31_rows.amx()


@torch.compiler.assume_constant_result  # traced (`lean._attention`), its answer is a constant of the graph
def attends(head_dim: int) -> bool:
    """Whether the loaded library's attention (`torch.ops.hf_eagle31_rows.attention`, rows_attention.cpp) takes
    heads of `head_dim`."""
    return rows_kernel() and _attends(head_dim)


@functools.cache  # a loaded library's answer never changes; asked at every forward, the op cost ~30 us of a step
def _attends(head_dim: int) -> bool:
    return torch.ops.hf_eagle31_rows.attends(head_dim)


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _flags(build: Build = ROWS) -> list[str]:
    if build is AVX2:
        return ["-O3", "-mavx2", "-mfma", "-fopenmp"]
    bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    amx = bf16 and getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)() and \
        _accepts(_compiler(), AMX_FLAGS)
    return ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", *(["-mavx512bf16"] if bf16 else []),
            *(AMX_FLAGS if amx else []), "-fopenmp"]


@functools.cache
def _accepts(compiler: str, flags: tuple[str, ...]) -> bool:
    """Whether `compiler` knows `flags` (AMX's need GCC 11 or clang 12): without them the kernel builds still."""
    try:
        return subprocess.run([compiler, *flags, "-E", "-x", "c++", "-"], input="", capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _cpu() -> str:
    """The CPU's model and instruction sets (Linux), else what the platform names."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        return "\n".join(next((line for line in lines if line.startswith(key)), "") for key in ("model name", "flags"))
    return platform.processor() or platform.machine()


def build_key(build: Build | None = None) -> str:
    """A digest of everything `build` (this CPU's) depends on: its source and flags, the compiler (`$CXX`, its path
    and version), torch's version, the CPU and the instructions torch uses on it (`ATEN_CPU_CAPABILITY` can lower
    them: the routes measured differ). Not the Python version nor the environment: the library includes no Python
    header, and every environment with the same torch loads the same one."""
    build = build or for_this_cpu() or ROWS
    compiler = shutil.which(_compiler()) or _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    files = (*build.sources, *([build.header] if build.header else []))
    parts = [*(hashlib.sha256(source.read_bytes()).hexdigest() for source in files), " ".join(_flags(build)),
             compiler, version, torch.__version__, str(torch.version.git_version), _cpu(),
             torch.backends.cpu.get_cpu_capability()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def build_directory(build: Build | None = None) -> Path:
    """Where `build` (this CPU's) is built, and the measured routes kept: per `build_key`, under `HF_EAGLE31_CACHE`
    (~/.cache/hf_eagle31)."""
    root = Path(os.environ.get("HF_EAGLE31_CACHE", Path.home() / ".cache" / "hf_eagle31"))
    return root / f"rows-{build_key(build)}"


def _load(build: Build, folder: Path) -> bool:
    """Load `build`'s library from `folder`, building it first (once, under a lock) where it is not there yet."""
    library = folder / build.library
    try:
        if not library.exists():
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / "build.lock", "w") as lock:
                logger.warning("hf_eagle31: building the rows kernel (%s) for this CPU and compiler in %s (once, "
                               "about 20 s)", build.name, folder)
                fcntl.flock(lock, fcntl.LOCK_EX)  # another process building: wait for it; released if it dies
                if not library.exists():
                    _build(build, folder)
                    return True  # torch's builder loaded what it built
        torch.ops.load_library(str(library))
    except Exception as error:  # no ninja, a compiler that fails, an unwritable cache: torch's and oneDNN's products
        warnings.warn(f"hf_eagle31: the rows kernel did not build ({type(error).__name__}: {error}); products use "
                      "torch's and oneDNN's implementations instead", stacklevel=3)
        return False
    return True


def _build(build: Build, folder: Path) -> None:
    """Build (and load) `build`'s library in a scratch folder, then move it into place whole."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None and importlib.util.find_spec("ninja") is not None:  # pip's ninja, off PATH
        import ninja                                                      # when the venv is not activated

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    scratch = folder / "build"
    scratch.mkdir(exist_ok=True)
    (scratch / "lock").unlink(missing_ok=True)  # torch's own lock, left by a build that was killed
    cpp_extension.load(build.name, [str(source) for source in build.sources], is_python_module=False,
                       build_directory=str(scratch), extra_cflags=_flags(build), extra_ldflags=["-fopenmp"])
    shutil.copyfile(scratch / build.library, folder / f"{build.library}.partial")
    os.replace(folder / f"{build.library}.partial", folder / build.library)
