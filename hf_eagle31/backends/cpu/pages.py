"""Huge pages under the weights the products stream, in place: the same memory, addresses and values.

Why: a decoding step reads every weight once, so on 4 KiB pages it meets a new page, and a TLB miss, every 4 KiB:
about 65,000 times a step for bf16 SmolLM2's 269 MB, against about 130 on 2 MiB pages. On an AMD EPYC (2 threads, a
KVM guest) bf16 SmolLM2 with its weights on huge pages ran 1.08x the tokens/s in `fast_decoding` and 1.07x in EAGLE
3.1 (medians of 16 in-process rounds, 52-59 GB/s of read bandwidth; in another 40, a token 0.84-0.98x the time,
median 0.91, at 39-47 GB/s, 0.88-1.0x at 28-31). Linux 6.1 and later moves anonymous memory onto huge pages in place
(`madvise(MADV_COLLAPSE)`): the tensors, the model and anything else on that memory see no change, and nothing is
copied beside them. Where it cannot (weights mapped from a file, as fp32 weights loaded straight from safetensors
are; an older kernel; huge pages turned off; another system) nothing changes. It costs each range once: on that guest
about 2 ms per MB at the first use of the memory (the host backing it), 0.3 ms after; asked again, a range already on
a huge page returns at once (0.3-0.7 ms for SmolLM2's 121 ranges).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import sys
from collections.abc import Callable, Iterable

import torch

HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB base pages) huge page
MADV_COLLAPSE = 25  # linux/mman.h
GAP = 4096  # tensors nearer than this are one span: between them lie an allocator's few bytes of bookkeeping
REFUSALS = 8  # ranges refused in a row as memory Linux never collapses before the rest of a span is given up


def collapse(tensors: Iterable[torch.Tensor]) -> int:
    """Ask Linux to back each huge-page-aligned 2 MiB range inside the tensors' memory (tensors within `GAP` of each
    other taken together) with a huge page, in place; the ranges it did (0 where it cannot)."""
    advise = _madvise()
    if advise is None:
        return 0
    done = 0
    for start, end in _spans(tensors):
        first, refused = -(-start // HUGE_PAGE) * HUGE_PAGE, 0
        for address in range(first, end - HUGE_PAGE + 1, HUGE_PAGE):
            if advise(address, HUGE_PAGE, MADV_COLLAPSE) == 0:
                done, refused = done + 1, 0
            elif ctypes.get_errno() == errno.EINVAL:
                refused += 1
                if refused == REFUSALS:  # memory it never collapses (a file's mapping): so is the rest of the span
                    break
    return done


def _spans(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The memory the tensors lie on, `[start, end)` addresses, as few spans as `GAP` allows."""
    spans: list[list[int]] = []
    for start, end in sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors if t.nbytes):
        if spans and start - spans[-1][1] < GAP:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return [(start, end) for start, end in spans]


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's `madvise` on Linux, None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise
