"""Per-depth acceptance of a drafter, measured teacher-forced with the training unroll.

On the target's own greedy continuations (what `self_distill` produces), the teacher-forced chain
rooted at each position is exactly the chain greedy EAGLE decoding would draft there as long as
every earlier draft token was accepted, so these rates are the chain-decoding `alpha_k` without
running `generate`, for every position of every sequence at once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import PreTrainedModel

from hf_eagle31.generation import prepare_drafter
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.training.data import SequenceDataset, TrainingSequence, collate
from hf_eagle31.training.losses import acceptance_rates, ahead, expected_accepted_length, step_mask
from hf_eagle31.training.teacher import draft_vocab_ids, target_logits, target_states
from hf_eagle31.training.ttt import unroll


@dataclass
class AcceptanceReport:
    """`acceptance[k]`: greedy acceptance at depth k+1 given depths 1..k were accepted (drafter argmax ==
    target argmax). `expected[k]`: mean sum_x min(p, q) at depth k+1 (sampling acceptance, unconditional).
    `expected_length`: mean over positions of sum_k prod_{j<=k} alpha_j. `reached[k]`: how many chains
    reached depth k+1 (the denominator of `acceptance[k]`)."""

    acceptance: list[float]
    expected: list[float]
    expected_length: float
    reached: list[int]

    @property
    def greedy_length(self) -> float:
        """Draft tokens a greedy chain of this depth gets accepted per step: sum_k prod_{j<=k} acceptance_j."""
        total, alive = 0.0, 1.0
        for rate in self.acceptance:
            alive *= rate
            total += alive
        return total

    def as_dict(self) -> dict:
        return {**asdict(self), "greedy_length": self.greedy_length}


def as_sequences(sequences) -> list[TrainingSequence]:
    """Accept TrainingSequences, 1-D id tensors / lists, or a `[B, L]` tensor (all tokens counted)."""
    out = []
    for s in sequences:
        if isinstance(s, TrainingSequence):
            out.append(s)
        else:
            ids = s.tolist() if isinstance(s, torch.Tensor) else list(s)
            out.append(TrainingSequence(ids, [1] * len(ids)))
    if not out:
        raise ValueError("evaluate_acceptance needs at least one sequence")
    return out


@torch.no_grad()
def evaluate_acceptance(
    drafter: Eagle3DraftModel, target: PreTrainedModel, sequences, depth: int = 4, batch_size: int = 8
) -> AcceptanceReport:
    """Per-depth acceptance of `drafter` on `sequences` (ideally the target's greedy continuations)."""
    prepare_drafter(target, drafter)
    was_training = drafter.training
    drafter.eval()
    items = SequenceDataset(as_sequences(sequences))
    draft_ids = draft_vocab_ids(drafter)
    reached, accepted = torch.zeros(depth), torch.zeros(depth)
    alpha_sum, alpha_count = torch.zeros(depth), torch.zeros(depth)
    length_sum, length_count = 0.0, 0
    device = drafter.fc.weight.device
    for start in range(0, len(items), batch_size):
        batch = collate([items[i] for i in range(start, min(start + batch_size, len(items)))])
        ids, mask = batch["input_ids"].to(device), batch["loss_mask"].to(device) * batch["attention_mask"].to(device)
        features, last = target_states(target, ids, batch["attention_mask"].to(device), drafter.config.target_layer_ids)
        logits = target_logits(target, last).to(device)
        steps = tuple(out.logits for out in unroll(drafter, features, ids, depth))
        alpha = acceptance_rates(steps, logits, draft_ids)
        length = alpha.shape[-1]
        alive = step_mask(mask, 0, length)
        for k, step_logits in enumerate(steps):
            valid = step_mask(mask, k, length)
            hit = drafter.draft_to_target(step_logits.argmax(-1)) == ahead(logits.argmax(-1), k + 1, length)
            alive = alive & valid
            reached[k] += alive.sum().cpu()
            alive = alive & hit
            accepted[k] += alive.sum().cpu()
            alpha_sum[k] += (alpha[k] * valid).sum().cpu()
            alpha_count[k] += valid.sum().cpu()
        positions = int(step_mask(mask, 0, length).sum())
        length_sum += float(expected_accepted_length(alpha, mask)) * positions
        length_count += positions
    drafter.train(was_training)
    return AcceptanceReport(
        acceptance=(accepted / reached.clamp(min=1)).tolist(),
        expected=(alpha_sum / alpha_count.clamp(min=1)).tolist(),
        expected_length=length_sum / max(length_count, 1),
        reached=reached.long().tolist(),
    )
