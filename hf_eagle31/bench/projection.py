"""Projected speedups at real model sizes: measured costs x measured acceptance, labelled as projections.

No real weights are needed: a randomly initialised model with a real config costs the same to
run. On a small machine the full model may not fit or take too long, so the target is measured
with a few decoder layers at full width and the per-layer cost is extrapolated linearly to the
real depth (t(n) = fixed(n) + layers * per_layer(n), fitted on two depths). The drafter (one
layer plus an LM head over its draft vocabulary) is measured whole. Speedups then combine these
costs with the acceptance measured on the demo pair (the tuning's calibration ranks), choosing the
best draft shape for the projected costs exactly as `hf_eagle31.tuning` does for a real pair.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config

from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.training import drafter_config_for
from hf_eagle31.tuning import draft_cost, rank_candidates, verify_cost_curve

REAL_SHAPES = {
    "Llama-3.1-8B": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "Qwen2.5-7B": Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}


def _model(config: PretrainedConfig, layers: int, device, dtype):
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def measure_costs(
    config: PretrainedConfig, sizes: list[int], depths: list[int], top_ks: tuple[int, ...] = (1, 3, 10),
    draft_vocab_size: int = 32000, context: int = 512, probe_layers: tuple[int, int] = (1, 3), device="cpu",
    dtype=torch.bfloat16,
) -> dict:
    """Target verify costs t(n) at the real depth (extrapolated unless probe_layers covers it), drafter tree costs."""
    layer_ids = [1, 1, 1]  # any captured states: the cost is the same
    curves = {}
    for layers in sorted(set(probe_layers)):
        model = _model(config, layers, device, dtype)
        curves[layers] = verify_cost_curve(model, sizes, layer_ids, context=context, repeats=3)
        del model
    low, high = min(curves), max(curves)
    real = config.num_hidden_layers
    verify = {}
    for n in sizes:
        per_layer = max(curves[high][n] - curves[low][n], 0.0) / max(high - low, 1)
        verify[n] = curves[high][n] + per_layer * (real - high)
    target_for_drafter = _model(config, 4, device, dtype)
    drafter = Eagle3DraftModel(drafter_config_for(target_for_drafter, "eagle3.1", min(draft_vocab_size, config.vocab_size)))
    drafter = drafter.to(device, dtype).eval()
    drafter.set_target_embedding(target_for_drafter.get_input_embeddings())
    drafts = {k: {d: draft_cost(drafter, d, k, context=context, repeats=3) for d in depths} for k in top_ks}
    return {"verify_seconds": verify, "draft_seconds": drafts, "probe_layers": list(curves), "extrapolated_to": real}


def project(costs: dict, ranks_by_top_k: dict[int, list[list[int]]]) -> dict:
    """The best draft shape for these costs and this acceptance, and its projected speedup."""
    verify, drafts = costs["verify_seconds"], costs["draft_seconds"]
    candidates = rank_candidates(verify, {k: drafts[k] for k in ranks_by_top_k if k in drafts}, ranks_by_top_k, verify[1])
    return {"step_seconds": verify[1], "verify_cost_ratio": {n: t / verify[1] for n, t in verify.items()},
            "draft_seconds": drafts, "best": max(candidates, key=lambda c: c["speedup"])}
