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
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, Cache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_eagle31.drafting import DraftTree, truncate_cache
from hf_eagle31.features import capture_request, select_features
from hf_eagle31.kernels.tree_attention import tree_attention

ATTENTION_NAME = "eagle_tree"


@dataclass
class VerifyPlan:
    """Which cached keys each token of a verify block may see, worked out once per target forward.

    `mask` is the block's `[n, n]` ancestor mask (keys before the block are visible to all). For
    the CPU path, nodes are grouped by how many block keys they see: `groups` holds, per group,
    the node indices and the visible block columns `[g, count]`. Every layer reuses the plan.
    """

    mask: torch.Tensor
    groups: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> "VerifyPlan":
        counts = mask.sum(dim=-1)
        groups = []
        for count in counts.unique().tolist():
            nodes = (counts == count).nonzero().flatten()
            groups.append((nodes, mask[nodes].nonzero()[:, 1].view(nodes.shape[0], count)))
        return cls(mask, groups)

    @classmethod
    @functools.lru_cache(maxsize=64)
    def causal(cls, n: int, device: torch.device) -> "VerifyPlan":
        return cls.from_mask(torch.ones(n, n, dtype=torch.bool, device=device).tril())


def tree_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function used while EAGLE decodes (`attn_implementation="eagle_tree"`).

    transformers builds no mask for it. A prefill or a one-token step is exactly transformers' SDPA
    path; a verify block (a chain, or a tree whose `VerifyPlan` arrives as the `eagle_verify_plan`
    forward kwarg) sees the cached prefix plus its own ancestors, computed by the Triton kernel if
    the `eagle_use_kernel` kwarg says so (CUDA only), else decode-equivalently.
    """
    plan = kwargs.pop("eagle_verify_plan", None)
    use_kernel = kwargs.pop("eagle_use_kernel", False)
    n, total = query.shape[2], key.shape[2]
    if plan is None and n in (1, total):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    window = kwargs.get("sliding_window")
    if window is not None and total > window:
        raise NotImplementedError(
            "EAGLE verification does not support sliding-window attention past the window "
            f"({total} > {window} tokens); use this target without an EAGLE drafter for such long inputs."
        )
    plan = plan or VerifyPlan.causal(n, query.device)
    if use_kernel and query.is_cuda:
        return tree_attention(query, key, value, plan.mask, scaling).transpose(1, 2).contiguous(), None
    return decode_equivalent_attention(module, query, key, value, plan, scaling, dropout, **kwargs)


def decode_equivalent_attention(module, query, key, value, plan: VerifyPlan, scaling, dropout, **kwargs):
    """The verify block's attention computed the way one-token decoding computes it.

    Why: one batched attention over the block sums in a different order than a decode step does,
    and in bf16 that flips near-tied argmaxes, so greedy output would drift from plain `generate`.
    Each node instead runs transformers' SDPA with a single query over exactly the keys a decode
    step at its position would see: the prefix, then its ancestors in order. Nodes that see the
    same number of keys share one batched call: on CPU, SDPA is batch-invariant in bf16/fp16, so
    this is bit-exact there; in fp32 batching can change the last bit (~1e-8 relative).
    A chain node's keys are a contiguous slice of the cache (no copy); a tree node's are gathered.
    """
    prefix = key.shape[2] - plan.mask.shape[0]
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    for nodes, visible in plan.groups:
        count = visible.shape[1]
        if nodes.shape[0] == 1 and int(visible[0, -1]) == count - 1:  # a chain node
            keys, values = key[:, :, : prefix + count], value[:, :, : prefix + count]
        else:
            index = torch.cat([torch.arange(prefix, device=visible.device).expand(nodes.shape[0], -1), prefix + visible], 1)
            keys, values = (gather_keys(cached[0], index) for cached in (key, value))
        queries = query[0].transpose(0, 1)[nodes, :, None]  # [g, heads, 1, dim], laid out like a decode step's
        attended, _ = sdpa_attention_forward(module, queries, keys, values, None, dropout=dropout, scaling=scaling, **kwargs)
        out[0, nodes] = attended[:, 0]
    return out, None


def gather_keys(cached: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`[heads, S, dim]` gathered to `[g, heads, L, dim]` at `index [g, L]` (index_select: ~30% faster than indexing)."""
    heads, dim = cached.shape[0], cached.shape[-1]
    return cached.index_select(1, index.flatten()).view(heads, *index.shape, dim).transpose(0, 1).contiguous()


AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)


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
    use_kernel: bool = False,
) -> BlockOutput:
    """One target forward over the block (the target must be using `eagle_tree` attention)."""
    out = target(
        input_ids=tokens[None],
        position_ids=positions[None],
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=capture_request(target_layer_ids),
        eagle_verify_plan=VerifyPlan.from_mask(ancestor_mask),
        eagle_use_kernel=use_kernel,
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
    use_kernel: bool = False,
) -> StepResult:
    """Verify `tree` (root = last emitted token, not yet in the cache), walk, compact, feed the drafter.

    `emit(node, raw_logits)` is called once per walked node with the node's raw target logits; it
    processes them, picks the next token, records it, and returns `(token, stop)`.
    With `chunk_depth`, the tree is verified in depth-ordered chunks ("micro-batched" verification):
    the next chunk, rooted at the accepted child, runs only if the walk reaches it.
    """
    start = cache.get_seq_length()
    position_base = start  # the tree root sits at position `start`; node positions are start + depth
    children = children_by_token(tree)
    emitted: list[int] = []
    walked: list[int] = []  # the root, then every accepted node
    forwards = 0
    root = 0
    while True:
        block = subtree(tree, root, chunk_depth)
        block_start = cache.get_seq_length()
        mask = tree.ancestor_mask()[block][:, block]
        out = verify_block(
            target, cache, tree.tokens[block], position_base + tree.depths[block], mask, target_layer_ids, use_kernel
        )
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
