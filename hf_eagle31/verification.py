"""Verifying a draft tree with one target forward, accepting the longest valid path, compacting the KV cache.

Acceptance is the same walk for greedy and sampling: at each node the target's processed
distribution picks a token exactly as plain `generate` would (argmax, or a sample); if a child of
the node carries that token the walk moves there, otherwise the token is the step's bonus token.
For sampling this is multi-candidate recursive rejection sampling with the tree's children as
deterministic proposals (a proposal of probability one is accepted with probability p(x), and
the residual after removing it is p restricted to the other tokens): the emitted tokens are
distributed exactly as the target's, and each step accepts a child with probability p(children).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface, Cache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_eagle31.drafting import DraftTree, truncate_cache
from hf_eagle31.features import capture_request, select_features
from hf_eagle31.kernels.tree_attention import tree_attention

ATTENTION_NAME = "eagle_tree"
VERIFY_MODES = ("batched", "kernel", "exact")


@functools.lru_cache(maxsize=64)
def _causal_mask(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()  # read only: shared by every call


@dataclass
class VerifyPlan:
    """How one verify forward computes the block's attention: its `[n, n]` ancestor mask, the mode, the padding.

    Keys before the block are visible to every block token, except the padding: `key_padding`
    (`[m]` bool, False for a pad) covers the first `m` keys (the prompt), the later ones are real.
    The modes (`verify_mode` in the drafter's generation config):
      * "batched": one SDPA call over the block with the tree mask, like every serving engine;
      * "kernel": the Triton tree-attention kernel (CUDA, unpadded; "batched" otherwise);
      * "exact": every block token computed the way a one-token decode step computes it, so the
        logits are bit-identical to plain decoding on any device (see `decode_equivalent_attention`
        and `RowByRowLinear`).
    A plan belongs to one forward of one call: nothing in it is shared between calls.
    """

    mask: torch.Tensor
    mode: str = "batched"
    key_padding: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.mode not in VERIFY_MODES:
            raise ValueError(f"verify_mode must be one of {VERIFY_MODES}, got {self.mode!r}")

    @classmethod
    def causal(cls, n: int, device: torch.device, mode: str = "batched",
               key_padding: torch.Tensor | None = None) -> "VerifyPlan":
        return cls(_causal_mask(n, device), mode, key_padding)

    def attention_mask(self, total: int) -> torch.Tensor:
        """`[1, 1, n, total]` bool: the real keys before the block, then the ancestors."""
        n = self.mask.shape[0]
        before = self.mask.new_ones(total - n)
        if self.key_padding is not None:
            before[: self.key_padding.shape[0]] = self.key_padding
        return torch.cat([before.expand(n, -1), self.mask], dim=1)[None, None]


def tree_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function used while EAGLE decodes (`attn_implementation="eagle_tree"`).

    transformers builds its SDPA mask for it (causal, with the padding). A forward without a
    `VerifyPlan` (a prefill, a one-token step, another thread's plain call) is exactly transformers'
    SDPA path; a verify block (its plan arrives as the `eagle_verify_plan` forward kwarg) sees the
    real keys before it plus its own ancestors, computed as the plan's mode says. In chain mode the
    mask is transformers' causal one; tree mode passes the plan's as a 4D `attention_mask`.
    """
    plan = kwargs.pop("eagle_verify_plan", None)
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    total = key.shape[2]
    window = kwargs.get("sliding_window")
    if window is not None and total > window:
        raise NotImplementedError(
            "EAGLE verification does not support sliding-window attention past the window "
            f"({total} > {window} tokens); use this target without an EAGLE drafter for such long inputs."
        )
    mask = attention_mask if attention_mask is not None else plan.attention_mask(total)
    if plan.mode == "exact":
        return decode_equivalent_attention(module, query, key, value, plan, mask, scaling, dropout, **kwargs)
    if plan.mode == "kernel" and query.is_cuda and plan.key_padding is None:
        return tree_attention(query, key, value, plan.mask, scaling).transpose(1, 2).contiguous(), None
    # torch's SDPA directly: transformers' wrapper copies K/V per query head whenever a mask is given
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def decode_equivalent_attention(module, query, key, value, plan: VerifyPlan, attention_mask, scaling, dropout,
                                **kwargs):
    """The verify block's attention computed the way one-token decoding computes it.

    Why: one batched attention over the block sums in a different order than a decode step does,
    which can flip a near-tied argmax (often, in bf16). Each node instead runs transformers' SDPA
    with a single query over exactly the keys a decode step at its position would see: the prefix,
    then its ancestors in order. A chain node's keys are a contiguous slice of the cache (no copy);
    a tree node's are gathered. A decode step masks only padding, so only a padded prompt gets
    a mask here: the node's row of `attention_mask` (`[1, 1, n, total]`) over the same keys.
    """
    prefix = key.shape[2] - plan.mask.shape[0]
    padded = plan.key_padding is not None
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    for node, row in enumerate(plan.mask):
        visible = row.nonzero().flatten()
        count = visible.shape[0]
        if int(visible[-1]) == count - 1:  # the node and all block tokens before it: a slice
            keys, values = key[:, :, : prefix + count], value[:, :, : prefix + count]
            mask = attention_mask[:, :, node : node + 1, : prefix + count] if padded else None
        else:
            index = torch.cat([torch.arange(prefix, device=visible.device), prefix + visible])
            keys, values = key.index_select(2, index), value.index_select(2, index)
            mask = attention_mask[:, :, node : node + 1].index_select(3, index) if padded else None
        attended, _ = sdpa_attention_forward(module, query[:, :, node : node + 1], keys, values, mask,
                                             dropout=dropout, scaling=scaling, **kwargs)
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


AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # the padding reaches every forward, as under SDPA


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
    key_padding: torch.Tensor | None = None,
) -> BlockOutput:
    """One target forward over the block (the target must be in `eagle_verification` mode)."""
    plan = VerifyPlan(ancestor_mask, mode, key_padding)
    out = target(
        input_ids=tokens[None],
        position_ids=positions[None],
        attention_mask=plan.attention_mask(cache.get_seq_length() + tokens.shape[0]),  # 4D: transformers passes it on
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=capture_request(target_layer_ids),
        eagle_verify_plan=plan,
    )
    return BlockOutput(out.logits[0].float(), select_features(out.hidden_states, target_layer_ids)[0])


