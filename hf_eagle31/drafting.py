"""Proposing draft tokens with an EAGLE drafter: an EAGLE-2 dynamic tree (a chain is a tree of top-k 1).

The drafter lags the target by one token: its cache entry `t` pairs the target's feature at `t`
with token `t + 1`. Only entries built from real target features are kept between steps; the
entries a draft adds are dropped at the next `catch_up`, which first feeds the features of what
the target has accepted since.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import DynamicCache

from hf_eagle31.cache import truncate_cache
from hf_eagle31.modeling import Eagle3DraftModel, Products


class DrafterState:
    """The drafter's KV cache for a batch of rows, kept in step with what the target has accepted.

    Rows accept different numbers of tokens per step. `catch_up` feeds each row's queued features
    as one block as long as the longest queue: a shorter row's surplus entries are holes that
    `key_mask` hides from every later query, and `positions` counts each row's real entries, so a
    row drafts exactly as it would alone (decoding.py keeps the target's cache the same way).
    """

    def __init__(self, drafter: Eagle3DraftModel, batch_size: int = 1, products: Products | None = None):
        self.drafter = drafter
        self.products = products  # a device backend's products for the drafter's layers (modeling.linear_outputs)
        self.cache = DynamicCache()
        self.length = 0  # cache entries built from target features, holes included
        device = drafter.fc.weight.device
        self.key_mask = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=device)  # real entries per row
        self.holes = False  # whether `key_mask` may hide an entry: set by a catch-up where a row fed less than another
        self._features: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]
        self._tokens: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]

    def push(self, features: torch.Tensor, next_tokens: torch.Tensor, row: int = 0) -> None:
        """Queue target features `[1, n, 3H]` of `row` with the token that followed each position `[1, n]`."""
        param = self.drafter.fc.weight
        self._features[row].append(features[0].to(param.device, param.dtype))
        self._tokens[row].append(next_tokens[0].to(param.device))

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (in this order): the others have finished."""
        self.cache.batch_select_indices(rows.to(self.key_mask.device))
        self.key_mask, self.positions = self.key_mask[rows], self.positions[rows]
        self._features = [self._features[r] for r in rows.tolist()]
        self._tokens = [self._tokens[r] for r in rows.tolist()]

    def visible(self, tail: torch.Tensor) -> torch.Tensor:
        """The drafter's `tail_mask` for queries that see `tail` `[n, m]` or `[B, n, m]` over the entries
        drafted since `catch_up`, and every real cached entry before them."""
        if not self.holes:
            return tail
        batch, n = self.key_mask.shape[0], tail.shape[-2]
        past = self.key_mask[:, None, :].expand(batch, n, -1)
        return torch.cat([past, tail.expand(batch, n, tail.shape[-1])], dim=-1)

    @torch.no_grad()
    def catch_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the queued features; return each row's last fed-back state `[B, 1, H]` and draft logits `[B, 1, V_d]`.

        Rows that queued as many as the longest (a batch of one always) leave no holes: then the drafter gets no
        mask and computes the last position's logits only, Python counting what it can (~0.2 ms of a 6 ms draft
        tree of SmolLM2's drafter on 2 threads went to those tensors)."""
        truncate_cache(self.cache, self.length)
        self.key_mask = self.key_mask[:, : self.length]
        counts = [sum(f.shape[0] for f in queue) for queue in self._features]
        n, batch = max(counts), len(counts)
        features = pad_sequence([torch.cat(queue) for queue in self._features], batch_first=True)
        tokens = pad_sequence([torch.cat(queue) for queue in self._tokens], batch_first=True)
        self._features, self._tokens = [[] for _ in counts], [[] for _ in counts]
        device = self.positions.device
        positions = self.positions[:, None] + torch.arange(n, device=device)
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        if min(counts) == n:
            real, fed = self.key_mask.new_ones(batch, n), n
            out = self.drafter(tokens, features, positions, self.cache, self.visible(causal) if self.holes else None,
                               logits_to_keep=1, products=self.products)
            hidden, logits = out.hidden_states[:, -1:], out.logits
        else:
            fed = torch.tensor(counts, device=device)
            real = torch.arange(n, device=device) < fed[:, None]
            last = torch.zeros_like(real)
            last[torch.arange(batch), fed - 1] = True
            out = self.drafter(tokens, features, positions, self.cache, self.visible(causal & real[:, None, :]),
                               logits_at=last, products=self.products)
            hidden, logits = out.hidden_states[last][:, None], out.logits[:, None]
            self.holes = True
        self.key_mask = torch.cat([self.key_mask, real], dim=1)
        self.length += n
        self.positions += fed
        return hidden, logits


@dataclass
class DraftTree:
    """A draft tree in level order: node 0 is the root (the last accepted token), parents precede children."""

    tokens: torch.Tensor  # [N] target-vocabulary ids
    parents: torch.Tensor  # [N] index of the parent node, -1 for the root
    depths: torch.Tensor  # [N] 0 for the root
    ranks: torch.Tensor | None = None  # [N] score rank among all drafted candidates, -1 for the root
    frontier_ranks: torch.Tensor | None = None  # [levels after the first] `_viable_width`'s rank of each level's best
    proposals: torch.Tensor | None = None  # [N, V] a sampled chain's: the distribution node i was drawn from

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def proposal(self, node: int) -> tuple[int, torch.Tensor] | None:
        """The token drafted after `node` of a sampled chain and the distribution it was drawn from, else None."""
        if self.proposals is None or node + 1 >= len(self):
            return None
        return int(self.tokens[node + 1]), self.proposals[node + 1]

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
        return cls(root_token.reshape(1), zero - 1, zero, zero - 1, zero[:0])


def drafting_width(top_k: int, total_tokens: int) -> int:
    """How many nodes a tree level expands, and how many children each gets: at most the tree's size.

    A node among the `total_tokens` best of the pool is among the `total_tokens` best of its level and
    of its siblings, and so are its ancestors (a child never scores above its parent), so a wider level
    only drafts nodes that no kept tree holds: the kept tree is the same, up to exact score ties, and
    each level's forward is narrower (top-k 10 of 5 tokens drafted 10 wide before).
    """
    return min(top_k, total_tokens)


def _viable_width(frontier_scores: torch.Tensor, kept: torch.Tensor, total_tokens: int) -> int:
    """How many of the frontier's nodes (best first) may still have a child in the kept tree.

    A child never scores above its parent, and the `total_tokens` best pool scores only rise as levels add
    nodes, so a node scoring below them now has no descendant the tree keeps: expanding it drafts nothing
    the tree holds. Where no row's frontier can, the levels left are skipped: an unsure drafter stops early
    (the kept tree is the same, and the same as a tree drafted at full width).
    """
    if kept.shape[1] < total_tokens:
        return frontier_scores.shape[1]
    return int((frontier_scores >= kept[:, -1:]).sum(dim=1).max())


def _children(log_probs: torch.Tensor, top_k: int, temperature: float | None):
    """Each node's `top_k` best children `(log-probs, ids, None)`; with a temperature (a sampled chain) one child
    drawn from the drafter's distribution at that temperature, and that distribution."""
    if temperature is None:
        return (*log_probs.topk(min(top_k, log_probs.shape[-1]), dim=-1), None)
    q = torch.softmax(log_probs / temperature, dim=-1)
    ids = torch.multinomial(q.reshape(-1, q.shape[-1]), 1).reshape(*q.shape[:-1], 1)
    return log_probs.gather(-1, ids), ids, q


@dataclass
class Frontier:
    """The nodes a tree level expands, per row, best first (each tensor `[B, w, ...]`)."""

    pool: torch.Tensor  # [B, w] their indices in the candidate pool
    scores: torch.Tensor  # [B, w] log of the product of draft probabilities along their paths
    ids: torch.Tensor  # [B, w] draft-vocabulary ids
    hidden: torch.Tensor  # [B, w, H] the drafter states they feed back
    ancestry: torch.Tensor  # [B, w, m] which of the m nodes drafted since the catch-up each descends from

    def narrowed(self, width: int) -> Frontier:
        return Frontier(*(part[:, :width] for part in (self.pool, self.scores, self.ids, self.hidden, self.ancestry)))

    def tail_mask(self) -> torch.Tensor:
        """`[B, w, m + w]`: each node sees its ancestors and itself among the drafted nodes."""
        batch, width = self.scores.shape
        itself = torch.eye(width, dtype=torch.bool, device=self.scores.device).expand(batch, width, width)
        return torch.cat([self.ancestry, itself], dim=2)

    def children(self, child_scores: torch.Tensor, child_ids: torch.Tensor, per_node: int, hidden: torch.Tensor,
                 pool_start: int, top_k: int) -> Frontier:
        """The next level's frontier: the `top_k` best of this level's children (`child_scores`, `child_ids`
        `[B, w * per_node]`, the first at pool index `pool_start`), with their parents' fed-back `hidden` states."""
        scores, best = child_scores.topk(min(top_k, child_scores.shape[1]), dim=-1)
        parents = (best // per_node)[..., None]
        ancestry = self.tail_mask()
        return Frontier(pool_start + best, scores, child_ids.gather(1, best),
                        hidden.gather(1, parents.expand(-1, -1, hidden.shape[2])),
                        ancestry.gather(1, parents.expand(-1, -1, ancestry.shape[2])))


@torch.no_grad()
def draft_tree(
    state: DrafterState, roots: torch.Tensor, depth: int, top_k: int, total_tokens: int,
    temperature: float | None = None,
) -> list[DraftTree]:
    """EAGLE-2 dynamic trees, one per row: grow the `top_k` best frontier nodes for `depth` levels, keep the best
    `total_tokens` (`top_k` capped at `total_tokens`: `drafting_width`). `roots` `[B]` are the rows' last
    accepted tokens.

    A node's score is the log of the product of draft probabilities along its path. Each level is one
    drafter forward over every row's frontier, with a tail mask letting each frontier node see the
    accepted prefix, its own ancestors and itself. Every expanded child joins the candidate pool, so
    the final tree may hold leaves that were never expanded.

    With a `temperature` and `top_k` 1 the chain is drawn from the drafter instead (speculative
    sampling's proposal): each node keeps the distribution it was drawn from, which verification
    accepts against (min(1, p/q) accepts more than following the argmax draft with probability p).
    """
    drafter = state.drafter
    temperature = temperature if top_k == 1 else None  # the shape asked for, before its width is capped
    top_k = drafting_width(top_k, total_tokens)
    hidden, logits = state.catch_up()
    batch, device = hidden.shape[0], hidden.device
    scores, draft_ids, q = _children(torch.log_softmax(logits[:, -1].float(), dim=-1), top_k, temperature)  # [B, k]
    width = scores.shape[1]
    frontier = Frontier(torch.arange(width, device=device).expand(batch, -1), scores, draft_ids,
                        hidden.expand(batch, width, -1), torch.zeros(batch, width, 0, dtype=torch.bool, device=device))
    pool_scores, pool_ids, pool_q = [scores], [draft_ids], [None if q is None else q[:, None]]
    pool_parents, pool_size = [torch.full_like(draft_ids, -1)], width
    kept = scores  # each row's best pool scores so far, best first (top-k is capped at the tree's size)
    frontier_ranks = []  # per level: how many kept scores beat its best node (a tree of n tokens drafts it iff < n)
    for level in range(1, depth):
        frontier_ranks.append((kept > frontier.scores[:, :1]).sum(dim=1))
        width = _viable_width(frontier.scores, kept, total_tokens)
        if width == 0:
            break
        frontier = frontier.narrowed(width)
        tail_mask = frontier.tail_mask()
        positions = (state.positions + level - 1)[:, None].expand(batch, width)
        out = drafter(drafter.draft_to_target(frontier.ids), frontier.hidden, positions, state.cache,
                      state.visible(tail_mask[0] if batch == 1 else tail_mask), products=state.products)
        top_log_probs, child_ids, q = _children(torch.log_softmax(out.logits.float(), dim=-1), top_k, temperature)
        child_scores, child_ids = (frontier.scores[:, :, None] + top_log_probs).flatten(1), child_ids.flatten(1)
        pool_scores.append(child_scores)
        pool_ids.append(child_ids)
        pool_q.append(q)
        pool_parents.append(frontier.pool.repeat_interleave(top_log_probs.shape[2], dim=1))
        kept = torch.cat([kept, child_scores], dim=1)
        kept = kept.topk(min(total_tokens, kept.shape[1]), dim=-1).values
        frontier = frontier.children(child_scores, child_ids, top_log_probs.shape[2], out.hidden_states, pool_size,
                                     top_k)
        pool_size += child_scores.shape[1]
    pool = [torch.cat(part, dim=1) for part in (pool_scores, pool_ids, pool_parents)]
    proposals = None if temperature is None else torch.cat(pool_q, dim=1)  # [B, depth, V_d]
    ranks = torch.stack(frontier_ranks, dim=1) if frontier_ranks else scores.new_zeros(batch, 0, dtype=torch.long)
    return [_select_tree(drafter, roots[row], *(part[row] for part in pool), total_tokens,
                         None if proposals is None else proposals[row], ranks[row]) for row in range(batch)]


def _select_tree(
    drafter: Eagle3DraftModel,
    root_token: torch.Tensor,
    scores: torch.Tensor,
    draft_ids: torch.Tensor,
    parents: torch.Tensor,
    total_tokens: int,
    proposals: torch.Tensor | None = None,
    frontier_ranks: torch.Tensor | None = None,
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
    if proposals is not None:  # the very q each token was drawn from, in the target's vocabulary; zeros for the root
        proposals = drafter.expand_to_target_vocab(proposals[keep], fill=0.0).to(device)
        proposals = torch.cat([torch.zeros_like(proposals[:1]), proposals])
    return DraftTree(
        tokens=torch.cat([root_token.reshape(1), drafter.draft_to_target(draft_ids[keep]).to(device)]),
        parents=torch.cat([torch.tensor([-1], device=device), node_parents.to(device)]),
        depths=torch.tensor(depths, device=device),
        ranks=torch.cat([torch.tensor([-1], device=device), rank[keep].to(device)]),
        proposals=proposals,
        frontier_ranks=frontier_ranks,
    )
