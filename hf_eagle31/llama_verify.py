"""A Llama target's verify forward on packed weights: transformers' own ops, without its module dispatch.

Why: on a CPU, a verify forward of SmolLM2-135M spends about a sixth of its time (~7 of 43 ms, 2
threads) in transformers' machinery around the products: module calls, keyword plumbing, the
attention interface, output capturing. Serving engines compile that away; `torch.compile` did not
gain here (docs/benchmarks.md). The forward below runs the same torch ops in the same order on the
same packed weights and cache, so its logits and features equal the transformers path's bit for
bit (tests/test_llama_verify.py compares them), and it runs only where that holds by construction:
transformers' own Llama classes, every projection packed (packing.py), no hooks or replaced forwards
on the modules it steps over, a cache of growing layers, a "batched" plan. Anything else, on any
device, runs the target's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module
from transformers import Cache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaModel,
    LlamaRMSNorm,
)
from transformers.utils import output_capturing

LINEAR = torch.ops.mkldnn._linear_pointwise


def _no_hooks(module: nn.Module) -> bool:
    """No hooks but transformers' output capturing ones, which record only inside a transformers forward that asks
    (it installs them for good at the first `output_hidden_states`; the lean forward captures its own features)."""
    return not module._forward_pre_hooks and all(hook.__module__ == output_capturing.__name__
                                                 for hook in module._forward_hooks.values())


def _quiet(module: nn.Module) -> bool:
    """Calling the module would run exactly its class's forward: no hooks (`_no_hooks`), no forward replaced."""
    return _no_hooks(module) and "forward" not in vars(module)


def _one_product(*members: nn.Linear) -> bool:
    """Whether `members` are packed as one product (packing.py's `PackedGroup`), in this order."""
    group = getattr(members[0], "packed", None)
    return group is not None and len(group.sizes) == len(members) and all(
        getattr(member, "packed", None) is group and member.packed_member == index
        for index, member in enumerate(members))


def _fits_layer(layer: nn.Module) -> bool:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if not (type(layer) is LlamaDecoderLayer and type(attention) is LlamaAttention and type(mlp) is LlamaMLP and
            type(layer.input_layernorm) is LlamaRMSNorm and type(layer.post_attention_layernorm) is LlamaRMSNorm and
            isinstance(mlp.act_fn, nn.Module)):
        return False
    projections = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj,
                   mlp.up_proj, mlp.down_proj)
    return (_one_product(attention.q_proj, attention.k_proj, attention.v_proj) and _one_product(attention.o_proj) and
            _one_product(mlp.gate_proj, mlp.up_proj) and _one_product(mlp.down_proj) and
            all(map(_no_hooks, projections)) and
            all(map(_quiet, (layer, attention, mlp, layer.input_layernorm, layer.post_attention_layernorm,
                             mlp.act_fn))))


def fits(target: PreTrainedModel) -> bool:
    """Whether `llama_verify_forward` computes the target's verify forwards exactly as `target(...)` would, where
    `fits_step` too. Checked once per call, after packing: it walks every module (~1 ms)."""
    model = getattr(target, "model", None)
    if target.training or type(model) is not LlamaModel or type(model.norm) is not LlamaRMSNorm:
        return False
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:  # apply to every module
        return False
    return all(map(_quiet, (model, model.embed_tokens, model.rotary_emb, model.norm))) and \
        all(map(_fits_layer, model.layers))


def fits_step(cache: Cache, plan) -> bool:
    """Whether this verify forward is one `llama_verify_forward` computes: a "batched" plan, growing cache layers."""
    return plan.mode == "batched" and not plan.held and all(type(layer) is DynamicLayer for layer in cache.layers)


def _rms_norm(norm: LlamaRMSNorm, x: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def _product(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    group = layer.packed
    return LINEAR(x.contiguous(), group.weight, group.bias, "none", [], "")


def _attention(attention: LlamaAttention, x: torch.Tensor, cos, sin, cache: Cache, plan) -> torch.Tensor:
    shape = (*x.shape[:-1], -1, attention.head_dim)
    query, key, value = (part.view(shape).transpose(1, 2)
                         for part in _product(x, attention.q_proj).split(attention.q_proj.packed.sizes, dim=-1))
    query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
    key, value = cache.update(key, value, attention.layer_idx)
    mask = plan.additive_layer_mask(key.shape[2], None, query.dtype)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=attention.scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    out = out.transpose(1, 2).contiguous().reshape(*x.shape[:-1], -1).contiguous()
    return _product(out, attention.o_proj)


def _mlp(mlp: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
    gate, up = _product(x, mlp.gate_proj).split(mlp.gate_proj.packed.sizes, dim=-1)
    return _product(mlp.act_fn(gate) * up, mlp.down_proj)


def llama_verify_forward(target: PreTrainedModel, cache: Cache, plan, tokens: torch.Tensor, positions: torch.Tensor,
                         target_layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_forward`'s result where `fits` and `fits_step`: raw float logits `[B, n, V]`, features `[B, n, 3 H_t]`."""
    model = target.model
    x = model.embed_tokens(tokens)
    cos, sin = model.rotary_emb(x, position_ids=positions)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    states = {}
    for index, layer in enumerate(model.layers[: model.config.num_hidden_layers]):
        states[index] = x
        x = x + _attention(layer.self_attn, _rms_norm(layer.input_layernorm, x), cos, sin, cache, plan)
        x = x + _mlp(layer.mlp, _rms_norm(layer.post_attention_layernorm, x))
    x = _rms_norm(model.norm, x)
    states[model.config.num_hidden_layers] = x
    return target.lm_head(x).float(), torch.cat([states[i] for i in target_layer_ids], dim=-1)
