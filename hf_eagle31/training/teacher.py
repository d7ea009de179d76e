"""What the frozen target provides to training: its features at `target_layer_ids` and its logits.

The target runs its decoder only (`base_model`) and we apply its LM head ourselves, to the draft
vocabulary's rows when that is all the loss needs: a `[batch, length, V]` logits tensor over a
150k-token vocabulary is the largest tensor of a step otherwise. This assumes the plain
`logits = lm_head(last_hidden_state)` head of Llama/Qwen/Mistral-style targets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from hf_eagle31.features import capture_request, select_features
from hf_eagle31.modeling import Eagle3DraftModel


@torch.no_grad()
def target_states(
    target: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`features` `[B, L, 3H_t]` (the drafter's input) and the final normed state `[B, L, H_t]` (the LM head's)."""
    out = target.base_model(input_ids=input_ids, attention_mask=attention_mask,
                            output_hidden_states=capture_request(layer_ids), use_cache=False)
    return select_features(out.hidden_states, layer_ids), out.last_hidden_state


def draft_vocab_ids(drafter: Eagle3DraftModel) -> torch.Tensor:
    """The target id of every draft id, in draft order."""
    return drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size, device=drafter.d2t.device))


@torch.no_grad()
def target_logits(target: PreTrainedModel, last_hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The target's logits (float32), over all tokens or only over the target ids `rows`."""
    head = target.get_output_embeddings()
    weight, bias = head.weight, head.bias
    if rows is not None:
        rows = rows.to(weight.device)
        weight, bias = weight[rows], None if bias is None else bias[rows]
    return F.linear(last_hidden.to(weight.device, weight.dtype), weight, bias).float()