def compact_cache(cache: Cache, start: int, keep: torch.Tensor) -> None:
    """Keep the block entries `start + keep` (ascending) at `start, start + 1, ...` and drop the rest, in place."""
    length = start + keep.shape[0]
    for layer in cache.layers:
        index = (start + keep).to(layer.keys.device)
        layer.keys[:, :, start:length] = layer.keys.index_select(2, index)
        layer.values[:, :, start:length] = layer.values.index_select(2, index)
    truncate_cache(cache, length)


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


def verify_tree(
    target: PreTrainedModel,
    cache: Cache,
    tree: DraftTree,
    target_layer_ids: list[int],
    emit: Callable[[int, torch.Tensor, torch.Tensor], tuple[int, bool]],
    push_features: Callable[[torch.Tensor, torch.Tensor], None],
    chunk_depth: int | None = None,
    mode: str = "batched",
    key_padding: torch.Tensor | None = None,
) -> StepResult:
    """Verify `tree` (root = last emitted token, not yet in the cache), walk, compact, feed the drafter.

    `emit(node, raw_logits)` is called once per walked node with the node's raw target logits; it
    processes them, picks the next token, records it, and returns `(token, stop)`.
    With `chunk_depth`, the tree is verified in depth-ordered chunks ("micro-batched" verification):
    the next chunk, rooted at the accepted child, runs only if the walk reaches it.
    `key_padding` marks the pads of a padded prompt (see `VerifyPlan`).
    """
    start = cache.get_seq_length()
    pads = 0 if key_padding is None else int((~key_padding).sum())
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
                           target_layer_ids, mode, key_padding)
        forwards += 1
        local = {int(node): i for i, node in enumerate(block.tolist())}
        kept, next_tokens = [], []
        node, next_root, stop = root, None, False
        while True:
            token, stop = emit(node, out.logits[local[node]])
            emitted.append(token)
            walked.append(node)
            kept.append(local[node])
            next_tokens.append(token)
            child = children[node].get(token)
            if stop or child is None:
                break
            if child not in local:
                next_root = child
                break
            node = child
        keep = torch.tensor(kept, device=tree.tokens.device)
        compact_cache(cache, block_start, keep)
        if stop or next_root is None:
            if not stop:
                push_features(out.features[keep][None], torch.tensor([next_tokens], device=tree.tokens.device))
            return StepResult(emitted, walked[1:], forwards, stop)
        push_features(out.features[keep][None], torch.tensor([next_tokens], device=tree.tokens.device))
        root = next_root
