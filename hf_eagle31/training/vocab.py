"""The draft vocabulary: the target tokens the drafter can propose, chosen by frequency in the answers."""

from __future__ import annotations

import torch

from hf_eagle31.training.data import TrainingSequence


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
