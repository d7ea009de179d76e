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
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface, Cache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from hf_eagle31.drafting import DraftTree, truncate_cache
from hf_eagle31.features import capture_request, select_features
from hf_eagle31.kernels.tree_attention import tree_attention

ATTENTION_NAME = "eagle_tree"  # the target's SDPA underneath
EAGER_ATTENTION_NAME = "eagle_tree_eager"  # the target's own eager attention underneath
VERIFY_MODES = ("batched", "kernel", "exact")


class UnsupportedTargetError(ValueError):
    """The target's architecture cannot be verified exactly by EAGLE (raised before decoding starts)."""


def has_sliding_window(text_config) -> bool:
    """Whether any layer of this (text) config attends over a sliding window."""
    return bool(getattr(text_config, "sliding_window", None)) or \
        "sliding_attention" in (getattr(text_config, "layer_types", None) or ())


def pick_token(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """The next token `[1, 1]` from processed scores `[1, V]`, as plain `generate` picks it: a sample or the argmax."""
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), 1)
    return scores.argmax(dim=-1, keepdim=True)


@functools.lru_cache(maxsize=64)
def _causal_mask(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()  # read only: shared by every call


@dataclass
class VerifyPlan:
    """How one verify forward computes the block's attention: its `[n, n]` ancestor mask, the mode, the cache.

    Keys before the block are visible to every block token (within its layer's window), except
    the padding: `key_padding` (bool, False for a pad) has one entry per token cached before the
    block. `held` maps a layer index to how many keys before the new one its cache layer keeps
    (`window - 1` for transformers' `DynamicSlidingWindowLayer`); other layers keep them all.
    The modes (`verify_mode` in the drafter's generation config):
      * "batched": one attention call over the block with the tree mask, like every serving engine;
      * "kernel": the Triton tree-attention kernel (CUDA, SDPA targets, unpadded, layers without a
        window; "batched" otherwise);
      * "exact": every block token computed the way a one-token decode step computes it, so the
        logits are bit-identical to plain decoding on any device (see `decode_equivalent_attention`
        and `RowByRowLinear`).
    A plan belongs to one forward of one call: nothing in it is shared between calls.
    """

    mask: torch.Tensor
    mode: str = "batched"
    key_padding: torch.Tensor | None = None
    held: dict[int, int] = field(default_factory=dict)
    _layer_masks: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in VERIFY_MODES:
            raise ValueError(f"verify_mode must be one of {VERIFY_MODES}, got {self.mode!r}")

    @classmethod
    def for_cache(cls, mask: torch.Tensor, cache: Cache, mode: str = "batched",
                  prompt_padding: torch.Tensor | None = None) -> "VerifyPlan":
        """The plan for verifying a block after everything `cache` holds; `prompt_padding` is the prompt's mask."""
        key_padding = None
        if prompt_padding is not None:
            key_padding = prompt_padding.new_ones(cache.get_seq_length())
            key_padding[: prompt_padding.shape[0]] = prompt_padding
        held = {index: layer.sliding_window - 1 for index, layer in enumerate(cache.layers)
                if getattr(layer, "is_sliding", False)}
        return cls(mask, mode, key_padding, held)

    @classmethod
    def causal(cls, n: int, device: torch.device, cache: Cache, mode: str = "batched",
               prompt_padding: torch.Tensor | None = None) -> "VerifyPlan":
        """The plan for verifying a chain of `n` tokens (the last accepted one and the drafts)."""
        return cls.for_cache(_causal_mask(n, device), cache, mode, prompt_padding)

    @functools.cached_property
    def depths(self) -> torch.Tensor:
        """`[n]`: each block token's depth below the block's first token (its ancestors, itself excluded)."""
        return self.mask.sum(dim=1) - 1

    def layer_mask(self, key_length: int, window: int | None = None) -> torch.Tensor:
        """`[n, key_length]` bool: the keys each block token sees in a layer that returns `key_length` keys.

        The block's keys come last; the `key_length - n` before them are the latest the layer holds.
        A layer with a window hides from a token at depth `d` every key `window` or more places before it.
        """
        if (key_length, window) not in self._layer_masks:
            n = self.mask.shape[0]
            past = key_length - n
            seen = self.mask.new_ones(n, past)
            if self.key_padding is not None:
                seen = seen & self.key_padding[self.key_padding.shape[0] - past :]
            block = self.mask
            if window is not None:
                depths = self.depths
                seen = seen & (torch.arange(past, device=depths.device) > (past + depths - window)[:, None])
                block = block & (depths[:, None] - depths[None, :] < window)
            self._layer_masks[key_length, window] = torch.cat([seen, block], dim=1)
        return self._layer_masks[key_length, window]

    def held_keys(self, node: int, past: int, layer: int | None) -> torch.Tensor:
        """The keys (indices into the layer's `past + n`) a one-token decode step at `node` attends over.

        That step's cache layer holds every key before it, or only the last `held[layer]` of them.
        """
        ancestors = self.mask[node].nonzero().flatten()
        first = 0
        if layer in self.held:
            capacity, depths = self.held[layer], self.depths
            first = min(past, max(0, past + int(depths[node]) - capacity))  # a deep node may hold no cached key
            ancestors = ancestors[depths[node] - depths[ancestors] <= capacity]
        return torch.cat([torch.arange(first, past, device=ancestors.device), past + ancestors])


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
    mask = plan.layer_mask(key.shape[2], window)
    if eager:  # softcapping, attention sinks and the like stay the target's own business
        return attention(module, query, key, value, additive_mask(mask, query.dtype)[None, None], scaling=scaling,
                         dropout=dropout, **kwargs)
    if plan.mode == "kernel" and query.is_cuda and plan.key_padding is None and window is None:
        return tree_attention(query, key, value, plan.mask, scaling).transpose(1, 2).contiguous(), None
    # torch's SDPA directly: transformers' wrapper copies K/V per query head whenever a mask is given
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask[None, None], scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as eager attention takes it (added to the scores), with the values transformers' `eager_mask` uses."""
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)


