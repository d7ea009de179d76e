"""Which implementation multiplies how many rows: measured on this machine once, kept beside the kernel build.

Why: which of the rows kernel (rows.py), torch's product (MKL) and oneDNN's product over its reordered copy of the
weights streams 1-16 rows fastest depends on the CPU and its libraries (MKL's one-row product streams the weights at a
fraction of the memory's rate on AMD CPUs and near it on Intel's), so no constant suits every machine. So does how the
kernel reads the weights (its `ways`, rows_linear.cpp): whether it also prefetches into L1 (faster at 8-16 rows on an
AMD EPYC, 2-6 within a few percent either way, slower at one), whether 1-16 rows read one weight row at a time (bf16 2-8
rows 1.2-1.3x faster on the same CPU, fp32 rows 0.7-1.15x as fast; one row 1.04-1.12x there, 0.89-0.94x on an Intel
Xeon), whether 7-16 rows go in groups of up to 6 (fp32 8-16 rows 1.2-1.3x faster on the EPYC where the weights come from
the cache, bf16 rows up to 10% slower) and whether 2-16 bf16 rows go to AMX's tiles where the CPU has them (on an Intel
Xeon 1.1-1.27x one row's time, where the vector kernel took up to 3x and oneDNN's AMX product 1.2-1.28x), measured as
implementations of their own ("rows_near", "rows_single", "rows_single_near", "rows_narrow", "rows_narrow_near",
"rows_amx") at 1-16 rows (7-16 for the groups, which are the same below; 2-16 for AMX); on a CPU without AVX-512, the
kernel built for AVX2 (rows_avx2.cpp: "rows" alone) against torch's and oneDNN's. The first process that needs a
dtype's routes times every implementation at every row count on a stream of weights of eight last-level caches
(`workload`), from memory as a decoding step streams them, and writes the fastest per row count into the kernel's build
folder (keyed by CPU, compiler and torch: rows.build_key) for the thread count it ran with; other processes read it.
Delete the file to measure again.

Past 16 rows (a prompt's prefill, a batch's verify blocks) the same holds: the kernel, which rereads the weights
for every 16 rows, beat MKL's product up to a few hundred rows on an AMD EPYC and lost past them, and oneDNN's bf16
product past ~128. So a few counts past 16 are measured too (`PAST_MAX_ROWS`), and a count between two of them goes
where the next one measured goes.
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import functools
import json
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_eagle31.backends.cpu import rows
from hf_eagle31.backends.cpu.rows import MAX_ROWS

# the kernel, its weights read side by side or a row at a time ("single"), or 7-16 rows in groups of up to 6
# ("narrow"), without and with its L1 prefetch ("near"), or 2-16 bf16 rows on AMX's tiles ("amx"); F.linear; oneDNN's
# product over its reordered copy; on a CPU without AVX-512, the library's AVX2 kernel is "rows" alone (one way)
KERNEL = ("rows", "rows_near", "rows_single", "rows_single_near", "rows_narrow", "rows_narrow_near", "rows_amx")
IMPLEMENTATIONS = (*KERNEL, "torch", "onednn")
SINGLE_BITS = 16  # `ways`: bit r - 1 for r rows near, bit SINGLE_BITS + r - 1 single (rows_linear.cpp)
NARROW_BITS = 32  # bit NARROW_BITS + r - 1: r rows in groups of up to 6 (rows_linear.cpp)
AMX_BITS = 48  # bit AMX_BITS + r - 2: 2-16 rows on AMX (rows_linear.cpp; 16 rows' bit is the int64's last but one)
NARROW_FROM = 7  # the fewest rows grouped otherwise when narrow: below, the same product as "rows" (not timed)
REPEATS = 5  # timings of each implementation at each row count: the fastest counts (the others met other work)
# [out, in]: a 1B decoder's and a 135M decoder's up and down projections, in turn: which way reads fastest depends
# on a weight row's length too (on an AMD EPYC 2-3 fp32 rows read a weight row at a time were timed faster over
# 1,024-feature rows and ran 0.7-0.85x as fast over SmolLM2's 576)
SHAPES = ((2816, 1024), (1024, 2816), (1536, 576), (576, 1536))
BATCH_HINT = 8  # rows oneDNN lays the weights out for: a verify block's size (its copies here and in products.py)
PAST_MAX_ROWS = (32, 64, 128, 256, 512)  # the counts measured past MAX_ROWS; more than the last go as the last
COUNTS = (*range(1, MAX_ROWS + 1), *PAST_MAX_ROWS)  # every row count measured, in order
# the steps (one at each row count of 1-MAX_ROWS, in turn) over which oneDNN's copy of the weights must pay for
# itself, a copy being made at every call: a short answer's decoding steps (`choose`)
PAYBACK_STEPS = 64
# how much faster than every way of the kernel another implementation must be timed to multiply 1-MAX_ROWS rows
# (`choose`): more than the timings' noise between runs (1-3%), as it also takes a step off the rows library's
# one-call forward
OFF_KERNEL_MARGIN = 0.1
CACHE_MULTIPLE = 8  # a stream of weights timed is this many last-level caches (`workload`)
STREAM_BOUNDS = (256 * 2**20, 2**30)  # its bounds: past the caches where Linux does not say, and quick to time

logger = logging.getLogger(__name__)
_ROUTES: dict[tuple[torch.dtype, int], tuple[str, ...]] = {}  # (dtype, threads) -> implementation per COUNTS
_MEASURING = threading.Lock()


def linear(x: torch.Tensor, weights: tuple[torch.Tensor, ...], bias: torch.Tensor | None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """`x` times each of `weights` (`[N_i, K]`), the outputs side by side, plus `bias`, by the implementation
    measured fastest for its row count (`route`); oneDNN's over `packed`, the weights stacked and reordered."""
    how = route(x.numel() // x.shape[-1], x.dtype)
    if how in KERNEL:
        return torch.ops.hf_eagle31_rows.linear(x, weights, bias, ways(x.dtype))
    if how == "onednn" and packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    out = torch.cat([F.linear(x, weight) for weight in weights], dim=-1)
    return out if bias is None else out + bias


def route(count: int, dtype: torch.dtype) -> str:
    """The implementation `linear` multiplies `count` rows in `dtype` by: the one measured fastest at `count`, or at
    the next count measured (`COUNTS`), or past the last at the last."""
    return routes(dtype)[min(bisect.bisect_left(COUNTS, count), len(COUNTS) - 1)]


def on_kernel(count: int, dtype: torch.dtype) -> bool:
    """Whether `count` rows in `dtype` are multiplied by the rows kernel (as `linear` would)."""
    return route(count, dtype) in KERNEL


def ways(dtype: torch.dtype) -> int:
    """The kernel's `ways` in `dtype`: for each row count r of 1-16 measured faster with the L1 prefetch bit r - 1,
    faster reading one weight row at a time bit `SINGLE_BITS` + r - 1, and faster in groups of up to 6 rows bit
    `NARROW_BITS` + r - 1; the kernel applies them to every group of rows it multiplies, a block's past 16 rows
    included."""
    return _way_bits(routes(dtype))


@functools.cache
def _way_bits(chosen: tuple[str, ...]) -> int:
    """`ways` of one set of routes, worked out once: `linear` asks at every product."""
    return sum(_way_of(how) << index for index, how in enumerate(chosen[:MAX_ROWS]))


def _way_of(how: str) -> int:
    """An implementation's bits for one row count, at the count's own bit (shifted there by the caller)."""
    return (1 if how.endswith("_near") else 0) | ((1 << SINGLE_BITS) if how.startswith("rows_single") else 0) | \
        ((1 << NARROW_BITS) if how.startswith("rows_narrow") else 0) | \
        ((1 << (AMX_BITS - 1)) if how == "rows_amx" else 0)  # at r rows' index r - 1: bit AMX_BITS + r - 2


def serves_every_count(dtype: torch.dtype) -> bool:
    """Whether the rows kernel is measured fastest at every row count up to `MAX_ROWS` in `dtype`: a compiled verify
    graph then calls it for every block (lean.py), larger blocks too, so that no block size makes the graph change
    mid-call. Where it served every count (an AMD EPYC), it also multiplied 17-61 rows 1.5-2.7x faster than torch."""
    return all(how in KERNEL for how in routes(dtype)[:MAX_ROWS])


def copies(dtype: torch.dtype) -> bool:
    """Whether products in `dtype` need oneDNN's reordered copy of the weights: some row count is fastest on it."""
    return "onednn" in routes(dtype)


def routes(dtype: torch.dtype) -> tuple[str, ...]:
    """The implementation of each of `COUNTS` rows in `dtype` at this thread count: read from the build folder, or
    measured there (once a machine). While another thread of this process builds the kernel: torch's, not kept."""
    key = (dtype, torch.get_num_threads())
    found = _ROUTES.get(key)
    if found is not None:
        return found
    candidates = available(dtype)
    if not rows.kernel_decided():
        return ("torch",) * len(COUNTS)
    if len(candidates) == 1:
        found = candidates * len(COUNTS)
    else:
        with _MEASURING:
            found = _ROUTES.get(key) or _kept_or_measured(dtype, candidates)
    _ROUTES[key] = found
    return found


def available(dtype: torch.dtype) -> tuple[str, ...]:
    """The implementations that can multiply `dtype` here."""
    kernel = rows.rows_kernel() and (dtype == torch.float32 or (dtype == torch.bfloat16 and rows.bf16_kernel()))
    amx = kernel and dtype == torch.bfloat16 and rows.amx_kernel()
    onednn = torch.backends.mkldnn.is_available() and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    usable = {**dict.fromkeys(KERNEL, kernel and rows.reads_ways()), "rows": kernel, "rows_amx": amx, "torch": True,
              "onednn": onednn}
    return tuple(name for name in IMPLEMENTATIONS if usable[name])


def _kept_or_measured(dtype: torch.dtype, candidates: tuple[str, ...]) -> tuple[str, ...]:
    """The routes kept in the build folder for this dtype and thread count, else measured and kept (under the
    folder's lock: another process measuring at the same time would slow both, and measure twice)."""
    folder = rows.build_directory()
    path = folder / f"routes-{str(dtype).removeprefix('torch.')}-{torch.get_num_threads()}threads.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            kept = _read(path, candidates)
            if kept is not None:
                return kept
            logger.warning("hf_eagle31: timing the %s products of 1-%d rows on this CPU (once, a few seconds)",
                           str(dtype).removeprefix("torch."), COUNTS[-1])
            seconds, copy = _measured(dtype, candidates)
            chosen = choose(seconds, copy)
            _write(path, {"counts": list(COUNTS), "routes": list(chosen), "seconds": seconds, "copy_seconds": copy,
                          "streamed_bytes": streamed_bytes()})
            return chosen
    except OSError:  # an unwritable cache: measured, not kept
        return choose(*_measured(dtype, candidates))


def _measured(dtype: torch.dtype, candidates: tuple[str, ...]) -> tuple[dict[str, list[float]], float]:
    """`measure`'s timings, with the memory its weights held handed back to the system once they are freed.

    Why: the weights streamed (many tensors of a few MiB, and oneDNN's copies of them) are freed into glibc's heap,
    which keeps the pages: a process that had measured both dtypes held 1173 MiB where it had held 446 before
    (631 after `malloc_trim`), and a bench run that measured counted ~0.7 GB more peak memory for every method."""
    try:
        return measure(dtype, candidates)
    finally:
        _trim_heap()


def _trim_heap() -> None:
    """glibc's `malloc_trim(0)`: the heap's free pages back to the system; nothing where the C library has none."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform.startswith("linux") else None
    if trim is not None:
        trim(0)


def _read(path: Path, candidates: tuple[str, ...]) -> tuple[str, ...] | None:
    """The routes `choose` makes from the timings kept at `path` (chosen again: a file written under an older rule
    gets today's), or None where they cannot serve: measured again."""
    try:
        kept = json.loads(path.read_text())
        counts, copy = tuple(kept["counts"]), kept.get("copy_seconds")  # none: an older file, timed without the copy
        streamed = kept.get("streamed_bytes") == streamed_bytes()  # an older file timed a stream partly in the cache
        # an older file without some way raises KeyError here: measured again
        seconds = {name: [float(t) for t in kept["seconds"][name]] for name in candidates}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    usable = counts == COUNTS and all(len(times) == len(COUNTS) for times in seconds.values())
    return choose(seconds, copy) if copy is not None and streamed and usable else None


def _write(path: Path, record: dict) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record, indent=1))
    os.replace(partial, path)


