"""fp32 products of a few rows on a linear layer's own weights, built once per machine (rows_linear.cpp).

Why: on a CPU a verify forward multiplies 2-16 rows by every weight of the target, and a step is bound by
streaming the weights. torch's fp32 path (MKL) costs ~2 one-row products for 8 rows and oneDNN's packed
weights ~1.5 on a 2-core Xeon, since both compute the rows while the memory waits; this kernel reads each
weight once for up to 16 rows and prefetches the next into L2 while it multiplies (~1.0 one-row products for 2
rows, ~1.2 for 8), on the weights as they are: nothing to pack, no second copy.

It is compiled with torch's C++ extension builder (a C++ compiler and ninja) on a CPU with AVX-512, the first
time a process on the machine asks for it (~20 s, announced), into a folder of this package's own under a lock
the operating system releases when its holder dies: a build killed halfway leaves nothing that blocks the next
one (torch's own lock file, which it would wait on forever, is cleared under that lock). A thread that asks while
another builds computes without the kernel meanwhile; a failure to build (no compiler, one that fails) falls back
to oneDNN's packed layout with one warning. Elsewhere `rows_kernel()` is False.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_ROWS = 16  # more rows (a prompt's prefill) go to torch's GEMM, which wins once the weights are reused enough;
# from 24 rows torch's is as fast; one row goes to MKL's GEMV, a little faster than the kernel's
SOURCE = Path(__file__).with_name("rows_linear.cpp")

logger = logging.getLogger(__name__)
_LOADED: list[bool] = []  # [True] once loaded, [False] where it cannot be; empty until tried
_BUILDING = threading.Lock()


def rows_kernel() -> bool:
    """Whether `torch.ops.hf_eagle31_rows.linear` is loaded: built here if this CPU has AVX-512 and a compiler. False
    while another thread of this process builds it (that call computes without it, rather than wait)."""
    if _LOADED:
        return _LOADED[0]
    if torch.backends.cpu.get_cpu_capability() != "AVX512" or shutil.which(os.environ.get("CXX", "c++")) is None:
        _LOADED.append(False)
        return False
    if not _BUILDING.acquire(blocking=False):
        return False
    try:
        if not _LOADED:
            _LOADED.append(_build(build_directory()))
    finally:
        _BUILDING.release()
    return _LOADED[0]


def build_directory() -> Path:
    """Where the kernel is built: per source, torch and Python, under `HF_EAGLE31_CACHE` (~/.cache/hf_eagle31)."""
    root = Path(os.environ.get("HF_EAGLE31_CACHE", Path.home() / ".cache" / "hf_eagle31"))
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    python = f"py{sys.version_info[0]}{sys.version_info[1]}"
    return root / f"rows-{digest}-torch{torch.__version__.replace('+', '_')}-{python}"


def _build(folder: Path) -> bool:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None and importlib.util.find_spec("ninja") is not None:  # pip's ninja, off PATH
        import ninja                                                      # when the venv is not activated

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "build.lock", "w") as lock:
            if not (folder / "hf_eagle31_rows.so").exists():
                logger.warning("hf_eagle31: building the fp32 rows kernel for this CPU in %s (once per machine, "
                               "about 20 s)", folder)
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process building: wait for it; released if it dies
            (folder / "lock").unlink(missing_ok=True)  # torch's own lock, left by a build that was killed
            cpp_extension.load("hf_eagle31_rows", [str(SOURCE)], is_python_module=False, build_directory=str(folder),
                               extra_cflags=["-O3", "-mavx512f", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as error:  # no ninja, a compiler that fails, an unwritable cache: oneDNN's layout instead
        warnings.warn(f"hf_eagle31: the fp32 rows kernel did not build ({type(error).__name__}: {error}); fp32 "
                      "products use oneDNN's packed layout instead", stacklevel=3)
        return False
    return True


def rows_linear(x: torch.Tensor, weights: tuple[torch.Tensor, ...], bias: torch.Tensor | None) -> torch.Tensor:
    """`x` times each of `weights` (fp32, `[N_i, K]`), the outputs side by side, plus `bias`: the kernel for 2 to
    `MAX_ROWS` rows, torch's for others."""
    if not 1 < x.numel() // x.shape[-1] <= MAX_ROWS:
        out = torch.cat([F.linear(x, weight) for weight in weights], dim=-1)
        return out if bias is None else out + bias
    return torch.ops.hf_eagle31_rows.linear(x, weights, bias)
