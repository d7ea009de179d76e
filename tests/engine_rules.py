"""How vLLM, SGLang and the EAGLE reference read a draft checkpoint, transcribed from their code.

None of the three runs here: vLLM 0.33 and SGLang 0.5.23 need their compiled kernels and a GPU
runtime, SafeAILab/EAGLE's `EaModel` a target loaded through its own modeling files. So their config
reading and weight-name rules are spelled out below as literally as their code allows, with the file
each comes from, and the tests check exports (and the fixtures) against them. Each function answers
what the engine would do with a folder's `config.json` and weight names: which parameters it builds,
which it fills, and what it leaves silently random or refuses.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

LAYER_PARAMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.qkv_proj",
                "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj", ".gate_proj": ".gate_up_proj",
           ".up_proj": ".gate_up_proj"}  # both engines' stacked_params_mapping


def read_folder(folder: Path) -> tuple[dict, set[str]]:
    config = json.loads((folder / "config.json").read_text())
    with safe_open(folder / "model.safetensors", "pt") as weights:
        return config, set(weights.keys())


def stacked(name: str) -> str:
    for part, fused in STACKED.items():
        if part in name:
            return name.replace(part, fused)
    return name


def vllm_config(config: dict) -> dict:
    """vllm/transformers_utils/configs/speculators/algos.py `update_eagle3`: a speculators config becomes
    its transformer_layer_config plus these fields (note `norm_before_residual` defaults to True)."""
    if "speculators_model_type" not in config:
        return config
    out = dict(config["transformer_layer_config"])
    out["draft_vocab_size"] = config.get("draft_vocab_size")
    if config.get("target_hidden_size") is not None:
        out["target_hidden_size"] = config["target_hidden_size"]
    out["norm_before_residual"] = config.get("norm_before_residual", True)
    for name in ("norm_before_fc", "fc_norm", "norm_output"):
        out[name] = config.get(name, False)
    if config.get("eagle_aux_hidden_state_layer_ids"):
        out["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
    return out


def vllm_reads(folder: Path, target_vocab: int) -> dict:
    """vllm/model_executor/models/llama_eagle3.py (0.33) `Eagle3LlamaForCausalLM`: the switches it honours,
    the parameters it builds, and `refused` (names `load_weights` has no parameter for: AutoWeightsLoader
    raises) and `unfilled` (parameters left at their init: the embedding is then shared from the target)."""
    config, keys = read_folder(folder)
    config = vllm_config(config)
    eagle = config.get("eagle_config") or {}
    layer_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    count = config.get("num_aux_hidden_states") or (len(layer_ids) if layer_ids else 3)
    norm_before_fc = bool(eagle.get("norm_before_fc", config.get("norm_before_fc", False)))
    params = {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight", "model.fc.weight",
              *(f"model.layers.0.{name}.weight" for name in LAYER_PARAMS)}
    params |= {"model.input_norm.weight"} if norm_before_fc else set()
    params |= {f"model.fc_norm.{i}.weight" for i in range(count)} if config.get("fc_norm", False) else set()
    if (config.get("draft_vocab_size") or config["vocab_size"]) != target_vocab:
        params.add("draft_id_to_target_id")
    loaded = set()
    for name in keys - {"t2d"}:
        name = "draft_id_to_target_id" if name == "d2t" else name if "lm_head" in name else "model." + name
        loaded.add(stacked(name.replace("midlayer.", "layers.0.")))
    return {"fc_inputs": count * config.get("target_hidden_size", config["hidden_size"]),
            "norm_before_residual": config.get("norm_before_residual", False), "norm_before_fc": norm_before_fc,
            "fc_norm": config.get("fc_norm", False), "norm_output": config.get("norm_output", False),
            "refused": loaded - params, "unfilled": params - loaded}


def sglang_reads(folder: Path) -> dict:
    """python/sglang/srt/models/llama_eagle3.py (0.5.23) `LlamaForCausalLMEagle3`: the switches it honours
    (no norm_before_residual: the residual is always the un-normed feature), the parameters it builds, and
    `dropped` (names `load_weights` finds no parameter for: skipped without a word) and `unfilled`."""
    config, keys = read_folder(folder)
    eagle = config.get("eagle_config") or {}
    layer_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    count = config.get("num_aux_hidden_states") or (len(layer_ids) if layer_ids else 3)
    norm_before_fc = bool(eagle.get("norm_before_fc", config.get("norm_before_fc", False)))
    fc_norm = bool(config.get("fc_norm") or config.get("use_aux_norm", False))
    params = {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight", "model.fc.weight",
              *(f"model.layers.0.{name}.weight" for name in LAYER_PARAMS)}
    params |= {"model.input_norm.weight"} if norm_before_fc else set()
    params |= {f"model.fc_norm.{i}.weight" for i in range(count)} if fc_norm else set()
    legacy = {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
              "aux_norm_high": "fc_norm.2"}
    loaded = set()
    for name in keys - {"d2t", "t2d"}:  # d2t becomes hot_token_id, t2d is skipped
        for old, new in legacy.items():
            name = name.replace(old, new)
        name = stacked(name)
        loaded.add(name if name in params else "model." + name)
    return {"serves": "LlamaForCausalLMEagle3" in (config.get("architectures") or []),
            "fc_inputs": count * config.get("target_hidden_size", config["hidden_size"]),
            "fc_norm": fc_norm, "norm_before_fc": norm_before_fc, "norm_output": config.get("norm_output", False),
            "dropped": loaded - params, "unfilled": params - loaded}


def safeailab_reads(folder: Path) -> dict:
    """SafeAILab/EAGLE eagle/model/cnets.py `Model` and ea_model.py `EaModel` (commit cb7e084): the embedding
    is the target's only when the config has no `target_hidden_size` (`load_emb and not hasattr(config,
    "target_hidden_size")`), otherwise whatever the checkpoint carries, since the state dict loads with
    `strict=False`, which also drops unknown names without a word; d2t/t2d are deleted for a full vocabulary."""
    config, keys = read_folder(folder)
    params = {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d",
              *(f"midlayer.{name}.weight" for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                                        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                        "mlp.down_proj"))}
    if config.get("draft_vocab_size") == config["vocab_size"]:
        params -= {"d2t", "t2d"}
    embedding = ("target" if "target_hidden_size" not in config
                 else "checkpoint" if "embed_tokens.weight" in keys else "random")
    return {"embedding": embedding, "fc_inputs": 3 * config.get("target_hidden_size", config["hidden_size"]),
            "dropped": keys - params, "unfilled": params - keys - {"embed_tokens.weight"}}
