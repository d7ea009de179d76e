"""Reading and writing the EAGLE-3 checkpoint layouts in use, so that any of them loads with `from_pretrained`.

What each layout looks like, as read in the public sources (November 2026):

* EAGLE reference (SafeAILab/EAGLE, eagle/model/cnets.py): a Llama config (`model_type: llama`,
  `architectures: ["LlamaForCausalLMEagle3"]`) plus `draft_vocab_size` and optionally
  `target_hidden_size`; weights `fc.weight`, `midlayer.{hidden_norm,input_layernorm,
  post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight`,
  `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`. The
  captured layers are not stored: they are the default inputs of layers [2, L//2, L-3].
* SpecForge (sgl-project/SpecForge): the same keys, often with `embed_tokens.weight`, and an
  `eagle_config` whose `eagle_aux_hidden_state_layer_ids` SGLang reads as layer *outputs*
  (`set_eagle3_layers_to_capture` adds 1): our hidden_states index is id + 1.
* speculators (vllm-project/speculators, models/eagle3): `speculators_model_type: "eagle3"`, the
  decoder layer's config nested as `transformer_layer_config`, `draft_vocab_size`,
  `norm_before_residual`, `eagle_aux_hidden_state_layer_ids` (hidden_states indices: vLLM captures the
  residual entering layer i), `speculators_config`; weights `layers.0.*` instead of `midlayer.*`,
  plus `embed_tokens.weight`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`.
* EAGLE 3.1, in any of the above: config flags `fc_norm` and `norm_output` (vLLM's and SGLang's
  names), and one RMSNorm weight per captured layer, `fc_norm.{0,1,2}.weight`.
The project's own layout is a transformers checkpoint with `model_type: "eagle3_drafter"`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hf_eagle31.configuration import MODEL_TYPE, Eagle3Config, default_target_layer_ids

LAYOUTS = ("hf_eagle31", "eagle", "specforge", "speculators")
EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_FIELDS = (  # the decoder layer's shape, shared by every layout's config
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "attention_bias", "mlp_bias", "rope_theta", "rope_scaling",
    "rope_parameters", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id",
)
IGNORED_KEYS = ("verifier_norm.weight", "verifier_lm_head.weight", "model.rotary_emb.inv_freq", "rotary_emb.inv_freq")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as an EAGLE drafter; the message says what is wrong."""


# --- files -----------------------------------------------------------------------------------


def checkpoint_folder(path: str | Path, **hub_kwargs) -> Path:
    """A local folder, or a Hub repository downloaded through huggingface_hub."""
    folder = Path(path)
    if folder.is_dir():
        return folder
    if folder.exists() or str(path).count("/") != 1:
        raise FileNotFoundError(f"{path} is neither a checkpoint folder nor a Hub repository id")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.bin", "*.md"]
    return Path(snapshot_download(str(path), allow_patterns=patterns, **hub_kwargs))


def read_config(folder: Path) -> dict:
    file = folder / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {folder}: not a drafter checkpoint")
    return json.loads(file.read_text())


