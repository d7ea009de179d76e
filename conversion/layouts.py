"""Reading and writing the EAGLE-3 checkpoint layouts in use, so that any of them loads with `from_pretrained`.

What each layout looks like, as read in the public sources (November 2026; the tests freeze these names):

* EAGLE reference -- SafeAILab/EAGLE eagle/model/cnets.py (`Model`): a Llama config
  (`architectures: ["LlamaForCausalLMEagle3"]`, `model_type: "llama"`) plus `draft_vocab_size` and
  optionally `target_hidden_size` (without it `fc` reads 3 x `hidden_size`). Weights `fc.weight`,
  `midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight`,
  `midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`,
  `lm_head.weight`, buffers `d2t` (long) and `t2d` (bool), sometimes `embed_tokens.weight`. No layer ids
  are stored: eagle/model/modeling_llama_kv.py keeps `hidden_states` *before* decoder layer `idx` for
  `idx in (2, L//2, L-3)`, i.e. our `hidden_states[idx]`.
* SpecForge -- sgl-project/SpecForge specforge/modeling/draft/llama3_eagle.py (`LlamaForCausalLMEagle3`):
  the same keys, with `embed_tokens.weight`; config `eagle_config: {eagle_aux_hidden_state_layer_ids,
  use_aux_hidden_state}`. SGLang reads those ids as layer *outputs* (`set_eagle3_layers_to_capture` in
  sglang/srt/models/*.py: `layers_to_capture = [val + 1 for val in layer_ids]`, capture before that
  layer), so our hidden_states index is id + 1. EAGLE 3.1 (configs/qwen3-30B-A3B-eagle3.1.json):
  top-level `fc_norm: true`, `norm_output: true`.
* speculators -- vllm-project/speculators src/speculators/models/eagle3/{config,core}.py:
  `speculators_model_type: "eagle3"`, `architectures: ["Eagle3Speculator"]`, the decoder layer's config
  nested as `transformer_layer_config`, `speculators_config` (`proposal_methods[0].speculative_tokens`,
  `verifier.name_or_path`: both required by vLLM's SpeculatorsConfig), `draft_vocab_size`,
  `norm_before_residual`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`, and for 3.1
  `fc_norm` / `norm_output` (PR #610, #670). Weights `layers.0.*` instead of `midlayer.*`, plus
  `embed_tokens.weight`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d` (the last two absent
  when the draft vocabulary is the full one), `fc_norm.{0,1,2}.weight`; training-only
  `verifier_norm.weight` / `verifier_lm_head.weight` may linger in older files and are dropped.
  Its layer ids are vLLM's: `aux_hidden_states.append(hidden_states + residual)` before layer `idx`
  (vllm/model_executor/models/llama.py), valid range 0..L (speculators models/utils.py
  `resolve_target_layer_ids`), so they are our hidden_states indices unchanged. vLLM also reads a
  top-level `eagle_aux_hidden_state_layer_ids` from any EAGLE-3 draft config, unshifted
  (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py).
* EAGLE 3.1 in any layout -- vLLM/SGLang/speculators name the switches `fc_norm` and `norm_output`
  (vllm PR #42764, #46488); the per-layer norms are `fc_norm.{i}.weight` (on disk sometimes with the
  `model.` prefix the engines add, NVIDIA-NeMo/Automodel PR #2322: `model.fc_norm.0.weight`).
  speculators' `norm_before_fc` (one norm over the concatenation, `input_norm.weight`) is a different
  architecture and is refused.
* `norm_before_residual`: vLLM's `_norm_before_residual` (residual = hidden_norm(g)); a speculators
  config without the field is read as True, as vLLM's speculators/algos.py does (speculators itself
  always writes it); other layouts default to False.

The project's own layout is a transformers checkpoint with `model_type: "eagle3_drafter"`.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hf_eagle31.configuration import MODEL_TYPE, Eagle3Config, default_target_layer_ids

LAYOUTS = ("hf_eagle31", "eagle", "specforge", "speculators")
EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_FIELDS = (  # the decoder layer's shape, shared by every layout's config
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id",
)
DROPPED_KEYS = ("verifier_norm.weight", "verifier_lm_head.weight", "rotary_emb.inv_freq")
HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download")
SPECULATORS_DEFAULT_TOKENS = 3  # only if the drafter has no chain length of its own


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as an EAGLE drafter; the message says what is wrong."""


