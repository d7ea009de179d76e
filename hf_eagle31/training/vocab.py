"""The draft vocabulary: the target tokens the drafter can propose, chosen by frequency in the answers."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.training.data import TrainingSequence
from hf_eagle31.training.teacher import draft_vocab_ids


def token_counts(sequences: list[TrainingSequence], vocab_size: int) -> torch.Tensor:
    """How often each target token occurs as a training target (answer tokens, not prompts)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        ids = torch.tensor(s.input_ids)[torch.tensor(s.loss_mask, dtype=torch.bool)]
        counts.index_add_(0, ids, torch.ones_like(ids))
    return counts


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`d2t` (`[V_d]` long, target id = draft id + d2t[draft id]) and `t2d` (`[V]` bool).

    The `draft_vocab_size` most frequent tokens (ties to the lower id) in ascending target-id order,
    as the EAGLE reference builds them.
    """
    vocab_size = counts.shape[0]
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be between 1 and the target vocabulary ({vocab_size}), "
                         f"got {draft_vocab_size}")
    kept = torch.argsort(-counts, stable=True)[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return kept - torch.arange(draft_vocab_size), t2d


def target_head_rows(target: PreTrainedModel, ids: torch.Tensor, width: int) -> torch.Tensor | None:
    """The target's output-embedding rows for the target ids `ids`, if its states are `width` wide (else None).

    A drafter's head predicts what the target's head does from a state of the same width: starting
    from the target's rows spares a run its first steps rediscovering the output embedding.
    """
    head = target.get_output_embeddings()
    if head is None or head.weight.shape[1] != width:
        return None
    return head.weight.detach()[ids.to(head.weight.device)]


@torch.no_grad()
def widen_draft_vocab(drafter: Eagle3DraftModel, target: PreTrainedModel, counts: torch.Tensor, size: int) -> None:
    """Grow the drafter's draft vocabulary to `size` tokens, in place: its own tokens and their trained head rows
    kept, the most frequent others in `counts` added.

    Why: a vocabulary chosen on one corpus covers less of another, and a token outside it can
    never be drafted, however long the drafter trains. A new row is the target's row for its token
    through the linear map that best takes the target's rows of the drafter's own tokens to their
    trained rows (least squares): the target's rows as they are would outscore the trained ones and
    lower the acceptance, while the mapped rows draft the new tokens at once, before any training
    (docs/training.md).
    """
    own = draft_vocab_ids(drafter).cpu()
    vocab_size = drafter.t2d.shape[0]
    if not own.shape[0] <= size <= vocab_size:
        raise ValueError(f"draft_vocab_size {size} cannot widen this drafter's vocabulary of {own.shape[0]} tokens: "
                         f"give a size between {own.shape[0]} and the target vocabulary ({vocab_size})")
    if counts.shape[0] != vocab_size:
        raise ValueError(f"token counts cover {counts.shape[0]} ids; the target vocabulary has {vocab_size}")
    priority = counts.clone()
    priority[own] = int(counts.max()) + 1  # the drafter's own tokens first, whatever the new data says
    d2t, t2d = build_draft_vocab(priority, size)
    kept = torch.arange(size) + d2t
    added = ~torch.isin(kept, own)
    old = drafter.lm_head.weight
    weight = torch.empty(size, old.shape[1], dtype=old.dtype, device=old.device)
    own_rows = target_head_rows(target, own, old.shape[1])
    if own_rows is None:  # no target rows of this width to map from
        nn.init.normal_(weight, std=drafter.config.initializer_range)
    else:
        trained = old.float().to(own_rows.device)
        linear_map = torch.linalg.lstsq(own_rows.float(), trained).solution
        rows = target_head_rows(target, kept[added], old.shape[1]).float() @ linear_map
        weight[added.to(old.device)] = rows.to(old.device, old.dtype)
    weight[torch.searchsorted(kept, own).to(old.device)] = old
    drafter.lm_head = nn.Linear(old.shape[1], size, bias=False, device=old.device, dtype=old.dtype)
    drafter.lm_head.weight.copy_(weight)
    drafter.d2t, drafter.t2d = d2t.to(drafter.d2t.device), t2d.to(drafter.t2d.device)
    drafter.config.draft_vocab_size = size
