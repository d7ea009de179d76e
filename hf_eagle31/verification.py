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
import itertools
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface, Cache, PreTrainedModel
from transformers.cache_utils import StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from hf_eagle31 import llama_verify
from hf_eagle31.compat import CACHE_KWARG
from hf_eagle31.drafting import DraftTree, truncate_cache
from hf_eagle31.features import capture_request, select_features
from hf_eagle31.kernels.tree_attention import fold_mask, grouped_attention, tree_attention

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


def accept_or_resample(scores: torch.Tensor, token: int, proposal: torch.Tensor) -> torch.Tensor:
    """Speculative sampling's step `[1, 1]`: the drafted `token`, drawn from `proposal` q `[V]`, is kept with
    probability min(1, p/q), else a token is drawn from max(p - q, 0); either way it is distributed as p, the
    softmax of the processed `scores` `[1, V]` that plain `generate` samples from."""
    p = torch.softmax(scores[0].float(), dim=-1)
    q = proposal.to(p.device)
    if float(torch.rand(())) * float(q[token]) < float(p[token]):
        return torch.tensor([[token]], device=scores.device)
    residual = (p - q).clamp(min=0)
    return torch.multinomial(residual / residual.sum(), 1)[None]


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
                  prompt_length: int = 0, batch_size: int = 1) -> "VerifyPlan":
        """The plan for verifying a block `mask` `[B, n, n]` after everything `cache` holds. `key_mask` `[B, cached]`
        marks the cached keys each row sees (None: all); the unseen ones among the first `prompt_length` are pads,
        the others holes."""
        if key_mask is None or bool(key_mask.all()):
            key_padding = holes = None
        else:
            key_padding, holes = key_mask, ~key_mask
            holes[:, :prompt_length] = False
            holes = holes if bool(holes.any()) else None
        padded = key_padding is not None and not bool(key_mask[:, :prompt_length].all())
        held = {index: layer.sliding_window - 1 for index, layer in enumerate(cache.layers)
                if getattr(layer, "is_sliding", False)}
        return cls(mask, mode, key_padding, holes, held, padded, batch_size, int(cache.get_seq_length()))

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
    skips the SDPA mask of a decode step unless the prompts are padded or the keys fill the window;
    eager attention always gets one. Each row of a batch runs alone, over its keys without the
    batch's holes, as plain batched decoding computes each row of its one attention call. A
    contiguous run of keys is a slice of the cache (no copy).
    """
    n = query.shape[2]
    past = plan.past(key.shape[2])
    eager = attention is not sdpa_attention_forward
    masks = plan.layer_mask(key.shape[2], window)
    out = query.new_empty(query.shape[0], n, query.shape[1], value.shape[3])
    for row, node in itertools.product(range(query.shape[0]), range(n)):
        held = plan.held_keys(row, node, past, getattr(module, "layer_idx", None))
        first, count = int(held[0]), held.shape[0]
        if int(held[-1]) - first + 1 == count:
            held = slice(first, first + count)
        keys, values = key[row : row + 1, :, held], value[row : row + 1, :, held]
        mask = None
        if eager or plan.padded or (window is not None and count >= window):
            seen = masks[row, node : node + 1, held]
            mask = (additive_mask(seen, query.dtype) if eager else seen)[None, None]
        attended, _ = attention(module, query[row : row + 1, :, node : node + 1], keys, values, mask,
                                scaling=scaling, dropout=dropout, **kwargs)
        out[row, node] = attended[0, 0]
    return out, None


class RowByRowLinear(TorchFunctionMode):
    """Inside an "exact" verify forward, every linear layer runs one block position at a time, over
    `batch_size` rows.

    Why: a matrix multiply over n rows is not bit-identical, row for row, to n one-row multiplies on
    most backends (MKL and oneDNN on CPU, cuBLAS on CUDA choose other kernels and reduction orders by
    shape), and plain decoding multiplies one token of each of its `batch_size` rows at once (rows
    that finished included): each position is computed in that shape, with zero rows for the rows
    this batch no longer has. Everything else in a decoder layer (norms, rotary, activations) works
    row by row already.
    """

    def __init__(self, batch_size: int = 1):
        super().__init__()
        self.batch_size = batch_size

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return self.by_position(func, args[0], args[1:], kwargs)
        return func(*args, **kwargs)

    def by_position(self, func: Callable, rows: torch.Tensor, args, kwargs) -> torch.Tensor:
        """`func(rows, *args, **kwargs)` one block position at a time."""
        if rows.dim() < 2 or rows.shape[-2] == 1:
            return func(rows, *args, **kwargs)
        return torch.cat([self._position(func, rows[..., i : i + 1, :], args, kwargs)
                          for i in range(rows.shape[-2])], -2)

    def _position(self, func, position: torch.Tensor, args, kwargs) -> torch.Tensor:
        missing = self.batch_size - position.shape[0] if position.dim() == 3 else 0
        if missing <= 0:
            return func(position, *args, **kwargs)
        padded = torch.cat([position, position.new_zeros(missing, *position.shape[1:])])
        return func(padded, *args, **kwargs)[: position.shape[0]]


_ROW_BY_ROW = threading.local()  # the mode is entered per thread (torch keeps its mode stack per thread)


def _enter_exact_mode(module, args, kwargs):
    plan = kwargs.get("eagle_verify_plan")
    if plan is not None and plan.mode == "exact":
        _ROW_BY_ROW.mode = RowByRowLinear(plan.batch_size)
        _ROW_BY_ROW.mode.__enter__()


def exact_mode_active() -> bool:
    """Whether this thread runs an "exact" verify forward (inside `RowByRowLinear`)."""
    return getattr(_ROW_BY_ROW, "mode", None) is not None


def leave_exact_mode(*unused) -> None:
    """Undo this thread's `_enter_exact_mode` (a forward hook, and the `finally` of every EAGLE `generate`)."""
    mode = _ROW_BY_ROW.__dict__.pop("mode", None)
    if mode is not None:
        mode.__exit__(None, None, None)


