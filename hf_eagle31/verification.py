"""Verifying a draft tree with one target forward: the attention function EAGLE runs the target on, each
verification mode's attention over a verify block, and the forward itself.

Any decoder attention layer works the same way: a verify token at cache index `c` sees exactly
the keys a one-token decode step at `c` would see. A sliding-window layer (transformers passes it
`sliding_window`) sees only the keys above `c - window`, counted over cache indices like
transformers' own mask, and its cache layer may hold only the last `window - 1` keys (transformers'
`DynamicSlidingWindowLayer`, which the decoding loops put in past-recording mode so a rejected
draft can be rolled back). Everything else a layer does (logit softcapping, attention sinks,
scaling) is left to the target's own attention function, which computes every verify block.
The plan a verify forward follows is `verify_plan.VerifyPlan`; the walk over the verified tree is
`acceptance.py`, the compaction of the accepted entries `cache.compact_cache`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from transformers import AttentionInterface, Cache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from hf_eagle31.cache import static_capacity
from hf_eagle31.compat import CACHE_KWARG
from hf_eagle31.drafting import DraftTree
from hf_eagle31.exact import decode_equivalent_attention, exact_mode
from hf_eagle31.features import capture_request, select_features
from hf_eagle31.kernels.tree_attention import grouped_attention, tree_attention
from hf_eagle31.verify_plan import VerifyPlan

ATTENTION_NAME = "eagle_tree"  # the target's SDPA underneath
EAGER_ATTENTION_NAME = "eagle_tree_eager"  # the target's own eager attention underneath


class UnsupportedTargetError(ValueError):
    """The target's architecture cannot be verified exactly by EAGLE (raised before decoding starts)."""


def has_sliding_window(text_config) -> bool:
    """Whether any layer of this (text) config attends over a sliding window."""
    return bool(getattr(text_config, "sliding_window", None)) or \
        "sliding_attention" in (getattr(text_config, "layer_types", None) or ())


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