class MissingCheckpointError(FileNotFoundError):
    """No checkpoint where one was expected: no folder or Hub repository, no config.json, or no weights."""


# --- files -----------------------------------------------------------------------------------


def checkpoint_folder(path: str | Path, **hub_kwargs) -> Path:
    """A local folder first; otherwise a Hub repository id, downloaded through huggingface_hub."""
    folder = Path(path)
    if folder.is_dir():
        return folder
    if folder.exists() or str(path).count("/") != 1:
        raise MissingCheckpointError(f"{path} is neither a checkpoint folder nor a Hub repository id")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.bin", "*.md"]
    return Path(snapshot_download(str(path), allow_patterns=patterns, **hub_kwargs))


def read_json(file: Path) -> dict:
    """A JSON object; a truncated or foreign file is named, not a decoder error."""
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file} is not valid JSON ({err}): the download may be incomplete; fetch it "
                              "again") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} holds a JSON {type(data).__name__}, not an object")
    return data


def read_config(folder: Path) -> dict:
    file = folder / "config.json"
    if not file.is_file():
        raise MissingCheckpointError(f"no config.json in {folder}: not a drafter checkpoint")
    return read_json(file)


def has_safetensors(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()


def load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a truncated, empty or foreign file is named, not a header error."""
    try:
        return load_file(file)
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{file} is not a readable safetensors file ({err}): the download may be "
                              "incomplete or corrupt; fetch it again") from None


def read_weights(folder: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """safetensors (one file or an index of shards); `pytorch_model.bin` only when `allow_pickle`."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return load_safetensors(single)
    if index.is_file():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        return {k: v for shard in shards for k, v in load_safetensors(folder / shard).items()}
    if (folder / "pytorch_model.bin").is_file():
        if not allow_pickle:
            raise CheckpointError(
                f"{folder} holds only pytorch_model.bin, a pickle that can run code when loaded; pass "
                "allow_pickle=True (--allow-pickle) if you trust it, or convert it to safetensors."
            )
        return load_pickle(folder / "pytorch_model.bin")
    raise MissingCheckpointError(f"no weights in {folder} (model.safetensors, its index, or pytorch_model.bin)")


def load_pickle(file: Path) -> dict[str, torch.Tensor]:
    """A `pytorch_model.bin` of plain tensors; torch refuses anything else (`weights_only`), and so do we, by name."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError):
        raise CheckpointError(
            f"{file} is not a pickle of plain tensors that torch {torch.__version__} can load safely: it is corrupt "
            "or holds other Python objects; where it was written, save its tensors as model.safetensors"
        ) from None


# --- detection and reading -------------------------------------------------------------------


def detect_layout(config: dict, keys: set[str] | frozenset[str] = frozenset()) -> str:
    """Which project wrote this checkpoint; the EAGLE 3.1 switches are orthogonal to it."""
    if config.get("model_type") == MODEL_TYPE:
        return "hf_eagle31"
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise CheckpointError(f"speculators model type {config['speculators_model_type']!r} is not EAGLE-3")
        return "speculators"
    if EAGLE_ARCHITECTURE in (config.get("architectures") or []) or "midlayer.hidden_norm.weight" in keys:
        return "specforge" if "eagle_config" in config else "eagle"
    raise CheckpointError(
        f"unknown checkpoint layout: looked for model_type {MODEL_TYPE!r} (this project), "
        "speculators_model_type 'eagle3' (speculators), architectures ['LlamaForCausalLMEagle3'] or "
        "midlayer.* weights (EAGLE reference, SpecForge); found model_type "
        f"{config.get('model_type')!r}, architectures {config.get('architectures')}"
    )


def read_target_layer_ids(config: dict) -> list[int] | None:
    """The captured layers as our hidden_states indices; None means the default [2, L//2, L-3].

    SpecForge's `eagle_config` ids name layer outputs (SGLang adds 1); a top-level list is vLLM's and
    speculators' (layer inputs, already our indices). A checkpoint carrying both must agree. (SGLang-derived
    runtimes such as lightseekorg/tokenspeed also take a top-level list when there is no `eagle_config`,
    with SGLang's +1: the engines disagree there, so `save_in_layout` never writes one without the other
    outside the speculators layout.)
    """
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = [int(i) + 1 for i in nested] if nested else None
    top = [int(i) for i in top] if top else None
    if nested and top and nested != top:
        raise CheckpointError(
            f"the captured layers disagree: eagle_config.eagle_aux_hidden_state_layer_ids names outputs of "
            f"layers {[i - 1 for i in nested]} (SGLang), the top-level list inputs of layers {top} (vLLM)"
        )
    return nested or top


def to_config(layout: str, config: dict, keys: set[str]) -> Eagle3Config:
    """Our config from another layout's (and its renamed weight keys): layer shape, vocabularies, captured
    layers, 3.1 switches, whether it carries its own embedding."""
    if config.get("norm_before_fc") or "input_norm.weight" in keys:
        raise CheckpointError(
            "norm_before_fc (one RMSNorm over the concatenated features, input_norm.weight) is not EAGLE 3.1's "
            "per-layer fc_norm, and this drafter does not implement it"
        )
    if not (config.get("eagle_config") or {}).get("use_aux_hidden_state", True):
        raise CheckpointError("eagle_config.use_aux_hidden_state is false: an EAGLE-2 head, not EAGLE-3")
    layer = config["transformer_layer_config"] if layout == "speculators" else config
    fields = {k: layer[k] for k in LAYER_FIELDS if k in layer}
    fields["target_hidden_size"] = config.get("target_hidden_size") or layer.get("hidden_size")
    fields["draft_vocab_size"] = config.get("draft_vocab_size") or layer.get("vocab_size")
    fields["norm_before_residual"] = bool(config.get("norm_before_residual", layout == "speculators"))
    fields["fc_norm"] = bool(config.get("fc_norm", False))
    fields["norm_output"] = bool(config.get("norm_output", False))
    fields["target_layer_ids"] = read_target_layer_ids(config)
    fields["include_embedding"] = "embed_tokens.weight" in keys
    try:
        return Eagle3Config(**fields)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"the {layout} config does not describe a valid drafter: {err}") from err


def rename_keys(layout: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our key names: a leading `model.` dropped, `layers.0.*` -> `midlayer.*`, `fc_norms.*` -> `fc_norm.*`."""
    state = {}
    for key, value in weights.items():
        key = key.removeprefix("model.")
        if key in DROPPED_KEYS:
            continue
        if layout == "speculators" and key.startswith("layers.0."):
            key = "midlayer." + key.removeprefix("layers.0.")
        state[key] = value
    return state


def read_checkpoint(path: str | Path, allow_pickle: bool = False) -> tuple[Eagle3Config, dict[str, torch.Tensor], str]:
    """A checkpoint in any supported layout -> (our config, a state dict in our key names, the layout)."""
    folder = checkpoint_folder(path)
    config = read_config(folder)
    if config.get("model_type") == MODEL_TYPE:  # a transformers checkpoint, always in safetensors
        if not has_safetensors(folder):
            raise MissingCheckpointError(f"no model.safetensors in {folder}: the drafter's weights are missing")
        try:
            ours = Eagle3Config.from_dict(config)
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"{folder / 'config.json'} does not describe a valid drafter: {err}") from None
        return ours, read_weights(folder), "hf_eagle31"
    weights = read_weights(folder, allow_pickle)
    layout = detect_layout(config, set(weights))
    state = rename_keys(layout, weights)
    ours = to_config(layout, config, set(state))
    if "d2t" not in state and "t2d" not in state and ours.draft_vocab_size == ours.vocab_size:
        state["d2t"] = torch.zeros(ours.draft_vocab_size, dtype=torch.long)  # full vocabulary: the identity map
        state["t2d"] = torch.ones(ours.vocab_size, dtype=torch.bool)
    return ours, state, layout