class OwnForwardByPosition:
    """Linear layers with a forward of their own (bitsandbytes' 4- and 8-bit layers) run one block
    position at a time in an "exact" verify forward, their whole forward and not only the `F.linear`
    it may call.

    Why: bitsandbytes multiplies one token by a 4-bit weight with a fused kernel of its own (on CUDA)
    and several tokens by the dequantized weight through `F.linear`: split below its forward, each
    position would still take the several-token path, which one-token decoding never does.
    """

    def __init__(self, target: nn.Module):
        self.layers = [m for m in target.modules() if isinstance(m, nn.Linear) and type(m).forward is not nn.Linear.forward]
        self.own = [vars(m).get("forward") for m in self.layers]  # an instance's forward (accelerate's hooks) comes back
        for layer in self.layers:
            layer.forward = functools.partial(_forward_by_position, layer.forward)

    def remove(self) -> None:
        for layer, own in zip(self.layers, self.own):
            if own is None:
                del layer.forward
            else:
                layer.forward = own


def _forward_by_position(forward: Callable, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    mode = getattr(_ROW_BY_ROW, "mode", None)
    return forward(x, *args, **kwargs) if mode is None else mode.by_position(forward, x, args, kwargs)


def exact_mode_hooks(target: PreTrainedModel) -> list:
    """Hooks that run "exact" verify forwards under `RowByRowLinear` (they see the plan in the forward's kwargs)."""
    return [
        target.register_forward_pre_hook(_enter_exact_mode, with_kwargs=True),
        target.register_forward_hook(leave_exact_mode, with_kwargs=True, always_call=True),
        OwnForwardByPosition(target),
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


def static_capacity(cache: Cache) -> int | None:
    """How many tokens a static cache holds (its layers return that many keys); None for a cache that grows."""
    static = [layer.max_cache_len for layer in cache.layers if isinstance(layer, StaticLayer)]
    return min(static) if static else None


def verify_forward(target: PreTrainedModel, cache: Cache, plan: VerifyPlan, tokens: torch.Tensor,
                   positions: torch.Tensor, target_layer_ids: list[int],
                   compiled: Callable | None = None, lean: llama_verify.CacheRoom | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over every row's block (`tokens`, `positions` `[B, n]`, the target in
    `eagle_verification` mode): raw float logits `[B, n, V]` and the drafter's features `[B, n, 3 H_t]`.

    The cache records past states first: a sliding-window layer then keeps the whole block until
    `compact_cache` has picked the accepted entries (and only then drops what falls out of its window).
    `compiled` is the target's compiled call (transformers' `compile_config` path, a "batched" plan on a
    static cache): the 4D mask alone then carries the plan, the target's own attention applies it, and
    dynamo traces one graph per block size. `lean`: the target `llama_verify.fits` (a Llama on packed weights),
    whose forward then skips transformers' module dispatch, with the same result, growing the cache in this room.
    """
    if lean is not None and compiled is None and llama_verify.fits_step(cache, plan):
        return llama_verify.llama_verify_forward(target, cache, lean, plan, tokens, positions, target_layer_ids)
    cache.activate_past_recording()
    total = static_capacity(cache) or int(cache.get_seq_length()) + tokens.shape[1]
    inputs = dict(input_ids=tokens, position_ids=positions, **{CACHE_KWARG: cache}, use_cache=True,
                  attention_mask=plan.layer_mask(total)[:, None],  # 4D: transformers passes it on (and builds no mask)
                  output_hidden_states=capture_request(target_layer_ids))
    out = compiled(**inputs) if compiled is not None else target(**inputs, eagle_verify_plan=plan)
    return out.logits.float(), select_features(out.hidden_states, target_layer_ids)


def compact_cache(cache: Cache, start: int, kept: list[torch.Tensor]) -> torch.Tensor:
    """Pack each row's kept block entries (`kept[b]`, ascending) at `start`, cut the block to the longest.

    Returns the `[B, longest]` bool mask of the packed entries that are real (the rest are holes).
    `start` counts every token cached before the block; a sliding-window layer holds fewer, so each
    dynamic layer finds the block at its own end; a static layer has it at `start`. Keys and values
    are gathered separately: their head sizes differ in MLA targets (DeepSeek, MiniCPM3).
    """
    block = int(cache.get_seq_length()) - start
    longest = max(k.shape[0] for k in kept)
    device = next(layer.keys.device for layer in cache.layers if layer.is_initialized)
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
    truncate_cache(cache, start + longest)
    return real


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
