"""The acceptance walk: at each node of a verified tree the target emits a token exactly as plain `generate` picks
it (argmax, or a sample); the walk moves to the child carrying that token, or ends with it as the bonus token.

For sampling this is multi-candidate recursive rejection sampling with the tree's children as deterministic
proposals (a proposal of probability one is accepted with probability p(x), and the residual after removing it
is p restricted to the other tokens): the emitted tokens are distributed exactly as the target's. A sampled chain
(drafted from the drafter's distribution q) is accepted by speculative sampling (`accept_or_resample`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from hf_eagle31.drafting import DraftTree


def pick_token(scores: torch.Tensor, do_sample: bool,
               argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The next token `[1, 1]` from processed scores `[1, V]`, as plain `generate` picks it: a sample or the argmax
    (`argmax`: the backend's, where it computes torch's faster)."""
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), 1)
    return scores.argmax(dim=-1, keepdim=True) if argmax is None else argmax(scores)


def stopper(criteria: StoppingCriteriaList) -> Callable[[torch.Tensor, int, torch.Tensor], bool]:
    """`stops(sequence, token, scores)`: whether a row whose sequence `[1, L]` ends in its new `token` stops, as
    `bool(criteria(sequence, scores).any())` says: transformers' own max-length and EOS criteria answered from the
    length and the token (a max-length criterion past the model's positions still called, for its warning), any
    other criterion called as transformers calls it.

    Why: called on the tensors, those two run half a dozen small operations a token, ~0.1 ms of a CPU plain step
    (its caches cold after the step streamed the weights); answered from two ints, none."""
    lengths = [c for c in criteria if type(c) is MaxLengthCriteria]
    eos = {token for c in criteria if type(c) is EosTokenCriteria for token in c.eos_token_id.flatten().tolist()}
    others = StoppingCriteriaList([c for c in criteria if type(c) not in (MaxLengthCriteria, EosTokenCriteria)])

    def stops(sequence: torch.Tensor, token: int, scores: torch.Tensor) -> bool:
        length, done = sequence.shape[1], token in eos
        for criterion in lengths:
            if length >= criterion.max_length:
                done = True
            elif criterion.max_position_embeddings is not None and length > criterion.max_position_embeddings:
                criterion(sequence, scores)  # its warning, once
        return bool(others(sequence, scores).any()) or done if others else done  # every other one called, as ever

    return stops


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


def children_by_token(tree: DraftTree) -> list[dict[int, int]]:
    children: list[dict[int, int]] = [{} for _ in range(len(tree))]
    if len(children) == 1:  # a root alone (a plain step's): nothing to read from the tree
        return children
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