def check_state_dict(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor], source: str) -> None:
    """Missing, unexpected or wrongly shaped weights, each named, before anything is loaded."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: missing weights {missing}, unexpected weights {unexpected} (fc_norm.* weights come "
            "with the config flag fc_norm: true, embed_tokens.weight is optional)"
        )
    wrong = {k: (tuple(v.shape), tuple(expected[k].shape)) for k, v in state.items() if v.shape != expected[k].shape}
    if "fc.weight" in wrong:
        got, want = wrong["fc.weight"]
        raise CheckpointError(
            f"{source}: fc.weight has shape {got} but the config implies {want}: fc reads 3 captured layers x "
            f"target_hidden_size {want[1] // 3} into hidden_size {want[0]}"
        )
    if wrong:
        shapes = ", ".join(f"{k} has shape {got} but the config implies {want}" for k, (got, want) in wrong.items())
        raise CheckpointError(
            f"{source}: {shapes} (the config's hidden, intermediate, vocabulary, draft vocabulary or attention "
            "head sizes disagree with the weights)"
        )


# --- export ------------------------------------------------------------------------------------


def layer_config(config: Eagle3Config) -> dict:
    """The decoder layer as the engines' Llama config, with rope in its classic fields."""
    fields = {k: getattr(config, k) for k in LAYER_FIELDS if k not in ("rope_theta", "rope_scaling", "rope_parameters")}
    rope = dict(config.rope_parameters or {})
    fields["rope_theta"] = rope.pop("rope_theta", 10000.0)
    fields["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    return {"model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False, **fields}


