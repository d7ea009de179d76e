"""Training-time test: unroll the drafter on its own outputs with exactly the attention it gets at inference.

At inference a chain rooted at position t sees the drafter cache entries 0..t built from the
target's features, then its own draft entries. In training every position t roots a chain at
once: step 0 runs all positions causally (cache block K0), and step k >= 1 feeds each position
its own fed-back state from step k-1 (block Kk). Query t at step k may see K0[0..t] (causal) and
Kj[t] for j = 1..k (its own chain only, the diagonal of each later block). The drafter's own
`forward` runs every step unchanged; gradients flow through the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from hf_eagle31.modeling import Eagle3DraftModel, Eagle3DraftOutput
from hf_eagle31.training.losses import step_mask


def ttt_tail_mask(length: int, step: int, device: torch.device | str | None = None) -> torch.Tensor:
    """`[length, (step + 1) * length]` bool over the cache blocks K0..K_step: causal, then diagonals."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)


def unroll(
    drafter: Eagle3DraftModel, features: torch.Tensor, input_ids: torch.Tensor, steps: int,
    loss_mask: torch.Tensor | None = None,
) -> list[Eagle3DraftOutput]:
    """Run `steps` draft steps from every position of a teacher-forced sequence.

    Args:
        features: `[B, L, 3H_t]` the target's features of the sequence.
        input_ids: `[B, L]` the sequence.
        loss_mask: `[B, L]`; when given, step k computes logits only where its prediction counts
            (`step_mask(loss_mask, k, T)`), flattened to `[count, V_d]`.
    Returns:
        one output per step over `T = L - 1` positions: step k at position t has seen tokens
        `x[1..t+k+1]` and predicts `x[t+k+2]` (positions past the end are padding, to be masked).
    """
    length = input_ids.shape[1] - 1
    positions = torch.arange(length, device=input_ids.device)[None]
    cache = DynamicCache()
    hidden = features[:, :-1].to(drafter.fc.weight.dtype)
    outputs = []
    padded = F.pad(input_ids, (0, steps))  # a sequence shorter than the unroll runs past its end
    for step in range(steps):
        tokens = padded[:, step + 1 : step + 1 + length]  # x[t+step+1]
        mask = ttt_tail_mask(length, step, input_ids.device)
        keep = None if loss_mask is None else step_mask(loss_mask, step, length)
        out = drafter(tokens, hidden, positions + step, cache, mask, logits_at=keep)
        outputs.append(out)
        hidden = out.hidden_states
    return outputs


class Unrolled(nn.Module):
    """The drafter with `unroll` as its forward: one module call per training step, as DDP expects."""

    def __init__(self, drafter: Eagle3DraftModel):
        super().__init__()
        self.drafter = drafter

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, steps: int,
                loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        return tuple(out.logits for out in unroll(self.drafter, features, input_ids, steps, loss_mask))
