"""Proposing draft tokens with an EAGLE drafter: a chain, or an EAGLE-2 dynamic tree.

The drafter lags the target by one token: its cache entry `t` pairs the target's feature at `t`
with token `t + 1`. Only entries built from real target features are kept between steps; the
entries a draft adds are dropped at the next `catch_up`, which first feeds the features of what
the target has accepted since.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from hf_eagle31.modeling import Eagle3DraftModel


def truncate_cache(cache: DynamicCache, length: int) -> None:
    """Drop cache entries past `length` (negative `crop` works on every transformers 5.x).

    Cropping nothing still shrinks a sliding-window layer that recorded a verify block back to its
    window (transformers' `crop(0)`), so a run of fully accepted steps does not grow it.
    """
    surplus = cache.get_seq_length() - length
    if surplus >= 0:
        cache.crop(-surplus)


class DrafterState:
    """The drafter's KV cache, kept in step with what the target has accepted."""

    def __init__(self, drafter: Eagle3DraftModel):
        self.drafter = drafter
        self.cache = DynamicCache()
        self.length = 0
        self._features: list[torch.Tensor] = []
        self._tokens: list[torch.Tensor] = []

    def push(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Queue target features `[1, n, 3H]` with the token that followed each position `[1, n]`."""
        param = self.drafter.fc.weight
        self._features.append(features.to(param.device, param.dtype))
        self._tokens.append(next_tokens.to(param.device))

    @torch.no_grad()
    def catch_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the queued features; return the last position's fed-back state and draft logits."""
        truncate_cache(self.cache, self.length)
        features, tokens = torch.cat(self._features, dim=1), torch.cat(self._tokens, dim=1)
        self._features, self._tokens = [], []
        out = self.drafter(tokens, features, past_key_values=self.cache, logits_to_keep=1)
        self.length += tokens.shape[1]
        return out.hidden_states[:, -1:], out.logits


@torch.no_grad()
def draft_chain(
    state: DrafterState, steps: int, choose: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft `steps` tokens one after another.

    `choose` maps draft-vocabulary logits `[1, V_d]` to a target token id `[1, 1]`.
    Returns the target ids `[1, steps]` and the draft logits each was chosen from `[1, steps, V_d]`.
    """
    hidden, logits = state.catch_up()
    tokens, all_logits = [], []
    for step in range(steps):
        token = choose(logits[:, -1])
        tokens.append(token)
        all_logits.append(logits)
        if step + 1 < steps:
            out = state.drafter(token, hidden, past_key_values=state.cache)
            hidden, logits = out.hidden_states, out.logits
    return torch.cat(tokens, dim=1), torch.cat(all_logits, dim=1)


@dataclass
class DraftTree:
    """A draft tree in level order: node 0 is the root (the last accepted token), parents precede children."""

    tokens: torch.Tensor  # [N] target-vocabulary ids
    parents: torch.Tensor  # [N] index of the parent node, -1 for the root
    depths: torch.Tensor  # [N] 0 for the root
    ranks: torch.Tensor | None = None  # [N] score rank among all drafted candidates, -1 for the root

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def depth(self) -> int:
        return int(self.depths.max())

    def ancestor_mask(self) -> torch.Tensor:
        """`[N, N]` bool: node `i` may attend to node `j` iff `j` is `i` or one of its ancestors."""
        parents = self.parents.tolist()
        mask = torch.eye(len(parents), dtype=torch.bool)
        for node, parent in enumerate(parents):
            if parent >= 0:
                mask[node] |= mask[parent]
        return mask.to(self.tokens.device)

    @classmethod
    def root_only(cls, root_token: torch.Tensor) -> "DraftTree":
        zero = torch.zeros(1, dtype=torch.long, device=root_token.device)
        return cls(root_token.reshape(1), zero - 1, zero, zero - 1)


@torch.no_grad()
def draft_tree(state: DrafterState, root_token: torch.Tensor, depth: int, top_k: int, total_tokens: int) -> DraftTree:
    """EAGLE-2 dynamic tree: grow the `top_k` best frontier nodes for `depth` levels, keep the best `total_tokens`.

    A node's score is the log of the product of draft probabilities along its path. Each level is one
    batched drafter forward over the frontier, with a tail mask letting each frontier node see the
    accepted prefix, its own ancestors and itself. Every expanded child joins the candidate pool, so
    the final tree may hold leaves that were never expanded.
    """
    drafter = state.drafter
    hidden, logits = state.catch_up()
    base = state.length  # position of the first draft level in the drafter's frame
    log_probs = torch.log_softmax(logits[0, -1].float(), dim=-1)
    scores, draft_ids = log_probs.topk(min(top_k, log_probs.shape[-1]))
    pool_scores, pool_ids = [scores], [draft_ids]
    pool_parents = [torch.full_like(draft_ids, -1)]
    frontier = torch.arange(scores.shape[0], device=scores.device)  # pool indices of the frontier
    frontier_hidden = hidden.expand(1, frontier.shape[0], -1)
    frontier_ancestry = torch.zeros(frontier.shape[0], 0, dtype=torch.bool, device=scores.device)
    pool_size = scores.shape[0]
    for level in range(1, depth):
        width = frontier.shape[0]
        tail_mask = torch.cat([frontier_ancestry, torch.eye(width, dtype=torch.bool, device=scores.device)], dim=1)
        frontier_tokens = drafter.draft_to_target(torch.cat(pool_ids)[frontier])
        positions = torch.full((1, width), base + level - 1, device=scores.device)
        out = drafter(frontier_tokens[None], frontier_hidden, positions, state.cache, tail_mask)
        child_log_probs = torch.log_softmax(out.logits[0].float(), dim=-1)
        top_log_probs, child_ids = child_log_probs.topk(min(top_k, child_log_probs.shape[-1]), dim=-1)
        child_scores = (torch.cat(pool_scores)[frontier][:, None] + top_log_probs).flatten()
        pool_scores.append(child_scores)
        pool_ids.append(child_ids.flatten())
        pool_parents.append(frontier.repeat_interleave(child_ids.shape[1]))
        best = child_scores.topk(min(top_k, child_scores.shape[0])).indices
        parent_rows = best // child_ids.shape[1]
        frontier = pool_size + best
        pool_size += child_scores.shape[0]
        frontier_hidden = out.hidden_states[:, parent_rows]
        frontier_ancestry = torch.cat([frontier_ancestry, torch.eye(width, dtype=torch.bool, device=scores.device)], 1)
        frontier_ancestry = frontier_ancestry[parent_rows]
    return _select_tree(drafter, root_token, torch.cat(pool_scores), torch.cat(pool_ids), torch.cat(pool_parents), total_tokens)


def _select_tree(
    drafter: Eagle3DraftModel,
    root_token: torch.Tensor,
    scores: torch.Tensor,
    draft_ids: torch.Tensor,
    parents: torch.Tensor,
    total_tokens: int,
) -> DraftTree:
    """Keep the `total_tokens` best pool nodes; ties go to the earlier node, so every parent is kept.

    A node's score rank is recorded: the `n` best-ranked nodes are exactly the tree this draft would
    have kept with `total_tokens = n`, which lets tuning evaluate smaller trees from one run.
    """
    order = torch.sort(-scores, stable=True).indices[:total_tokens]
    rank = torch.empty_like(parents)
    rank[order] = torch.arange(order.shape[0], device=order.device)
    keep = order.sort().values  # pool order is level order: parents before children
    local = torch.full_like(parents, -1)
    local[keep] = torch.arange(1, keep.shape[0] + 1, device=keep.device)
    kept_parents = parents[keep]
    node_parents = torch.where(kept_parents < 0, torch.zeros_like(kept_parents), local[kept_parents.clamp(min=0)])
    depths = [0]
    for parent in node_parents.tolist():
        depths.append(depths[parent] + 1)
    device = root_token.device
    return DraftTree(
        tokens=torch.cat([root_token.reshape(1), drafter.draft_to_target(draft_ids[keep]).to(device)]),
        parents=torch.cat([torch.tensor([-1], device=device), node_parents.to(device)]),
        depths=torch.tensor(depths, device=device),
        ranks=torch.cat([torch.tensor([-1], device=device), rank[keep].to(device)]),
    )