def is_default_layers(ids: list[int]) -> bool:
    """Whether `ids` are EAGLE-3's [2, L//2, L-3] for the L they imply (L = ids[2] + 3)."""
    return ids == default_target_layer_ids(ids[2] + 3)


def save_in_layout(model, folder: str | Path, layout: str) -> Path:
    """Write `model` in `layout`, weights untouched, so its own project or vLLM / SGLang serves it as is.

    "eagle": the EAGLE reference (captured layers implied, so only the default ones); "specforge": the
    same keys with SpecForge's `eagle_config` and, for vLLM, the same layers as a top-level list;
    "speculators": vLLM's native format; "hf_eagle31": `save_pretrained`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    folder = Path(folder)
    if layout == "hf_eagle31":
        model.save_pretrained(folder)
        return folder
    config: Eagle3Config = model.config
    ids = config.target_layer_ids  # None: [2, L//2, L-3] of whichever target, which every engine assumes
    if layout == "eagle" and ids is not None and not is_default_layers(ids):
        raise ValueError(
            f"the EAGLE reference layout cannot record target_layer_ids {ids} (it always captures "
            "[2, L//2, L-3]); export with layout='specforge' or 'speculators' instead"
        )
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    common = {
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "norm_before_residual": config.norm_before_residual,
        "fc_norm": config.fc_norm,
        "norm_output": config.norm_output,
        **({"eagle_aux_hidden_state_layer_ids": ids} if ids is not None and layout != "eagle" else {}),
    }
    if layout == "speculators":
        state = {"layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k: v for k, v in state.items()}
        tokens = getattr(model.generation_config, "num_assistant_tokens", None) or SPECULATORS_DEFAULT_TOKENS
        out = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer_config(config),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(tokens)}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": None, "architectures": []},
            },
            **common,
        }
    else:
        out = {"architectures": [EAGLE_ARCHITECTURE], **layer_config(config), **common}
        if layout == "specforge":
            out["eagle_config"] = {"use_aux_hidden_state": True}
            if ids is not None:
                out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(out, indent=2) + "\n")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