def decode_equivalent_attention(module, query, key, value, plan: VerifyPlan, window: int | None, scaling, dropout,
                                attention: Callable = sdpa_attention_forward, **kwargs):
    """The verify block's attention computed the way one-token decoding computes it.

    Why: one batched attention over the block sums in a different order than a decode step does,
    which can flip a near-tied argmax (often, in bf16). Each node instead runs the target's own
    `attention` with a single query over exactly the keys a decode step at its position would see
    (`VerifyPlan.held_keys`: the cached keys, only the last `window - 1` of them in a sliding-window
    cache layer, then its ancestors in order), with the mask that step would get: transformers
    skips the SDPA mask of a decode step unless the prompt is padded or the keys fill the window;
    eager attention always gets one. A contiguous run of keys is a slice of the cache (no copy).
    """
    n = query.shape[2]
    past = key.shape[2] - n
    eager = attention is not sdpa_attention_forward
    rows = plan.layer_mask(key.shape[2], window)
    out = query.new_empty(query.shape[0], n, query.shape[1], value.shape[3])
    for node in range(n):
        held = plan.held_keys(node, past, getattr(module, "layer_idx", None))
        first, count = int(held[0]), held.shape[0]
        if int(held[-1]) - first + 1 == count:
            span = slice(first, first + count)
            keys, values, row = key[:, :, span], value[:, :, span], rows[node : node + 1, span]
        else:
            keys, values, row = key.index_select(2, held), value.index_select(2, held), rows[node : node + 1, held]
        mask = None
        if eager or plan.key_padding is not None or (window is not None and count >= window):
            mask = (additive_mask(row, query.dtype) if eager else row)[None, None]
        attended, _ = attention(module, query[:, :, node : node + 1], keys, values, mask, scaling=scaling,
                                dropout=dropout, **kwargs)
        out[:, node] = attended[:, 0]
    return out, None


