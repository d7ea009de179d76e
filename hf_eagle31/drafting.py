"""Proposing draft tokens with an EAGLE drafter: an EAGLE-2 dynamic tree (a chain is a tree of top-k 1).

The drafter lags the target by one token: its cache entry `t` pairs the target's feature at `t`
with token `t + 1`. Only entries built from real target features are kept between steps; the
entries a draft adds are overwritten by the next `catch_up`, which first feeds the features of what
the target has accepted since.

A tree is drafted narrowed (each level only as wide as nodes the tree may still keep, which the host
reads back) or static (every level of a shape on the same tensors, the tree selected on the device:
nothing is read back, and a backend may replay the whole draft as captured, as CUDA graphs do).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from hf_eagle31.cache import DraftCache
from hf_eagle31.modeling import Eagle3DraftModel, Eagle3DraftOutput, Products

# a device backend's replay of a fixed-shape draft: `replay(draft, key, inputs)` returns `draft(*inputs)`, computed
# by a capture made once per `key` and replayed; `key` is (the buffers' `DraftCache.version`, the draft's shape...)
Replay = Callable[[Callable[..., tuple], Hashable, tuple[torch.Tensor, ...]], tuple]
# a device backend's forward of the whole drafter, called as the drafter is here: `forward(ids, hidden, positions,
# cache, mask, logits_to_keep=, logits_at=)` (logits_at a pair of index tensors) returns what the drafter's forward on
# the backend's products returns, up to rounding
DraftForward = Callable[..., Eagle3DraftOutput]


def forward_of(drafter: Eagle3DraftModel, products: Products | None = None,
               forward: DraftForward | None = None) -> DraftForward:
    """The drafter's forward as drafting calls it: a device backend's whole `forward`, else the modules' on the
    backend's `products` for its layers (modeling.linear_outputs; None: the layers' own calls)."""
    return forward or functools.partial(drafter, products=products)


class DrafterState:
    """The drafter's KV cache for a batch of rows, kept in step with what the target has accepted.

    Rows accept different numbers of tokens per step. `catch_up` feeds each row's queued features
    as one block as long as the longest queue: a shorter row's surplus entries are holes that
    `key_mask` hides from every later query, and `positions` counts each row's real entries, so a
    row drafts exactly as it would alone (decoding.py keeps the target's cache the same way).

    The cache is a `DraftCache` of fixed buffers: the entries a draft writes after the `length` real ones
    are hidden by `key_mask` and overwritten by the next catch-up. A draft level's forward (`draft_forward`)
    then reads and writes the same tensors at every step, and where it writes is on the device (`start`),
    so a device can replay a whole draft as captured (`replay`, a backend's: CUDA graphs).
    """

    def __init__(self, drafter: Eagle3DraftModel, batch_size: int = 1, products: Products | None = None,
                 capacity: int = 256, replay: Replay | None = None, forward: DraftForward | None = None):
        self.drafter = drafter
        self.forward = forward_of(drafter, products, forward)
        self.replay = replay  # a device backend's replay of a fixed-shape draft (drafting with `static`)
        device = drafter.fc.weight.device
        self.cache = DraftCache(capacity)
        self.length = 0  # cache entries built from target features, holes included
        self.key_mask = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)  # the real entries
        self.start = torch.zeros((), dtype=torch.long, device=device)  # `length` on the device: where a draft writes
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=device)  # real entries per row
        self._features: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]
        self._tokens: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]

    def push(self, features: torch.Tensor, next_tokens: torch.Tensor, row: int = 0) -> None:
        """Queue target features `[1, n, 3H]` of `row` with the token that followed each position `[1, n]`."""
        param = self.drafter.fc.weight
        self._features[row].append(features[0].to(param.device, param.dtype))
        self._tokens[row].append(next_tokens[0].to(param.device))

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (in this order): the others have finished."""
        rows = rows.to(self.key_mask.device)
        self.cache.select(rows)
        self.key_mask, self.positions = self.key_mask[rows], self.positions[rows]
        self._features = [self._features[r] for r in rows.tolist()]
        self._tokens = [self._tokens[r] for r in rows.tolist()]

    def reserve(self, entries: int) -> None:
        """Room for `entries` cache entries: the buffers grow by doubling (a replayed draft is captured anew)."""
        if entries > self.cache.capacity:
            capacity = max(entries, 2 * self.cache.capacity)
            self.cache.grow(capacity)
            grown = self.key_mask.new_zeros(self.key_mask.shape[0], capacity)
            grown[:, : self.key_mask.shape[1]] = self.key_mask
            self.key_mask = grown

    def _attend(self, written: torch.Tensor, tail: torch.Tensor, columns: torch.Tensor, width: int | None
                ) -> torch.Tensor:
        """Point the cache at the slots the next forward writes (`written`) and returns (the first `width`, None: all);
        return its mask `[B, n, width]`: the real entries, and `tail` `[B or 1, n, m]` over the `m` entries at
        `columns`."""
        self.cache.at, self.cache.width = written, width
        batch, n = self.key_mask.shape[0], tail.shape[-2]
        mask = self.key_mask[:, None, :width].expand(batch, n, -1).clone()
        return mask.index_copy_(2, columns, tail.expand(batch, n, -1))

    def draft_forward(self, ids: torch.Tensor, hidden: torch.Tensor, level: int, tail: torch.Tensor,
                      static: bool = True):
        """Draft level `level` (1 for the root's children' children): the drafter on draft ids `[B, w]` and fed-back
        states `[B, w, H]`, each node seeing the real entries and `tail` `[B or 1, w, m]` of the `m` entries drafted
        since the catch-up (its own last). `static`: shapes and kernels depend on the draft's shape only (every
        slot of the cache attended, masked); else only the entries written so far, which the host counts."""
        columns = self.start + torch.arange(tail.shape[-1], device=self.start.device)
        positions = (self.positions + level - 1)[:, None].expand_as(ids)
        mask = self._attend(columns[tail.shape[-1] - ids.shape[1] :], tail, columns,
                            None if static else self.length + tail.shape[-1])
        return self.forward(self.drafter.draft_to_target(ids), hidden, positions, self.cache, mask)

    @torch.no_grad()
    def catch_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the queued features; return each row's last fed-back state `[B, 1, H]` and draft logits `[B, 1, V_d]`.

        A batch of one (or rows that queued as many as the longest) computes the last position's logits only."""
        counts = [sum(f.shape[0] for f in queue) for queue in self._features]
        n, batch, device = max(counts), len(counts), self.positions.device
        self.reserve(self.length + n)
        self.key_mask[:, self.length :] = False
        features = pad_sequence([torch.cat(queue) for queue in self._features], batch_first=True)
        tokens = pad_sequence([torch.cat(queue) for queue in self._tokens], batch_first=True)
        self._features, self._tokens = [[] for _ in counts], [[] for _ in counts]
        positions = self.positions[:, None] + torch.arange(n, device=device)
        columns = self.length + torch.arange(n, device=device)
        fed = torch.cat([torch.full((1,), count, device=device) for count in counts])  # filled there: no copy waits
        real = torch.arange(n, device=device) < fed[:, None]
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril() & real[:, None, :]
        mask = self._attend(columns, causal, columns, self.length + n)
        if min(counts) == n:
            out = self.forward(tokens, features, positions, self.cache, mask, logits_to_keep=1)
            hidden, logits = out.hidden_states[:, -1:], out.logits
        else:  # each row's last fed position, by index (a boolean mask would read its count back)
            last = torch.arange(batch, device=device), fed - 1
            out = self.forward(tokens, features, positions, self.cache, mask, logits_at=last)
            hidden, logits = out.hidden_states[last][:, None], out.logits[:, None]
        self.key_mask[:, self.length : self.length + n] = real
        self.length += n
        self.start.fill_(self.length)
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
    ancestors: torch.Tensor | None = None  # [N, N] `ancestor_mask`, where drafting built it on the device

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
        if self.ancestors is not None:
            return self.ancestors
        return ancestor_masks(self.parents[None], self.depth)[0]

    @classmethod
    def root_only(cls, root_token: torch.Tensor) -> "DraftTree":
        """The tree of the root alone, `root_token` `[1]`: a plain step's (no field of a tree is written in place, so
        every such tree shares the rest)."""
        parents, depths, ranks, frontier_ranks, ancestors = _root_parts(root_token.device)
        return cls(root_token, parents, depths, ranks, frontier_ranks, ancestors=ancestors)


@functools.cache
def _root_parts(device: torch.device) -> tuple[torch.Tensor, ...]:
    """A lone root's parents, depths, ranks, frontier ranks and ancestor mask on `device`."""
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return zero - 1, zero, zero - 1, zero[:0], torch.ones(1, 1, dtype=torch.bool, device=device)


def ancestor_masks(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """`[B, N, N]` bool from trees' `parents` `[B, N]` (-1 for the root) at most `depth` levels deep: node `i` sees
    node `j` iff `j` is `i` or one of its ancestors. One parent hop per level, all nodes at once, on the device."""
    hops = parents.clamp(min=0)  # the root is its own parent
    batch, size = parents.shape
    ancestors = torch.eye(size, dtype=torch.bool, device=parents.device).repeat(batch, 1, 1)
    above = hops  # each node's ancestor one more hop up at each level
    for _ in range(depth):
        ancestors.scatter_(2, above[..., None], True)
        above = hops.gather(1, above)
    return ancestors


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
    scores: torch.Tensor  # [B, w] the sum of log draft probabilities along their paths
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
                 pool_start: int, top_k: int, ancestry: torch.Tensor) -> Frontier:
        """The next level's frontier: the `top_k` best of this level's children (`child_scores`, `child_ids`
        `[B, w * per_node]`, the first at pool index `pool_start`), with their parents' fed-back `hidden` states and
        `ancestry` (`tail_mask()`, which this level's forward took)."""
        scores, best = child_scores.topk(min(top_k, child_scores.shape[1]), dim=-1)
        parents = (best // per_node)[..., None]
        return Frontier(pool_start + best, scores, child_ids.gather(1, best),
                        hidden.gather(1, parents.expand(-1, -1, hidden.shape[2])),
                        ancestry.gather(1, parents.expand(-1, -1, ancestry.shape[2])))


@dataclass
class Pool:
    """Every node a draft expanded, per row `[B, P, ...]`, in level order (parents before children)."""

    scores: torch.Tensor  # [B, P] the sum of log draft probabilities along each node's path
    ids: torch.Tensor  # [B, P] draft-vocabulary ids
    parents: torch.Tensor  # [B, P] the parent's pool index, -1 for the root's children
    depths: torch.Tensor  # [P] each node's depth below the root (the same in every row)
    proposals: torch.Tensor | None  # [B, P, V_d] a sampled chain's: what each node was drawn from
    frontier_ranks: torch.Tensor  # [B, levels after the first]: how many kept scores beat each level's best node
    levels: int  # levels drafted


@torch.no_grad()
def draft_tree(
    state: DrafterState, roots: torch.Tensor, depth: int, top_k: int, total_tokens: int,
    temperature: float | None = None, static: bool = False,
) -> list[DraftTree]:
    """EAGLE-2 dynamic trees, one per row: grow the `top_k` best frontier nodes for `depth` levels, keep the best
    `total_tokens` (`top_k` capped at `total_tokens`: `drafting_width`). `roots` `[B]` are the rows' last
    accepted tokens.

    A node's score is the sum of log draft probabilities along its path. Each level is one
    drafter forward over every row's frontier, with a tail mask letting each frontier node see the
    accepted prefix, its own ancestors and itself. Every expanded child joins the candidate pool, so
    the final tree may hold leaves that were never expanded.

    `static` drafts every level `top_k` wide where the host would narrow the frontier and stop early
    (`_viable_width`, which reads scores back): the kept tree is the same, every draft of a shape runs the
    same kernels on the same tensors and nothing waits for the device between levels or in the selection,
    which the device's `state.replay` (CUDA graphs) then replays. A host that waits for nothing (a CPU)
    drafts fewer nodes narrowed.

    With a `temperature` and `top_k` 1 the chain is drawn from the drafter instead (speculative
    sampling's proposal): each node keeps the distribution it was drawn from, which verification
    accepts against (min(1, p/q) accepts more than following the argmax draft with probability p).
    """
    drafter = state.drafter
    temperature = temperature if top_k == 1 else None  # the shape asked for, before its width is capped
    top_k = drafting_width(top_k, total_tokens)
    hidden, logits = state.catch_up()
    state.reserve(state.length + (depth - 1) * top_k)

    def draft(hidden: torch.Tensor, logits: torch.Tensor, roots: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        pool = _grow(state, hidden, logits, depth, top_k, total_tokens, temperature, static)
        return _select(drafter, roots, pool, total_tokens)

    roots = roots.reshape(-1)
    if static and state.replay is not None and temperature is None:
        trees = state.replay(draft, (state.cache.version, depth, top_k, total_tokens), (hidden, logits,
                                                                                         roots.to(hidden.device)))
    else:
        trees = draft(hidden, logits, roots.to(hidden.device))
    if roots.device != hidden.device:
        trees = [None if part is None else part.to(roots.device) for part in trees]
    return [DraftTree(*(None if part is None else part[b] for part in trees)) for b in range(hidden.shape[0])]


def _grow(state: DrafterState, hidden: torch.Tensor, logits: torch.Tensor, depth: int, top_k: int,
          total_tokens: int, temperature: float | None, static: bool) -> Pool:
    """The draft's levels from the catch-up's states `[B, 1, H]` and logits `[B, 1, V_d]`."""
    batch, device = hidden.shape[0], hidden.device
    scores, draft_ids, q = _children(torch.log_softmax(logits[:, -1].float(), dim=-1), top_k, temperature)  # [B, k]
    width = scores.shape[1]
    frontier = Frontier(torch.arange(width, device=device).expand(batch, -1), scores, draft_ids,
                        hidden.expand(batch, width, -1), torch.zeros(batch, width, 0, dtype=torch.bool, device=device))
    pool_scores, pool_ids, pool_q = [scores], [draft_ids], [None if q is None else q[:, None]]
    pool_parents, pool_depths, pool_size = [torch.full_like(draft_ids, -1)], [(width, 1)], width
    kept = scores  # each row's best pool scores so far, best first (top-k is capped at the tree's size)
    frontier_ranks = []  # per level: how many kept scores beat its best node (a tree of n tokens drafts it iff < n)
    for level in range(1, depth):
        frontier_ranks.append((kept > frontier.scores[:, :1]).sum(dim=1))
        if not static:
            width = _viable_width(frontier.scores, kept, total_tokens)
            if width == 0:
                break
            frontier = frontier.narrowed(width)
        tail = frontier.tail_mask()
        out = state.draft_forward(frontier.ids, frontier.hidden, level, tail, static)
        top_log_probs, child_ids, q = _children(torch.log_softmax(out.logits.float(), dim=-1), top_k, temperature)
        child_scores, child_ids = (frontier.scores[:, :, None] + top_log_probs).flatten(1), child_ids.flatten(1)
        pool_scores.append(child_scores)
        pool_ids.append(child_ids)
        pool_q.append(q)
        pool_parents.append(frontier.pool.repeat_interleave(top_log_probs.shape[2], dim=1))
        pool_depths.append((child_scores.shape[1], level + 1))
        kept = torch.cat([kept, child_scores], dim=1)
        kept = kept.topk(min(total_tokens, kept.shape[1]), dim=-1).values
        frontier = frontier.children(child_scores, child_ids, top_log_probs.shape[2], out.hidden_states, pool_size,
                                     top_k, tail)
        pool_size += child_scores.shape[1]
    depths = torch.cat([torch.full((count,), level, device=device) for count, level in pool_depths])
    ranks = torch.stack(frontier_ranks, dim=1) if frontier_ranks else scores.new_zeros(batch, 0, dtype=torch.long)
    return Pool(*(torch.cat(part, dim=1) for part in (pool_scores, pool_ids, pool_parents)), depths,
                None if temperature is None else torch.cat(pool_q, dim=1), ranks, len(pool_depths))


def _select(drafter: Eagle3DraftModel, roots: torch.Tensor, pool: Pool, total_tokens: int
            ) -> tuple[torch.Tensor | None, ...]:
    """Each row's tree of its `total_tokens` best pool nodes, as `DraftTree`'s fields `[B, N, ...]` (N = kept + 1);
    ties go to the earlier node, so every parent is kept. On the device: no step reads a value back.

    A node's score rank is recorded: the `n` best-ranked nodes are exactly the tree this draft would
    have kept with `total_tokens = n`, which lets tuning evaluate smaller trees from one run.
    """
    batch, size = pool.scores.shape
    count = min(total_tokens, size)
    numbers = torch.arange(count + 1, device=roots.device).expand(batch, -1)
    order = torch.sort(-pool.scores, dim=1, stable=True).indices[:, :count]
    rank = torch.zeros_like(pool.parents).scatter_(1, order, numbers[:, :count])
    keep = order.sort(dim=1).values  # pool order is level order: parents before children
    local = torch.zeros_like(pool.parents).scatter_(1, keep, numbers[:, 1:])
    kept_parents = pool.parents.gather(1, keep)
    root_column = torch.full_like(numbers[:, :1], -1)
    parents = torch.cat([root_column, local.gather(1, kept_parents.clamp(min=0)) * (kept_parents >= 0)], dim=1)
    proposals = None
    if pool.proposals is not None:  # the very q each token was drawn from, in the target's vocabulary; 0 for the root
        drawn = pool.proposals.gather(1, keep[..., None].expand(-1, -1, pool.proposals.shape[2]))
        proposals = drafter.expand_to_target_vocab(drawn, fill=0.0)
        proposals = torch.cat([torch.zeros_like(proposals[:, :1]), proposals], dim=1)
    return (torch.cat([roots[:, None], drafter.draft_to_target(pool.ids.gather(1, keep))], dim=1),
            parents, torch.cat([torch.zeros_like(root_column), pool.depths[keep]], dim=1),
            torch.cat([root_column, rank.gather(1, keep)], dim=1),
            pool.frontier_ranks, proposals, ancestor_masks(parents, pool.levels))
