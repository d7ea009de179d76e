"""Cache surgery: rolling a target's or drafter's KV cache back, compacting the accepted entries of a verify block,
and how many draft nodes a static cache still takes (`draft_budget`). Everything EAGLE does to a transformers `Cache`
beyond `update`."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer, StaticLayer


def truncate_cache(cache: Cache, length: int) -> None:
    """Drop cache entries past `length`: a static layer rolls its length back (the next block overwrites the
    entries past it, nothing is reallocated), a dynamic one crops (negative `crop` works on every transformers 5.x).

    Cropping nothing still shrinks a sliding-window layer that recorded a verify block back to its
    window (transformers' `crop(0)`), so a run of fully accepted steps does not grow it.
    """
    surplus = int(cache.get_seq_length()) - length
    if surplus < 0:
        return
    for layer in cache.layers:
        if surplus == 0 and type(layer) is DynamicLayer:  # its `crop(0)` does nothing: 30 calls a SmolLM2 step
            continue
        if isinstance(layer, StaticLayer):
            layer.cumulative_length.fill_(length)
        else:
            layer.crop(-surplus)


def static_capacity(cache: Cache) -> int | None:
    """How many tokens a static cache holds (its layers return that many keys); None for a cache that grows."""
    static = [layer.max_cache_len for layer in cache.layers if isinstance(layer, StaticLayer)]
    return min(static) if static else None


def draft_budget(cache: Cache) -> int:
    """How many draft nodes still fit after the root: a static cache holds `static_capacity` tokens, a dynamic one
    grows."""
    capacity = static_capacity(cache)
    return 1 << 30 if capacity is None else capacity - int(cache.get_seq_length()) - 1


def compact_cache(cache: Cache, start: int, kept: list[torch.Tensor],
                  truncate: Callable[[Cache, int], None] = truncate_cache) -> torch.Tensor:
    """Pack each row's kept block entries (`kept[b]`, ascending) at `start`, cut the block to the longest.

    Returns the `[B, longest]` bool mask of the packed entries that are real (the rest are holes).
    `start` counts every token cached before the block; a sliding-window layer holds fewer, so each
    dynamic layer finds the block at its own end; a static layer has it at `start`. Keys and values
    are gathered separately: their head sizes differ in MLA targets (DeepSeek, MiniCPM3). `truncate` then drops
    the entries past them (a backend's own where it holds the cache's tensors: the CPU backend's cuts them in place).
    """
    block = int(cache.get_seq_length()) - start
    longest = max(k.shape[0] for k in kept)
    device = next(layer.keys.device for layer in cache.layers if layer.is_initialized)
    if all(k.shape[0] == block for k in kept):  # every row keeps its whole block (a plain step's): nothing moves
        truncate(cache, start + block)
        return torch.ones(len(kept), block, dtype=torch.bool, device=device)
    index = torch.zeros(len(kept), longest, dtype=torch.long, device=device)
    real = torch.zeros(len(kept), longest, dtype=torch.bool, device=device)
    for b, k in enumerate(kept):
        index[b, : k.shape[0]] = k.to(device)
        real[b, : k.shape[0]] = True
    in_place = all(torch.equal(k.cpu(), torch.arange(k.shape[0])) for k in kept)  # a chain's, or the root alone
    gathers = {}  # (heads, head size) -> the index expanded to them: layers share a few shapes
    for layer in cache.layers:
        if in_place or not layer.is_initialized:
            continue
        first = start if isinstance(layer, StaticLayer) else layer.keys.shape[2] - block
        for entries in (layer.keys, layer.values):
            shape = entries.shape[1], entries.shape[3]
            if shape not in gathers:
                gathers[shape] = index[:, None, :, None].expand(-1, shape[0], -1, shape[1])
            entries[:, :, first : first + longest] = entries[:, :, first : first + block].gather(2, gathers[shape])
    truncate(cache, start + longest)
    return real


class DraftCache:
    """The drafter's KV cache in fixed buffers, `[B, kv_heads, capacity, D]` per layer, each `update` written at the
    cache indices `at` (`[n]`, a device tensor) and returning the first `width` slots, or all (the caller's mask
    hides the slots not written).

    Why not a transformers cache: a draft writes its levels after the real entries and the next catch-up
    overwrites them. `DynamicCache` concatenates (each level copies the whole cache and every step has new
    shapes); `StaticCache` writes where the attention's `cache_kwargs` say, which every drafter layer would
    then pass. Here the drafter's layers call `update(key, value, layer_idx)` and the drafting says where, so a
    draft of one shape runs the same kernels on the same tensors at every step (what a CUDA graph replays).
    `version` names the buffers, unique in the process: it changes whenever they are replaced (grown, rows
    selected), and a capture of other buffers is stale.
    """

    _versions = itertools.count()

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.at: torch.Tensor | None = None
        self.width: int | None = None  # the slots `update` returns, the first ones (None: all)
        self.version = next(self._versions)
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def buffers(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s key and value buffers, made for entries like `key` and `value` `[B, heads, n, D]` at its
        first update: zeros, not empty, as a hidden slot's value must not be NaN (0 * NaN)."""
        if layer_idx not in self.layers:
            self.layers[layer_idx] = tuple(new.new_zeros(*new.shape[:2], self.capacity, new.shape[3])
                                           for new in (key, value))
        return self.layers[layer_idx]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.buffers(layer_idx, key, value)
        keys.index_copy_(2, self.at, key)
        values.index_copy_(2, self.at, value)
        return keys[:, :, : self.width], values[:, :, : self.width]

    def grow(self, capacity: int) -> None:
        self.capacity, self.version = capacity, next(self._versions)
        self.layers = {index: tuple(torch.cat([part, part.new_zeros(*part.shape[:2], capacity - part.shape[2],
                                                                      part.shape[3])], dim=2) for part in pair)
                       for index, pair in self.layers.items()}

    def select(self, rows: torch.Tensor) -> None:
        self.version = next(self._versions)
        self.layers = {index: (keys[rows], values[rows]) for index, (keys, values) in self.layers.items()}
