"""Verifying a draft tree with one target forward, accepting the longest valid path, compacting the KV cache.

Acceptance is the same walk for greedy and sampling: at each node the target's processed
distribution picks a token exactly as plain `generate` would (argmax, or a sample); if a child of
the node carries that token the walk moves there, otherwise the token is the step's bonus token.
For sampling this is multi-candidate recursive rejection sampling with the tree's children as
deterministic proposals (a proposal of probability one is accepted with probability p(x), and
the residual after removing it is p restricted to the other tokens): the emitted tokens are
distributed exactly as the target's, and each step accepts a child with probability p(children).

Any decoder attention layer works the same way: a verify token at cache index `c` sees exactly
the keys a one-token decode step at `c` would see. A sliding-window layer (transformers passes it
`sliding_window`) sees only the keys above `c - window`, counted over cache indices like
transformers' own mask, and its cache layer may hold only the last `window - 1` keys (transformers'
`DynamicSlidingWindowLayer`, which the decoding loops put in past-recording mode so a rejected
draft can be rolled back). Everything else a layer does (logit softcapping, attention sinks,
scaling) is left to the target's own attention function, which computes every verify block.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, Cache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from hf_eagle31.cache import static_capacity
from hf_eagle31.compat import CACHE_KWARG
from hf_eagle31.configuration import VERIFY_MODES
from hf_eagle31.drafting import DraftTree
from hf_eagle31.exact import additive_mask, decode_equivalent_attention, exact_mode
from hf_eagle31.features import capture_request, select_features
from hf_eagle31.kernels.tree_attention import fold_mask, grouped_attention, tree_attention

ATTENTION_NAME = "eagle_tree"  # the target's SDPA underneath
EAGER_ATTENTION_NAME = "eagle_tree_eager"  # the target's own eager attention underneath


class UnsupportedTargetError(ValueError):
    """The target's architecture cannot be verified exactly by EAGLE (raised before decoding starts)."""


def has_sliding_window(text_config) -> bool:
    """Whether any layer of this (text) config attends over a sliding window."""
    return bool(getattr(text_config, "sliding_window", None)) or \
        "sliding_attention" in (getattr(text_config, "layer_types", None) or ())


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

        Why: SDPA converts a boolean mask at every call, two ops per layer (~1 ms of a 50 ms verify forward of
        SmolLM2 on the 2-core CPU); the layers that share a key length and window share one conversion."""
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


def own_attention(module: torch.nn.Module, eager: bool) -> Callable:
    """The attention function the target's layer runs outside EAGLE: SDPA, or the eager one of its modeling file."""
    return sys.modules[type(module).__module__].eager_attention_forward if eager else sdpa_attention_forward


def tree_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, eager=False,
                           **kwargs):
    """transformers attention function used while EAGLE decodes (`attn_implementation="eagle_tree"`, or
    "eagle_tree_eager" for a target that runs eager attention, with `eager=True`).

    A forward without a `VerifyPlan` (a prefill, a one-token step, another thread's plain call) is
    exactly the target's own attention with transformers' mask. A verify block (its plan arrives as
    the `eagle_verify_plan` forward kwarg) sees what the plan's `layer_mask` says for this layer's
    keys and window; the mask transformers built (for a chain) or was given (a tree) is not used.
    """
    plan = kwargs.pop("eagle_verify_plan", None)
    attention = own_attention(module, eager)
    if plan is None:
        return attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    window = kwargs.get("sliding_window")
    if plan.mode == "exact":
        return decode_equivalent_attention(module, query, key, value, plan, window, scaling, dropout, attention,
                                           **kwargs)
    if plan.mode == "kernel" and query.is_cuda and plan.mask.shape[0] == 1 and plan.key_padding is None and \
            window is None and not eager:
        return tree_attention(query, key, value, plan.mask[0], scaling).transpose(1, 2).contiguous(), None
    if eager:  # softcapping, attention sinks and the like stay the target's own business
        return attention(module, query, key, value, plan.additive_layer_mask(key.shape[2], window, query.dtype),
                         scaling=scaling, dropout=dropout, **kwargs)
    # torch's SDPA directly (transformers' wrapper copies K/V per query head whenever a mask is given), each
    # group of query heads as one block
    mask = plan.additive_layer_mask(key.shape[2], window, query.dtype, query.shape[1] // key.shape[1])
    return grouped_attention(query, key, value, mask, scaling).transpose(1, 2).contiguous(), None


def verifying_attention(previous: str) -> str:
    """The attention implementation EAGLE runs a target on, given the one it runs outside EAGLE.

    An eager target stays on its own eager attention (that is where transformers models implement
    logit softcapping and attention sinks); every other one (SDPA, flash, flex) runs on SDPA.
    """
    return EAGER_ATTENTION_NAME if previous == "eager" else ATTENTION_NAME


# transformers builds each forward's mask (padding, window) for these names as for SDPA and eager
AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
AttentionInterface.register(EAGER_ATTENTION_NAME, functools.partial(tree_attention_forward, eager=True))
AttentionMaskInterface.register(EAGER_ATTENTION_NAME, eager_mask)


def verify_forward(target: PreTrainedModel, cache: Cache, plan: VerifyPlan, tokens: torch.Tensor,
                   positions: torch.Tensor, target_layer_ids: list[int], compiled: Callable | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over every row's block (`tokens`, `positions` `[B, n]`, the target in
    `eagle_verification` mode): raw float logits `[B, n, V]` and the drafter's features `[B, n, 3 H_t]`.

    The cache records past states first: a sliding-window layer then keeps the whole block until
    `compact_cache` has picked the accepted entries (and only then drops what falls out of its window).
    `compiled` is the target's compiled call (transformers' `compile_config` path, a "batched" plan on a
    static cache): the 4D mask alone then carries the plan, the target's own attention applies it, and
    dynamo traces one graph per block size. This is the default backend's verify forward (hf_eagle31.backends).
    """
    cache.activate_past_recording()
    total = static_capacity(cache) or int(cache.get_seq_length()) + tokens.shape[1]
    inputs = dict(input_ids=tokens, position_ids=positions, **{CACHE_KWARG: cache}, use_cache=True,
                  attention_mask=plan.layer_mask(total)[:, None],  # 4D: transformers passes it on (and builds no mask)
                  output_hidden_states=capture_request(target_layer_ids))
    if compiled is not None:
        out = compiled(**inputs)
    else:
        with exact_mode(plan):
            out = target(**inputs, eagle_verify_plan=plan)
    return out.logits.float(), select_features(out.hidden_states, target_layer_ids)


def subtree(tree: DraftTree, root: int, max_depth: int | None) -> torch.Tensor:
    """Indices of `root` and its descendants at most `max_depth` levels below it, in level order (the whole tree
    read from no value: a static draft's verify block is built without waiting for the draft)."""
    if root == 0 and max_depth is None:
        return torch.arange(len(tree), device=tree.tokens.device)
    inside = torch.zeros(len(tree), dtype=torch.bool)
    inside[root] = True
    limit = tree.depth if max_depth is None else int(tree.depths[root]) + max_depth
    for node, parent in enumerate(tree.parents.tolist()):
        if parent >= 0 and inside[parent] and int(tree.depths[node]) <= limit:
            inside[node] = True
    return inside.nonzero().flatten()
