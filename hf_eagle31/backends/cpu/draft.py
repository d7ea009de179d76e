"""An EAGLE drafter's forward computed whole by the rows library (rows_step.cpp's `draft_step`): one call a draft
level instead of about 60 small torch operations between its six products.

Why: a draft level multiplies a few rows by a drafter of a few million weights, so its products take tens of
microseconds each, and the operations between them (norms, rotary turn, cache writes, the mask, attention, the
gate) cost as much again in Python and dispatch; on a SmolLM2 pair three draft forwards a step spent ~2 ms there,
a tenth of an EAGLE step. The library computes what `Eagle3DraftModel.forward` computes, rounding where torch's
operations round (a bf16 result after each), its attention a rounding apart from SDPA's; drafting proposes and the
target verifies, so the output does not depend on it.

It serves the drafters the module forward defines with one decoder layer, as this package loads them (no stacked
layers, no hooks or replaced forwards, SiLU, every linear layer on a product, fp32 or bf16, a head size the
library attends over), at row counts the rows kernel serves; anything else runs the module forward.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from hf_eagle31.backends.cpu import routes, rows
from hf_eagle31.backends.cpu.lean import SILU
from hf_eagle31.backends.cpu.products import Product, Products, quiet
from hf_eagle31.drafting import DraftForward
from hf_eagle31.modeling import Eagle3Attention, Eagle3DecoderLayer, Eagle3DraftModel, Eagle3DraftOutput


def whole_forward(drafter: Eagle3DraftModel, products: Products | None) -> DraftForward | None:
    """The drafter's forward on the rows library for one call (its weights handed to the library under their
    products' keys), or None where the library does not compute this drafter (`_products`)."""
    held = _products(drafter, products) if products is not None else None
    if held is None:
        return None
    norms, eps = _norms(drafter)
    keys = [p.key for p in held]
    torch.ops.hf_eagle31_rows.hold(keys, [len(p.members) for p in held], [w for p in held for w in p.members],
                                   [p.bias for p in held])
    return functools.partial(_forward, drafter, products, keys, [norm.weight for norm in norms], eps)


def _products(drafter: Eagle3DraftModel, products: Products) -> list[Product] | None:
    """The six products a forward multiplies by (fc, q/k/v, o, gate/up, down, lm_head), where the library computes
    this drafter's forward as its modules would; else None."""
    layer = drafter.midlayer
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(drafter) is not Eagle3DraftModel or drafter.training or len(drafter.layers) or \
            type(layer) is not Eagle3DecoderLayer or type(attention) is not Eagle3Attention or \
            type(mlp) is not LlamaMLP or type(mlp.act_fn) not in SILU or \
            drafter.dtype not in (torch.float32, torch.bfloat16) or not rows.rows_kernel() or \
            not rows.attends(attention.head_dim) or (drafter.fc_norm is not None and drafter.input_norm is not None):
        return None
    norms = _norms(drafter)[0]
    if not all(type(norm) is LlamaRMSNorm for norm in norms) or \
            not all(map(quiet, (drafter, layer, attention, mlp, mlp.act_fn, drafter.rotary_emb, *norms))):
        return None
    held = [products.of(*linears) for linears in (
        (drafter.fc,), (attention.q_proj, attention.k_proj, attention.v_proj), (attention.o_proj,),
        (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,), (drafter.lm_head,))]
    return None if any(product is None for product in held) else held


def _norms(drafter: Eagle3DraftModel) -> tuple[list[nn.Module], list[float]]:
    """The norms `draft_step` applies, in its order: the fc norms (3.1's one a captured layer, or one over the
    whole concatenation, or none), hidden_norm, input_layernorm, post_attention_layernorm, norm; and their eps."""
    fc = list(drafter.fc_norm or []) or ([drafter.input_norm] if drafter.input_norm is not None else [])
    layer = drafter.midlayer
    norms = [*fc, layer.hidden_norm, layer.input_layernorm, layer.post_attention_layernorm, drafter.norm]
    return norms, [norm.variance_epsilon for norm in norms]


def _forward(drafter: Eagle3DraftModel, products: Products, keys: list[int], norms: list[torch.Tensor],
             eps: list[float], input_ids: torch.Tensor, hidden_states: torch.Tensor, position_ids: torch.Tensor,
             cache, tail_mask: torch.Tensor, logits_to_keep: int = 0,
             logits_at: tuple[torch.Tensor, torch.Tensor] | None = None) -> Eagle3DraftOutput:
    """`drafter(input_ids, hidden_states, position_ids, cache, tail_mask, ...)` on `products`, computed whole where
    the rows kernel serves the row count (else by the modules); `norms` the weights of `_norms`, with their `eps`."""
    batch, n = input_ids.shape
    width, embedding = hidden_states.shape[-1], drafter.get_input_embeddings()
    # the module forward where it says what is wrong (no embedding, a width it does not take) or where the kernel
    # does not serve the rows, or logits picked by a boolean mask (training's)
    if embedding is None or width not in (drafter.fc.in_features, drafter.config.hidden_size) or \
            not routes.on_kernel(batch * n, drafter.dtype) or \
            (logits_at is not None and not isinstance(logits_at, tuple)):
        return drafter(input_ids, hidden_states, position_ids, cache, tail_mask, logits_to_keep, logits_at, products)
    config, attention = drafter.config, drafter.midlayer.self_attn
    embeds = embedding(input_ids).to(hidden_states.dtype)
    cos, sin = drafter.rotary_at(embeds, position_ids)
    like = embeds.new_empty(batch, config.num_key_value_heads, 0, attention.head_dim)
    keys_buffer, values_buffer = cache.buffers(attention.layer_idx, like, like)
    if logits_at is not None:
        chosen = logits_at[0] * n + logits_at[1]
    else:
        chosen = _last_rows(batch, n, n if logits_to_keep == 0 else min(logits_to_keep, n))
    logits, states = torch.ops.hf_eagle31_rows.draft_step(
        embeds, hidden_states, width == drafter.fc.in_features, keys, norms, eps, config.norm_before_residual,
        config.norm_output, cos, sin, keys_buffer, values_buffer, cache.at, tail_mask, chosen, attention.scaling,
        config.num_attention_heads, config.num_key_value_heads, config.intermediate_size, routes.ways(embeds.dtype))
    if logits_at is None:
        logits = logits.view(batch, -1, logits.shape[-1])
    return Eagle3DraftOutput(logits=logits, hidden_states=states, cache=cache)


@functools.lru_cache(maxsize=256)
def _last_rows(batch: int, n: int, kept: int) -> torch.Tensor:
    """The flat indices `[batch * kept]` of each row's last `kept` of its `n` positions, made once a shape (read, never
    written): four operations less at each of a step's draft forwards."""
    return (torch.arange(batch)[:, None] * n + torch.arange(n - kept, n)).reshape(-1)
