"""Huge pages under the weights the products stream, in place: the same addresses and values.

Why: a decoding step reads every weight once, so on 4 KiB pages it meets a new page, and a TLB miss, every 4 KiB:
about 65,000 times a step for bf16 SmolLM2's 269 MB, against about 130 on 2 MiB pages. On an AMD EPYC (2 threads, a
KVM guest) bf16 SmolLM2 with its weights on huge pages ran 1.08x the tokens/s in `fast_decoding` and 1.07x in EAGLE
3.1 (medians of 16 in-process rounds, 52-59 GB/s of read bandwidth; in another 40, a token 0.84-0.98x the time,
median 0.91, at 39-47 GB/s, 0.88-1.0x at 28-31). Linux 6.1 and later moves anonymous memory onto huge pages in place
(`madvise(MADV_COLLAPSE)`): the tensors, the model and anything else on that memory see no change, and nothing is
copied beside them. It costs each range once: on that guest about 2 ms per MB at the first use of the memory (the host
backing it), 0.3 ms after; asked again, a range already on a huge page returns at once (0.3-0.7 ms for SmolLM2's 121
ranges). Where it cannot (an older kernel, huge pages turned off, another system) nothing changes.

Weights loaded from safetensors in the checkpoint's own dtype (transformers' default `dtype="auto"`, or fp32 from an
fp32 file) are the file itself, mapped privately into memory: 4 KiB pages Linux does not collapse, read at the 4 KiB
pages' rate. Such a mapping is first moved onto anonymous memory at the same addresses (`_off_file`: copied 64 MiB at a
time onto huge pages, each copy then put in its part's place, `mremap`), the same values at the same addresses: what
reads it meanwhile reads the same bytes. SmolLM2 fp32 loaded from safetensors twice, one copy moved, `fast_decoding` on
each in turn (rounds of 32 tokens): a token 1.026x and 1.029x as fast (medians of 38 and 33 rounds at 32-36 GB/s), 1.27x
(7 rounds) and 1.05x and 1.31x (2) above 50 GB/s. Once a mapping: 0.7-1.2 s for SmolLM2's 513 MB on that guest (the
memory's first use), never again.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterable

import torch

HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB base pages) huge page
MADV_COLLAPSE = 25  # linux/mman.h
MADV_HUGEPAGE = 14
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2
MAP_FAILED = ctypes.c_void_p(-1).value
GAP = 4096  # tensors nearer than this are one span: between them lie an allocator's few bytes of bookkeeping
REFUSALS = 8  # ranges refused in a row as memory Linux never collapses before the rest of a span is given up
CHUNK = 64 << 20  # bytes of a file's mapping moved onto anonymous memory at a time (`_off_file`)
ANNOUNCED = 1 << 30  # a move of at least this many bytes is announced: it pauses the first call a second or more

logger = logging.getLogger(__name__)


def collapse(tensors: Iterable[torch.Tensor]) -> int:
    """Ask Linux to back each huge-page-aligned 2 MiB range inside the tensors' memory (tensors within `GAP` of each
    other taken together) with a huge page, in place, a file's private mapping first moved onto anonymous memory
    (`_off_file`); the ranges it did (0 where it cannot)."""
    advise = _madvise()
    if advise is None:
        return 0
    done = 0
    for start, end in _spans(tensors):
        ranges, refused = _collapse_span(advise, start, end)
        if refused and _collapses() and _off_file(start, end):
            ranges, _ = _collapse_span(advise, start, end)
        done += ranges
    return done


def _collapse_span(advise: Callable[[int, int, int], int], start: int, end: int) -> tuple[int, bool]:
    """The huge-page-aligned ranges of `[start, end)` collapsed, and whether any was refused as memory Linux never
    collapses (EINVAL: a file's mapping); after `REFUSALS` such ranges in a row the rest of the span is not asked."""
    first, done, in_a_row, refused = -(-start // HUGE_PAGE) * HUGE_PAGE, 0, 0, False
    for address in range(first, end - HUGE_PAGE + 1, HUGE_PAGE):
        if advise(address, HUGE_PAGE, MADV_COLLAPSE) == 0:
            done, in_a_row = done + 1, 0
        elif ctypes.get_errno() == errno.EINVAL:
            in_a_row, refused = in_a_row + 1, True
            if in_a_row == REFUSALS:
                break
    return done, refused


@functools.cache
def _collapses() -> bool:
    """Whether Linux collapses anonymous memory here (6.1 or later, with huge pages to give): a file's mapping moved
    onto anonymous memory gains nothing elsewhere. Asked once, of a fresh mapping."""
    libc = _libc()
    spare = libc.mmap(None, 2 * HUGE_PAGE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                      -1, 0)
    if spare in (None, MAP_FAILED):
        return False
    aligned = -(-spare // HUGE_PAGE) * HUGE_PAGE
    ctypes.memset(aligned, 1, HUGE_PAGE)
    collapses = libc.madvise(aligned, HUGE_PAGE, MADV_COLLAPSE) == 0
    libc.munmap(spare, 2 * HUGE_PAGE)
    return collapses


_MOVING = threading.Lock()  # two calls moving one mapping would copy it twice


def _off_file(start: int, end: int) -> bool:
    """Move every private file mapping that holds part of `[start, end)` onto anonymous memory at the same addresses,
    with the same protection, `CHUNK` bytes at a time; whether any moved. Shared mappings (writes reach the file)
    stay. Why a chunk at a time: a whole mapping copied before it replaced the file's pages held both, twice a model's
    size, where a chunk's copy replaces its part of the file at once."""
    moved = False
    with _MOVING:
        mappings = _file_mappings(start, end)
        size = sum(last - first for first, last, _ in mappings)
        if size >= ANNOUNCED:
            logger.warning("hf_eagle31: moving %.1f GB of weights mapped from their checkpoint file onto huge pages "
                           "(once a model, about 2 s a GB)", size / 1e9)
        for first, last, protection in mappings:
            while first < last:  # chunks end at multiples of CHUNK: huge-page-aligned
                chunk_end = min(last, (first // CHUNK + 1) * CHUNK)
                moved = _move(first, chunk_end, protection) or moved
                first = chunk_end
    return moved


def _move(first: int, last: int, protection: int) -> bool:
    """`[first, last)` of a file's private mapping replaced by an anonymous copy on huge pages (`mremap`)."""
    libc, size = _libc(), last - first
    spare = libc.mmap(None, size + HUGE_PAGE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                      -1, 0)
    if spare in (None, MAP_FAILED):
        return False
    copy = spare + (first - spare) % HUGE_PAGE  # the addresses' place in a huge page kept: PMDs move whole
    if copy > spare:
        libc.munmap(spare, copy - spare)
    libc.munmap(copy + size, spare + HUGE_PAGE - copy)
    libc.madvise(copy, size, MADV_HUGEPAGE)
    ctypes.memmove(copy, first, size)
    libc.mprotect(copy, size, protection)
    if libc.mremap(copy, size, size, MREMAP_MAYMOVE | MREMAP_FIXED, first) == first:
        return True
    libc.munmap(copy, size)
    return False


def _file_mappings(start: int, end: int) -> list[tuple[int, int, int]]:
    """The private, readable, not executable mappings of a file (Linux's /proc/self/maps) overlapping `[start, end)`
    and lying within the file, the one still at its path (a page past its end cannot be read): their addresses and
    protection."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            addresses, permissions, offset, _, inode, *path = line.split(maxsplit=5)
            first, last = (int(address, 16) for address in addresses.split("-"))
            if inode == "0" or permissions[0] != "r" or permissions[2:] != "-p" or not (first < end and start < last):
                continue
            try:
                file = os.stat(path[0].rstrip("\n")) if path else None
            except OSError:  # a file deleted or renamed since: its size unknown
                continue
            if file is not None and file.st_ino == int(inode) and \
                    int(offset, 16) + last - first <= -(-file.st_size // mmap.PAGESIZE) * mmap.PAGESIZE:
                found.append((first, last, mmap.PROT_READ | (mmap.PROT_WRITE if permissions[1] == "w" else 0)))
    return found


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
    libc = _libc() if sys.platform.startswith("linux") else None
    return None if libc is None else libc.madvise


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """libc, its memory calls typed (Linux's `mremap` included); None where it has none of them."""
    pointer, size, number = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    calls = {"mmap": ([pointer, size, number, number, number, ctypes.c_long], pointer),
             "mremap": ([pointer, size, size, number, pointer], pointer), "munmap": ([pointer, size], number),
             "mprotect": ([pointer, size, number], number), "madvise": ([pointer, size, number], number)}
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        for name, (arguments, result) in calls.items():
            getattr(libc, name).argtypes, getattr(libc, name).restype = arguments, result
    except (OSError, AttributeError):
        return None
    return libc
