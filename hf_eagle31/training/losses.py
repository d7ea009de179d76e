"""Losses over an unrolled drafter (see ttt.py): distillation per step, and the acceptance objective.

Alignment, for a sequence x of length L and T = L - 1 drafter positions: step k at position t
predicts x[t+k+2], which the target predicted at its position t+k+1. A prediction counts where
x[t+k+2] exists and its `loss_mask` is set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ahead(values: torch.Tensor, by: int, length: int) -> torch.Tensor:
    """`values[:, by : by + length]`, zero-padded at the end to `length` positions."""
    window = values[:, by : by + length]
    missing = length - window.shape[1]
    return F.pad(window, (0, 0) * (values.dim() - 2) + (0, missing)) if missing else window


def step_mask(loss_mask: torch.Tensor, step: int, length: int) -> torch.Tensor:
    """`[B, T]` bool: which step-`step` predictions count."""
    return ahead(loss_mask, step + 2, length).bool()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def distillation_losses(
    step_logits: tuple[torch.Tensor, ...], target_draft_logits: torch.Tensor, loss_mask: torch.Tensor,
    lk_eta: float | None = None,
) -> torch.Tensor:
    """Forward KL(target || drafter) per step, `[K]`; with `lk_eta`, the LK-lambda loss instead.

    LK-lambda (Samarin et al., arXiv 2602.23881) blends KL with the total variation TV = 1 - alpha
    per position, lambda * KL + (1 - lambda) * TV with lambda = exp(-lk_eta * alpha) (alpha not
    differentiated): KL's strong gradient while the drafter is far off, then acceptance itself,
    which a small drafter cannot reach through KL alone once it must spend its capacity somewhere.

    `step_logits[k]` `[count_k, V_d]` are step k's logits where its prediction counts
    (`step_mask(loss_mask, k, T)`, as `unroll(..., loss_mask)` returns them: prompt and padding
    positions are often half of a batch, and the head and softmaxes over them would dominate a CPU
    step). `target_draft_logits` `[B, L, V_d]` are the target's logits at the draft vocabulary's
    ids (draft order): softmax over them is the target's distribution restricted to the draft
    vocabulary and renormalised.
    """
    log_p_all = torch.log_softmax(target_draft_logits.float(), dim=-1)
    length = target_draft_logits.shape[1] - 1
    losses = []
    for step, logits in enumerate(step_logits):
        keep = step_mask(loss_mask, step, length).to(logits.device)
        log_p = ahead(log_p_all, step + 1, length).to(logits.device)[keep]
        log_q = torch.log_softmax(logits.float(), dim=-1)
        p = log_p.exp()
        loss = (p * (log_p - log_q)).sum(-1)
        if lk_eta is not None:
            alpha = torch.minimum(p, log_q.exp()).sum(-1)
            blend = torch.exp(-lk_eta * alpha.detach())
            loss = blend * loss + (1 - blend) * (1 - alpha)
        losses.append(loss.sum() / max(loss.shape[0], 1))
    return torch.stack(losses)


def acceptance_rates(
    step_logits: tuple[torch.Tensor, ...], target_full_logits: torch.Tensor, draft_ids: torch.Tensor
) -> torch.Tensor:
    """alpha_k = sum_x min(p_target(x), q_draft(x)) per step and position, `[K, B, T]`.

    p is the target's full distribution; q lives on the draft vocabulary, mapped to target ids
    by `draft_ids` (q is 0 elsewhere, so only those ids contribute). This is the probability that
    speculative sampling accepts the step's draft token.
    """
    rates = []
    for step, logits in enumerate(step_logits):
        length = logits.shape[1]
        p = torch.softmax(ahead(target_full_logits, step + 1, length), dim=-1)[..., draft_ids.to(logits.device)]
        q = torch.softmax(logits.float(), dim=-1)
        rates.append(torch.minimum(p, q).sum(-1))
    return torch.stack(rates)


def expected_accepted_length(alpha: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean over positions of sum_k prod_{j<=k} alpha_j (a chain ends at the first invalid step)."""
    length = alpha.shape[-1]
    valid = torch.stack([step_mask(loss_mask, step, length) for step in range(alpha.shape[0])])
    return masked_mean(torch.cumprod(alpha * valid, dim=0).sum(0), valid[0])


def acceptance_loss(
    step_logits: tuple[torch.Tensor, ...], target_full_logits: torch.Tensor, draft_ids: torch.Tensor,
    loss_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The second-stage objective (minus the expected accepted length) and the per-step mean alpha `[K]`."""
    alpha = acceptance_rates(step_logits, target_full_logits, draft_ids)
    length = alpha.shape[-1]
    per_step = torch.stack([masked_mean(a, step_mask(loss_mask, k, length)) for k, a in enumerate(alpha)])
    return -expected_accepted_length(alpha, loss_mask), per_step
