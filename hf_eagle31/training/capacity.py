"""More capacity for a trained drafter: decoder layers stacked after its own, starting as the identity."""

from __future__ import annotations

import torch

from hf_eagle31.modeling import Eagle3DraftModel, StackedDecoderLayer


@torch.no_grad()
def add_decoder_layers(drafter: Eagle3DraftModel, num_hidden_layers: int) -> None:
    """Grow `drafter` to `num_hidden_layers` decoder layers, in place, keeping what it computes.

    Why: a trained one-layer drafter is the best start a deeper one has, and a new layer whose output
    projections (`o_proj`, `down_proj`) are zero adds nothing to the residual stream, so the grown drafter
    drafts exactly as before and training moves it from there (the gradients reach the zeroed projections
    at once, and the rest of the layer after the first step).
    """
    have = drafter.config.num_hidden_layers
    if num_hidden_layers < have:
        raise ValueError(f"this drafter has {have} decoder layers; it cannot be grown to {num_hidden_layers}")
    for index in range(have, num_hidden_layers):
        layer = StackedDecoderLayer(drafter.config, index).to(drafter.device, drafter.dtype)
        layer.apply(drafter._init_weights)  # as a drafter built with this many layers starts
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        drafter.layers[str(index)] = layer
    drafter.config.num_hidden_layers = num_hidden_layers