def choose(seconds: dict[str, list[float]], copy: float = 0.0) -> tuple[str, ...]:
    """The fastest implementation at each row count, from `measure`'s seconds; oneDNN's only where its copy pays.

    Why the condition: oneDNN's product needs a reordered copy of every weight, made for each call (or held by
    `hold_products`) whichever row counts use it, so a row count or two where it is measured a little faster (or
    where other work slowed the others down) would cost every call that copy. It is a route only where, run at every
    row count of decoding steps and verify blocks (up to `MAX_ROWS`: a prefill's products, rarer and far longer,
    would outweigh them), it is faster than the copy-free implementations by more than its `copy` (the seconds it
    takes to make, for the same weights) spread over `PAYBACK_STEPS`. Uncharged, a sum 1-2% below theirs chose
    it on an AMD EPYC, where its copy cost a call 0.14 s (SmolLM2, fp32) and its products were no
    faster in the model: `fast_decoding` ran 5% slower and EAGLE 12%.

    And up to `MAX_ROWS` rows another implementation takes a count from the kernel only where it is timed faster by
    more than `OFF_KERNEL_MARGIN`: a product off the kernel also takes the model's forward off the rows library's
    one-call step (rows_step.cpp) to an operation at a time. On an Intel Xeon MKL's one-row fp32 product, timed 1%
    faster than the kernel (35.2 against 35.5 ms, a run earlier 35.3 against 34.6), halved `fast_decoding` (SmolLM2:
    26.0 against 51.5 tokens/s)."""
    plain = [name for name in seconds if name != "onednn"]
    if plain and "onednn" in seconds:
        best_plain = [min(seconds[name][index] for name in plain) for index in range(MAX_ROWS)]
        saved = (sum(best_plain) - sum(seconds["onednn"][:MAX_ROWS])) / MAX_ROWS  # a step, on oneDNN's product
        if PAYBACK_STEPS * saved <= copy:
            seconds = {name: seconds[name] for name in plain}
    kernel = any(name in KERNEL for name in seconds)

    def charged(name: str, index: int) -> float:
        off = kernel and name not in KERNEL and index < MAX_ROWS
        return seconds[name][index] * (1 + OFF_KERNEL_MARGIN) if off else seconds[name][index]

    return tuple(min(seconds, key=lambda name: charged(name, index)) for index in range(len(COUNTS)))