def read_weights(folder: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """safetensors (one file or an index of shards); `pytorch_model.bin` only when `allow_pickle`."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return load_file(single)
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(folder / shard).items()}
    if (folder / "pytorch_model.bin").is_file():
        if not allow_pickle:
            raise CheckpointError(
                f"{folder} holds only pytorch_model.bin, a pickle that can run code when loaded; pass "
                "allow_pickle=True if you trust it (or convert it to safetensors)."
            )
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no weights in {folder} (model.safetensors, its index, or pytorch_model.bin)")


# --- detection and reading -------------------------------------------------------------------


def detect_layout(config: dict, keys: set[str] | None = None) -> str:
    if config.get("model_type") == MODEL_TYPE:
        return "hf_eagle31"
    if config.get("speculators_model_type") is not None:
        if config["speculators_model_type"] != "eagle3":
            raise CheckpointError(f"speculators model type {config['speculators_model_type']!r} is not EAGLE-3")
        return "speculators"
    if EAGLE_ARCHITECTURE in (config.get("architectures") or []) or (keys and "midlayer.hidden_norm.weight" in keys):
        return "specforge" if "eagle_config" in config else "eagle"
    raise CheckpointError(
        "unknown checkpoint layout: expected model_type 'eagle3_drafter' (this project), "
        "speculators_model_type 'eagle3' (speculators), or architectures ['LlamaForCausalLMEagle3'] / "
        f"midlayer.* weights (EAGLE reference, SpecForge); got model_type {config.get('model_type')!r}, "
        f"architectures {config.get('architectures')}"
    )


def to_config(layout: str, config: dict, weights: dict[str, torch.Tensor]) -> Eagle3Config:
    """Our config from another layout's: the layer shape, vocabularies, captured layers, 3.1 switches."""
    layer = config["transformer_layer_config"] if layout == "speculators" else config
    fields = {k: layer[k] for k in LAYER_FIELDS if k in layer}
    fc = weights.get("fc.weight")
    if fc is None:
        raise CheckpointError("the checkpoint has no fc.weight: not an EAGLE-3 drafter")
    fields["target_hidden_size"] = config.get("target_hidden_size") or fc.shape[1] // 3
    fields["draft_vocab_size"] = config.get("draft_vocab_size") or weights["lm_head.weight"].shape[0]
    fields["norm_before_residual"] = bool(config.get("norm_before_residual", False))
    fields["fc_norm"] = bool(config.get("fc_norm", False)) or "fc_norm.0.weight" in weights
    fields["norm_output"] = bool(config.get("norm_output", False))
    fields["include_embedding"] = "embed_tokens.weight" in weights
    if layout == "speculators":
        fields["target_layer_ids"] = config.get("eagle_aux_hidden_state_layer_ids")
    elif layout == "specforge":
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        fields["target_layer_ids"] = [i + 1 for i in ids] if ids else None
    return Eagle3Config(**fields)


def to_state_dict(layout: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our key names: `layers.0.*` -> `midlayer.*`, `fc_norms.*` -> `fc_norm.*`, a leading `model.` dropped."""
    state = {}
    for key, value in weights.items():
        if key in IGNORED_KEYS:
            continue
        key = key.removeprefix("model.")
        if layout == "speculators" and key.startswith("layers.0."):
            key = "midlayer." + key.removeprefix("layers.0.")
        state[key.replace("fc_norms.", "fc_norm.")] = value
    return state


def read_checkpoint(path: str | Path, allow_pickle: bool = False) -> tuple[Eagle3Config, dict[str, torch.Tensor], str]:
    """Any supported layout -> (our config, a state dict in our key names, the layout's name)."""
    folder = checkpoint_folder(path)
    config = read_config(folder)
    weights = read_weights(folder, allow_pickle)
    layout = detect_layout(config, set(weights))
    weights = to_state_dict(layout, weights)
    return to_config(layout, config, weights), weights, layout


def check_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Missing, unexpected or wrongly shaped weights, each named, before anything is loaded."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{source}: missing weights {missing}, unexpected weights {unexpected}")
    for key, value in state.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise CheckpointError(
                f"{source}: {key} has shape {tuple(value.shape)} but the config implies {tuple(expected[key].shape)} "
                "(hidden size, vocabulary size or the number of captured layers disagree)"
            )


# --- export ------------------------------------------------------------------------------------


def layer_config(config: Eagle3Config) -> dict:
    """The decoder layer as the engines' Llama config, with rope in its classic fields."""
    fields = {k: getattr(config, k) for k in LAYER_FIELDS if k not in ("rope_theta", "rope_scaling", "rope_parameters")}
    rope = dict(config.rope_parameters or {})
    fields["rope_theta"] = rope.pop("rope_theta", 10000.0)
    if rope.get("rope_type", "default") != "default":
        fields["rope_scaling"] = rope
    return {"model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False, **fields}


def export_checkpoint(model, folder: str | Path, layout: str) -> Path:
    """Write `model` in `layout` ("eagle"/"specforge": the EAGLE reference keys with SpecForge's
    eagle_config; "speculators"), so vLLM and SGLang serve the same head unchanged."""
    if layout not in ("eagle", "specforge", "speculators"):
        raise ValueError(f"export layout must be 'eagle', 'specforge' or 'speculators', got {layout!r}")
    config: Eagle3Config = model.config
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    ids = config.target_layer_ids  # None: [2, L//2, L-3], what every engine assumes when none are given
    common = {
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "norm_before_residual": config.norm_before_residual,
        "fc_norm": config.fc_norm,
        "norm_output": config.norm_output,
    }
    if layout == "speculators":
        state = {("layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k: v for k, v in state.items()}
        out = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer_config(config),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": None, "architectures": []},
            },
            **common,
        }
        if ids is not None:
            out["eagle_aux_hidden_state_layer_ids"] = ids
    else:
        out = {"architectures": [EAGLE_ARCHITECTURE], **layer_config(config), **common}
        if layout == "specforge" and ids is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True}
        elif layout == "eagle" and ids is not None and (
            config.num_target_layers is None or ids != default_target_layer_ids(config.num_target_layers)
        ):
            raise ValueError(
                f"the EAGLE reference layout cannot record target_layer_ids {ids} (it always captures "
                "[2, L//2, L-3]); export with layout='specforge' instead"
            )
    (folder / "config.json").write_text(json.dumps(out, indent=2))
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