class RowByRowLinear(TorchFunctionMode):
    """Inside an "exact" verify forward, every linear layer runs one block token at a time.

    Why: a matrix multiply over n rows is not bit-identical, row for row, to n one-row multiplies on
    most backends (MKL and oneDNN on CPU, cuBLAS on CUDA choose other kernels and reduction orders by
    shape), and plain decoding multiplies one row. Everything else in a decoder layer (norms,
    rotary, activations) works row by row already.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and args[0].dim() >= 2 and args[0].shape[-2] > 1:
            rows = args[0]
            return torch.cat([func(rows[..., i : i + 1, :], *args[1:], **kwargs) for i in range(rows.shape[-2])], -2)
        return func(*args, **kwargs)


_ROW_BY_ROW = threading.local()  # the mode is entered per thread (torch keeps its mode stack per thread)


def _enter_exact_mode(module, args, kwargs):
    plan = kwargs.get("eagle_verify_plan")
    if plan is not None and plan.mode == "exact":
        _ROW_BY_ROW.mode = RowByRowLinear()
        _ROW_BY_ROW.mode.__enter__()


def exact_mode_active() -> bool:
    """Whether this thread runs an "exact" verify forward (inside `RowByRowLinear`)."""
    return getattr(_ROW_BY_ROW, "mode", None) is not None


def leave_exact_mode(*unused) -> None:
    """Undo this thread's `_enter_exact_mode` (a forward hook, and the `finally` of every EAGLE `generate`)."""
    mode = _ROW_BY_ROW.__dict__.pop("mode", None)
    if mode is not None:
        mode.__exit__(None, None, None)


def exact_mode_hooks(target: PreTrainedModel) -> list:
    """Hooks that run "exact" verify forwards under `RowByRowLinear` (they see the plan in the forward's kwargs)."""
    return [
        target.register_forward_pre_hook(_enter_exact_mode, with_kwargs=True),
        target.register_forward_hook(leave_exact_mode, with_kwargs=True, always_call=True),
    ]


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


@dataclass
class BlockOutput:
    logits: torch.Tensor  # [n, V] float32, raw
    features: torch.Tensor  # [n, 3 * H_t]


def verify_block(
    target: PreTrainedModel,
    cache: Cache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    ancestor_mask: torch.Tensor,
    target_layer_ids: list[int],
    mode: str = "batched",
    prompt_padding: torch.Tensor | None = None,
) -> BlockOutput:
    """One target forward over the block (the target must be in `eagle_verification` mode).

    The cache records past states first: a sliding-window layer then keeps the whole block until
    `compact_cache` has picked the accepted entries (and only then drops what falls out of its window).
    """
    cache.activate_past_recording()
    plan = VerifyPlan.for_cache(ancestor_mask, cache, mode, prompt_padding)
    total = cache.get_seq_length() + tokens.shape[0]
    out = target(
        input_ids=tokens[None],
        position_ids=positions[None],
        attention_mask=plan.layer_mask(total)[None, None],  # 4D: transformers passes it on (and builds no mask)
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=capture_request(target_layer_ids),
        eagle_verify_plan=plan,
    )
    return BlockOutput(out.logits[0].float(), select_features(out.hidden_states, target_layer_ids)[0])


def compact_cache(cache: Cache, start: int, keep: torch.Tensor) -> None:
    """Keep the block entries `start + keep` (ascending) at `start, start + 1, ...` and drop the rest, in place.

    `start` counts every token cached before the block; a sliding-window layer holds fewer, so each
    layer finds the block at its own end.
    """
    block = cache.get_seq_length() - start
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        first = layer.keys.shape[2] - block
        index = (first + keep).to(layer.keys.device)
        layer.keys[:, :, first : first + keep.shape[0]] = layer.keys.index_select(2, index)
        layer.values[:, :, first : first + keep.shape[0]] = layer.values.index_select(2, index)
    truncate_cache(cache, start + keep.shape[0])


def subtree(tree: DraftTree, root: int, max_depth: int | None) -> torch.Tensor:
    """Indices of `root` and its descendants at most `max_depth` levels below it, in level order."""
    inside = torch.zeros(len(tree), dtype=torch.bool)
    inside[root] = True
    limit = tree.depth if max_depth is None else int(tree.depths[root]) + max_depth
    for node, parent in enumerate(tree.parents.tolist()):
        if parent >= 0 and inside[parent] and int(tree.depths[node]) <= limit:
            inside[node] = True
    return inside.nonzero().flatten()


