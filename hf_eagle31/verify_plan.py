"""What one verify forward computes attention over: each block token's ancestors, the cached keys it sees (pads,
holes, sliding windows), and the verification mode.

A plan is built by the decoding loop before the forward and read by the attention functions of every mode
(`verification.tree_attention_forward`, `exact.decode_equivalent_attention`), so it sits below both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from transformers import Cache

from hf_eagle31.configuration import VERIFY_MODES
from hf_eagle31.kernels.tree_attention import fold_mask


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as eager attention takes it (added to the scores), with the values transformers' `eager_mask` uses."""
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)


@dataclass
class VerifyPlan:
    """How one verify forward computes attention: each row's `[n, n]` ancestor mask, the mode, the cache.

    Keys before the block are visible to every block token of their row (within its layer's
    window), except where `key_padding` (`[B, cached]` bool, None when all visible) is False: a
    prompt's pad, or a hole a batch left where a row accepted fewer tokens than another (decoding.py).
    `holes` (`[B, cached]`, None when there are none) tells the holes apart from the pads: a
    one-token decode step has the pads among its keys (masked) but never the holes. `held` maps a
    layer index to how many keys before the new one its cache layer keeps (`window - 1` for
    transformers' `DynamicSlidingWindowLayer`); other layers keep them all. `padded` says whether the
    prompts had pads (plain decoding then masks its one-token steps) and `batch_size` is the batch
    plain `generate` decodes, finished rows included: "exact" mode computes as that decoding would.
    The modes (`verify_mode` in the drafter's generation config):
      * "batched": one attention call over the block with the tree mask, like every serving engine;
      * "kernel": the Triton tree-attention kernel (CUDA, SDPA targets, one unpadded row, layers
        without a window; "batched" otherwise);
      * "exact": every block token computed the way a one-token decode step computes it, so the
        logits are bit-identical to plain decoding on any device (see `decode_equivalent_attention`
        and `RowByRowLinear`).
    A plan belongs to one forward of one call: nothing in it is shared between calls.
    """

    mask: torch.Tensor
    mode: str = "batched"
    key_padding: torch.Tensor | None = None
    holes: torch.Tensor | None = None
    held: dict[int, int] = field(default_factory=dict)
    padded: bool = False
    batch_size: int = 1
    cached: int | None = None  # tokens cached before the block (None: all the keys before it)
    _layer_masks: dict = field(default_factory=dict, init=False, repr=False)  # (keys, window) -> bool mask
    _additive_masks: dict = field(default_factory=dict, init=False, repr=False)  # (keys, window, dtype, groups)

    def __post_init__(self) -> None:
        if self.mode not in VERIFY_MODES:
            raise ValueError(f"verify_mode must be one of {VERIFY_MODES}, got {self.mode!r}")

    @classmethod
    def for_cache(cls, mask: torch.Tensor, cache: Cache, mode: str = "batched", key_mask: torch.Tensor | None = None,
                  prompt_length: int = 0, batch_size: int = 1, hidden: tuple[bool, bool] | None = None
                  ) -> "VerifyPlan":
        """The plan for verifying a block `mask` `[B, n, n]` after everything `cache` holds. `key_mask` `[B, cached]`
        marks the cached keys each row sees (None: all); the unseen ones among the first `prompt_length` are pads,
        the others holes. `hidden`: whether there may be pads and holes, as the caller knows them (the decoding
        loop), so the plan reads nothing back from the device before the verify forward; None: read from the mask.
        """
        if key_mask is None:
            hidden = False, False
        elif hidden is None:
            hidden = not bool(key_mask[:, :prompt_length].all()), not bool(key_mask[:, prompt_length:].all())
        padded, holed = hidden
        holes = None
        if holed:
            holes = ~key_mask
            holes[:, :prompt_length] = False
        held = {index: layer.sliding_window - 1 for index, layer in enumerate(cache.layers)
                if getattr(layer, "is_sliding", False)}
        return cls(mask, mode, key_mask if padded or holed else None, holes, held, padded, batch_size,
                   int(cache.get_seq_length()))

    @functools.cached_property
    def depths(self) -> torch.Tensor:
        """`[B, n]`: each block token's depth below its row's first block token (its ancestors, itself excluded)."""
        return self.mask.sum(dim=-1) - 1

    def past(self, key_length: int) -> int:
        """How many of a layer's `key_length` keys come before the block: the latest it holds (a sliding-window layer
        holds fewer than `cached`); a static layer returns every slot, those after the block unwritten."""
        past = key_length - self.mask.shape[1]
        return past if self.cached is None else min(past, self.cached)

    def layer_mask(self, key_length: int, window: int | None = None) -> torch.Tensor:
        """`[B, n, key_length]` bool: the keys each block token sees in a layer that returns `key_length` keys.

        The block's keys follow the `past` latest keys the layer holds; a static layer's unwritten slots
        after the block are hidden. A layer with a window hides from a token at depth `d` every key
        `window` or more places before it.
        """
        if (key_length, window) not in self._layer_masks:
            batch, n = self.mask.shape[:2]
            past = self.past(key_length)
            seen = self.mask.new_ones(batch, n, past)
            if self.key_padding is not None:
                seen = seen & self.key_padding[:, None, self.key_padding.shape[1] - past :]
            block = self.mask
            if window is not None:
                depths = self.depths
                seen = seen & (torch.arange(past, device=depths.device) > (past + depths - window)[..., None])
                block = block & (depths[..., :, None] - depths[..., None, :] < window)
            unwritten = self.mask.new_zeros(batch, n, key_length - past - n)
            self._layer_masks[key_length, window] = torch.cat([seen, block, unwritten], dim=2)
        return self._layer_masks[key_length, window]

    def additive_layer_mask(self, key_length: int, window: int | None, dtype: torch.dtype, groups: int = 1
                            ) -> torch.Tensor:
        """`layer_mask` `[B, 1, n, key_length]` as an additive mask (`additive_mask`), for SDPA and eager attention;
        with `groups`, folded for `grouped_attention`.

        Why: SDPA converts a boolean mask at every call, two ops per layer; the layers that share a key length and
        window share one conversion."""
        key = key_length, window, dtype, groups
        if key not in self._additive_masks:
            self._additive_masks[key] = fold_mask(additive_mask(self.layer_mask(key_length, window)[:, None], dtype),
                                                  groups)
        return self._additive_masks[key]

    def held_keys(self, row: int, node: int, past: int, layer: int | None) -> torch.Tensor:
        """The keys (indices into the layer's `past + n`) a one-token decode step at `node` of `row` attends over.

        That step's cache layer holds every key before it but the holes, or only the last `held[layer]` of them.
        """
        ancestors = self.mask[row, node].nonzero().flatten()
        first = 0
        if layer in self.held:
            capacity, depths = self.held[layer], self.depths[row]
            first = min(past, max(0, past + int(depths[node]) - capacity))  # a deep node may hold no cached key
            ancestors = ancestors[depths[node] - depths[ancestors] <= capacity]
        cached = torch.arange(first, past, device=ancestors.device)
        if self.holes is not None:
            cached = cached[~self.holes[row, self.holes.shape[1] - past + first :].to(cached.device)]
        return torch.cat([cached, past + ancestors])