@torch.no_grad()
def measure(dtype: torch.dtype, candidates: tuple[str, ...]) -> tuple[dict[str, list[float]], float]:
    """Seconds each candidate takes to multiply each of `COUNTS` rows by a stream of weights (`workload`), and the
    seconds oneDNN's copy of those weights takes to make (`choose` charges it; 0 without oneDNN): each
    product the fastest of `REPEATS` passes over every row count, so that other work on the machine, which slows
    whatever runs meanwhile, would have to last the whole measurement to count; each weight streamed from memory
    (the candidates take turns over the whole stream, longer than the cache)."""
    weights = workload(dtype)
    # past MAX_ROWS a product computes far more than it reads (the kernel reads its weights again for every 16 rows,
    # from the cache), so a quarter of the stream serves, in a quarter of the time
    streams = [weights if count <= MAX_ROWS else weights[: max(1, len(weights) // 4)] for count in COUNTS]
    inputs = [{weight.shape[1]: torch.randn(count, weight.shape[1]).to(dtype) for weight, _ in weights}
              for count in COUNTS]
    best = {name: [[math.inf] * len(stream) for stream in streams] for name in candidates}
    for _ in range(REPEATS):
        for index in range(len(COUNTS)):
            for name in candidates:
                count = COUNTS[index]
                if _way_of(name) and (count > MAX_ROWS or count < NARROW_FROM and "narrow" in name or
                                      count == 1 and name == "rows_amx"):
                    continue  # past 16 rows groups take their counts' bits; fewer than NARROW_FROM rows are one
                    # group either way; one row does not go to AMX
                for slot, (weight, packed) in enumerate(streams[index]):
                    taken = _time(name, inputs[index][weight.shape[1]], weight, packed)
                    best[name][index][slot] = min(best[name][index][slot], taken)
    begun = time.perf_counter()  # the copy as a call makes it: every weight reordered into fresh memory
    for weight, packed in weights:
        if packed is not None and "onednn" in candidates:
            torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
    copy = time.perf_counter() - begun
    return {name: [sum(products) for products in best[name]] for name in candidates}, copy


def workload(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Weights in `dtype` (with oneDNN's copies where it runs) of `streamed_bytes`: a product then streams its weights
    from memory, as in a model's step.

    Why so many: a last-level cache keeps part of a stream it sees again and again, so over weights of two such
    caches (64 MiB on an AMD EPYC with 32 MiB) a share of each product came from it, and one row with the L1
    prefetch ("rows_near") was timed faster there (0.85-1.03x its time) and was chosen in 15 of 22 measurements,
    though in SmolLM2's steps, weights from memory, it ran 3-29% slower in bf16 and up to 11% in fp32; over eight,
    it was timed 0.99-1.28x (chosen in 2 of 12, fp32, within 1%)."""
    onednn = "onednn" in available(dtype)
    total, weights = 0, []
    while total < streamed_bytes():
        weight = torch.randn(SHAPES[len(weights) % len(SHAPES)]).to(dtype)
        weights.append((weight, torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT) if onednn else None))
        total += weight.numel() * weight.element_size()
    return weights


def streamed_bytes(cache: int | None = None) -> int:
    """Bytes to read so that all but a sliver of a read comes from memory: `CACHE_MULTIPLE` last-level caches (this
    CPU's, or `cache` bytes), within `STREAM_BOUNDS`."""
    return min(max(STREAM_BOUNDS[0], CACHE_MULTIPLE * (last_level_cache() if cache is None else cache)),
               STREAM_BOUNDS[1])


def last_level_cache() -> int:
    """The CPU's largest cache as Linux reports it, in bytes (0 if it does not)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=0)


def _time(name: str, x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> float:
    """Seconds `name` takes to multiply `x` by `weight` (`packed`: oneDNN's copy of it)."""
    begun = time.perf_counter()
    if name in KERNEL:
        first = 1 if name == "rows_amx" else 0  # one row's bit of the AMX way is another way's
        torch.ops.hf_eagle31_rows.linear(x, [weight], None, sum(_way_of(name) << i for i in range(first, MAX_ROWS)))
    elif name == "onednn":
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    else:
        F.linear(x, weight)
    return time.perf_counter() - begun