def children_by_token(tree: DraftTree) -> list[dict[int, int]]:
    children: list[dict[int, int]] = [{} for _ in range(len(tree))]
    for node, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())):
        if parent >= 0:
            children[parent].setdefault(token, node)
    return children


@dataclass
class StepResult:
    tokens: list[int]  # emitted tokens, the last one is the bonus token
    path: list[int]  # the accepted draft nodes, root excluded
    forwards: int  # target forwards spent
    stopped: bool  # a stopping criterion fired on one of the tokens

    @property
    def accepted(self) -> int:
        return len(self.path)


@dataclass
class Walk:
    nodes: list[int]  # the walked nodes: the start node, then every accepted child
    tokens: list[int]  # the token the target emitted at each walked node
    stopped: bool  # a stopping criterion fired
    next_root: int | None  # an accepted child outside the verified nodes (its subtree is verified next)


def walk(children: list[dict[int, int]], start: int, emit: Callable[[int], tuple[int, bool]], verified) -> Walk:
    """The acceptance walk: the target emits a token at each node; the walk moves to the child carrying it.

    `emit(node)` processes the node's target logits, picks the token as plain `generate` would and
    returns `(token, stop)`; `verified` holds the nodes whose logits exist (a chunk of a micro-batched tree).
    """
    nodes, tokens, node = [], [], start
    while True:
        token, stop = emit(node)
        nodes.append(node)
        tokens.append(token)
        child = children[node].get(token)
        if stop or child is None:
            return Walk(nodes, tokens, stop, None)
        if child not in verified:
            return Walk(nodes, tokens, False, child)
        node = child


def verify_tree(
    target: PreTrainedModel,
    cache: Cache,
    tree: DraftTree,
    target_layer_ids: list[int],
    emit: Callable[[int, torch.Tensor], tuple[int, bool]],
    push_features: Callable[[torch.Tensor, torch.Tensor], None],
    chunk_depth: int | None = None,
    mode: str = "batched",
    prompt_padding: torch.Tensor | None = None,
) -> StepResult:
    """Verify `tree` (root = last emitted token, not yet in the cache), walk, compact, feed the drafter.

    `emit(node, raw_logits)` is called once per walked node with the node's raw target logits; it
    processes them, picks the next token, records it, and returns `(token, stop)`.
    With `chunk_depth`, the tree is verified in depth-ordered chunks ("micro-batched" verification):
    the next chunk, rooted at the accepted child, runs only if the walk reaches it.
    `prompt_padding` marks the pads of a padded prompt (False for a pad).
    """
    start = cache.get_seq_length()
    pads = 0 if prompt_padding is None else int((~prompt_padding).sum())
    position_base = start - pads  # the tree root's position (pads take none); node positions add their depth
    children = children_by_token(tree)
    emitted: list[int] = []
    walked: list[int] = []  # the root, then every accepted node
    forwards = 0
    root = 0
    while True:
        block = subtree(tree, root, chunk_depth)
        block_start = cache.get_seq_length()
        mask = tree.ancestor_mask()[block][:, block]
        out = verify_block(target, cache, tree.tokens[block], position_base + tree.depths[block], mask,
                           target_layer_ids, mode, prompt_padding)
        forwards += 1
        local = {int(node): i for i, node in enumerate(block.tolist())}
        chunk = walk(children, root, lambda node: emit(node, out.logits[local[node]]), local)
        emitted += chunk.tokens
        walked += chunk.nodes
        keep = torch.tensor([local[node] for node in chunk.nodes], device=tree.tokens.device)
        compact_cache(cache, block_start, keep)
        if not chunk.stopped:
            push_features(out.features[keep][None], torch.tensor([chunk.tokens], device=tree.tokens.device))
        if chunk.stopped or chunk.next_root is None:
            return StepResult(emitted, walked[1:], forwards, chunk.stopped)
        root = chunk.next_root
