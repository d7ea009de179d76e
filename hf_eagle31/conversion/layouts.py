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
  top-level `fc_norm: true`, `norm_output: true`. Before SpecForge's PR 879 (0.2.0 and older),
  `norm_output` meant "final norm before lm_head" (default true; false skipped it) and the pre-norm
  state was always fed back; such heads are read as SGLang reads them today (README: how to run one
  as it was trained), and exports leave `norm_output` out unless it is on.
* speculators -- vllm-project/speculators src/speculators/models/eagle3/{config,core}.py:
  `speculators_model_type: "eagle3"`, `architectures: ["Eagle3Speculator"]`, the decoder layer's config
  nested as `transformer_layer_config`, `speculators_config` (`proposal_methods[0].speculative_tokens`,
  `verifier.name_or_path`: both required by vLLM's SpeculatorsConfig), `draft_vocab_size`,
  `norm_before_residual`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`, and for 3.1
  `fc_norm` / `norm_output` (PR #610, #670). Weights `layers.0.*` instead of `midlayer.*`, plus
  `embed_tokens.weight`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d` (the last two absent
  when the draft vocabulary is the full one), `fc_norm.{0,1,2}.weight`; training-only
  `verifier_norm.weight` / `verifier_lm_head.weight` may linger in older files and are dropped.
  The verifier (`speculators_config.verifier.name_or_path`) is kept as `verifier_name_or_path`.
  Its layer ids are vLLM's: `aux_hidden_states.append(hidden_states + residual)` before layer `idx`
  (vllm/model_executor/models/llama.py), valid range 0..L (speculators models/utils.py
  `resolve_target_layer_ids`), so they are our hidden_states indices unchanged. vLLM also reads a
  top-level `eagle_aux_hidden_state_layer_ids` from any EAGLE-3 draft config, unshifted
  (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py).
* EAGLE 3.1 in any layout -- vLLM/SGLang/speculators name the switches `fc_norm` and `norm_output`
  (vllm PR #42764, #46488); the per-layer norms are `fc_norm.{i}.weight` (on disk sometimes with the
  `model.` prefix the engines add, NVIDIA-NeMo/Automodel PR #2322: `model.fc_norm.0.weight`).
* Other spellings the engines accept (vLLM 0.33 llama_eagle3.py, SGLang 0.5.23 llama_eagle3.py), read the
  same way: `layers.0.*` keys in any layout (NeMo Automodel's vLLM export; vLLM maps `midlayer.` to
  `layers.0.`, SGLang the reverse); NeMo Automodel's raw save (`architectures: ["LlamaEagle3DraftModel"]`,
  the target's whole Llama config, keys under `model.`; nemo_automodel recipes/llm/train_eagle3.py);
  SGLang's legacy 3.1 names `use_aux_norm: true` and `aux_norm_{low,mid,high}.weight` (= `fc_norm`,
  `fc_norm.{0,1,2}.weight`); `norm_before_fc` (one RMSNorm over the concatenation, `input_norm.weight`;
  top-level or in `eagle_config`, as both engines read it); heads that capture more than three
  layers (`fc` reads `len(ids) x target_hidden_size`; SGLang and vLLM size it from
  `num_aux_hidden_states`, else the `eagle_config` list, else 3). A second decoder layer (`layers.1.*`)
  is refused by name, and so is an economize checkpoint (`economize_config.json`, economize 0.3.2
  core/serialization.py: only the technique's fields, with the layer's shape left to the base model).
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
from transformers import PreTrainedConfig

from hf_eagle31.configuration import MODEL_TYPE, Eagle3Config, default_target_layer_ids

LAYOUTS = ("hf_eagle31", "eagle", "specforge", "speculators")
EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle3"
EAGLE_ARCHITECTURES = (EAGLE_ARCHITECTURE, "LlamaEagle3DraftModel")  # the second: NeMo Automodel's raw save
LEGACY_NAMES = {"aux_norm_low.": "fc_norm.0.", "aux_norm_mid.": "fc_norm.1.", "aux_norm_high.": "fc_norm.2."}  # SGLang
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


class ExportError(ValueError):
    """A drafter that the chosen layout's readers would run differently; the message says which layout carries it."""


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


def peek_config(path: str | Path, kwargs: dict) -> dict | None:
    """The config.json of a folder or Hub id as transformers fetches it (`kwargs`' Hub options honoured),
    or None where transformers itself will say what is missing."""
    hub_kwargs = {k: kwargs[k] for k in (*HUB_KWARGS, "subfolder") if k in kwargs}
    try:
        return PreTrainedConfig.get_config_dict(str(path), **hub_kwargs)[0]
    except (OSError, ValueError):
        return None


def read_config(folder: Path) -> dict:
    file = folder / "config.json"
    if (folder / "economize_config.json").is_file() and not file.is_file():
        raise CheckpointError(
            f"{folder} is an economize checkpoint (economize_config.json): its EAGLE-3 technique takes its layer "
            "shape, rotary table and, with head='shared', its final norm and LM head from the base model, which "
            "the checkpoint does not hold, so it cannot be read on its own"
        )
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


def is_foreign_drafter(config: dict) -> bool:
    """Whether a config (no weights at hand) is an EAGLE-3 head in another project's layout."""
    return (config.get("speculators_model_type") == "eagle3"
            or bool(set(config.get("architectures") or []) & set(EAGLE_ARCHITECTURES)))


def detect_layout(config: dict, keys: set[str] | frozenset[str] = frozenset()) -> str:
    """Which project wrote this checkpoint; the EAGLE 3.1 switches are orthogonal to it."""
    if config.get("model_type") == MODEL_TYPE:
        return "hf_eagle31"
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise CheckpointError(f"speculators model type {config['speculators_model_type']!r} is not EAGLE-3")
        return "speculators"
    layer_keys = {k.removeprefix("model.") for k in keys} & {"midlayer.hidden_norm.weight", "layers.0.hidden_norm.weight"}
    if is_foreign_drafter(config) or layer_keys:
        return "specforge" if "eagle_config" in config else "eagle"
    raise CheckpointError(
        f"unknown checkpoint layout: looked for model_type {MODEL_TYPE!r} (this project), "
        "speculators_model_type 'eagle3' (speculators), architectures ['LlamaForCausalLMEagle3'] or "
        "['LlamaEagle3DraftModel'], or midlayer.* / layers.0.hidden_norm weights (EAGLE reference, SpecForge, "
        f"NeMo Automodel); found model_type {config.get('model_type')!r}, architectures {config.get('architectures')}"
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


def read_layer_count(config: dict, ids: list[int] | None) -> None:
    """Refuse a layer count that the listed layers do not back: which layers to capture must be known.
    (vLLM and SGLang take `num_aux_hidden_states` from the engine config, which for speculators is the
    `transformer_layer_config`.)"""
    count = config.get("num_aux_hidden_states", (config.get("transformer_layer_config") or {}).get("num_aux_hidden_states"))
    if count is not None and int(count) != (len(ids) if ids else 3):
        raise CheckpointError(
            f"num_aux_hidden_states is {count} but the config lists captured layers {ids} (none means EAGLE-3's "
            "three): add eagle_aux_hidden_state_layer_ids naming the layers this head was trained on"
        )


def to_config(layout: str, config: dict, keys: set[str]) -> Eagle3Config:
    """Our config from another layout's (and its renamed weight keys): layer shape, vocabularies, captured
    layers, 3.1 switches, whether it carries its own embedding, the verifier it names."""
    eagle_config = config.get("eagle_config") or {}
    if not eagle_config.get("use_aux_hidden_state", True):
        raise CheckpointError("eagle_config.use_aux_hidden_state is false: an EAGLE-2 head, not EAGLE-3")
    extra_layers = sorted({k.split(".")[1] for k in keys if k.startswith("layers.")})
    if extra_layers:
        raise CheckpointError(f"weights for decoder layers {extra_layers} beyond the first: a multi-layer drafter "
                              "(SGLang's additional_layers, P-EAGLE); this project implements the one-layer EAGLE-3 head")
    layer = config["transformer_layer_config"] if layout == "speculators" else config
    fields = {k: layer[k] for k in LAYER_FIELDS if k in layer}
    fields["target_hidden_size"] = config.get("target_hidden_size") or layer.get("hidden_size")
    fields["draft_vocab_size"] = config.get("draft_vocab_size") or layer.get("vocab_size")
    fields["norm_before_residual"] = bool(config.get("norm_before_residual", layout == "speculators"))
    fields["norm_before_fc"] = bool(eagle_config.get("norm_before_fc", config.get("norm_before_fc", False)))
    fields["fc_norm"] = bool(config.get("fc_norm") or config.get("use_aux_norm"))  # use_aux_norm: SGLang's old name
    fields["norm_output"] = bool(config.get("norm_output", False))
    fields["target_layer_ids"] = read_target_layer_ids(config)
    read_layer_count(config, fields["target_layer_ids"])
    fields["include_embedding"] = "embed_tokens.weight" in keys
    fields["verifier_name_or_path"] = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    try:
        return Eagle3Config(**fields)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"the {layout} config does not describe a valid drafter: {err}") from err


def rename_keys(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our key names: a leading `model.` dropped, `layers.0.*` -> `midlayer.*`, SGLang's legacy
    `aux_norm_{low,mid,high}.*` -> `fc_norm.{0,1,2}.*`; training-only tensors dropped."""
    state = {}
    for key, value in weights.items():
        key = key.removeprefix("model.")
        if key in DROPPED_KEYS:
            continue
        if key.startswith("layers.0."):
            key = "midlayer." + key.removeprefix("layers.0.")
        for legacy, name in LEGACY_NAMES.items():
            if key.startswith(legacy):
                key = name + key.removeprefix(legacy)
        state[key] = value
    return state


def card_base_model(folder: Path) -> str | None:
    """The model card's `base_model` (the target a Hub drafter names), if the folder has a readable card."""
    import yaml
    from huggingface_hub.repocard import metadata_load

    card = folder / "README.md"
    try:
        base = (metadata_load(card) or {}).get("base_model") if card.is_file() else None
    except (yaml.YAMLError, UnicodeDecodeError):  # a card is documentation: a broken one does not stop the load
        return None
    return base[0] if isinstance(base, list) and base else base


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
        state, layout = read_weights(folder), "hf_eagle31"
    else:
        weights = read_weights(folder, allow_pickle)
        layout = detect_layout(config, set(weights))
        state = rename_keys(weights)
        ours = to_config(layout, config, set(state))
    if "d2t" not in state and "t2d" not in state and ours.draft_vocab_size == ours.vocab_size:
        state["d2t"] = torch.zeros(ours.draft_vocab_size, dtype=torch.long)  # full vocabulary: the identity map
        state["t2d"] = torch.ones(ours.vocab_size, dtype=torch.bool)
    ours.verifier_name_or_path = ours.verifier_name_or_path or card_base_model(folder)
    return ours, state, layout


def check_state_dict(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor], source: str,
                     config: Eagle3Config) -> None:
    """Missing, unexpected, wrongly shaped or damaged weights, each named, before anything is loaded."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: missing weights {missing}, unexpected weights {unexpected} (fc_norm.* weights come "
            "with the config flag fc_norm: true, input_norm.weight with norm_before_fc: true, embed_tokens.weight "
            "is optional)"
        )
    wrong = {k: (tuple(v.shape), tuple(expected[k].shape)) for k, v in state.items() if v.shape != expected[k].shape}
    if "fc.weight" in wrong:
        got, want = wrong["fc.weight"]
        raise CheckpointError(
            f"{source}: fc.weight has shape {got} but the config implies {want}: fc reads "
            f"{config.num_aux_hidden_states} captured layers (eagle_aux_hidden_state_layer_ids; 3 when none are "
            f"listed) x target_hidden_size {config.target_hidden_size} into hidden_size {want[0]}"
        )
    if wrong:
        shapes = ", ".join(f"{k} has shape {got} but the config implies {want}" for k, (got, want) in wrong.items())
        raise CheckpointError(
            f"{source}: {shapes} (the config's hidden, intermediate, vocabulary, draft vocabulary or attention "
            "head sizes disagree with the weights)"
        )
    check_values(state, source, config.vocab_size)


def check_values(state: dict[str, torch.Tensor], source: str, vocab_size: int) -> None:
    """Weights that would load and then fail in the middle of a generation, each named: NaN or infinite
    values (sampling fails on them, greedy picks garbage), and a `d2t` that maps a draft id outside the
    target vocabulary (an index error at the first draft)."""
    broken = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if broken:
        raise CheckpointError(f"{source}: {', '.join(broken)} hold NaN or infinite values: the checkpoint is "
                              "damaged (or its training diverged)")
    d2t = state.get("d2t")
    if d2t is not None:
        mapped = torch.arange(d2t.shape[0]) + d2t.cpu()
        outside = ((mapped < 0) | (mapped >= vocab_size)).nonzero().flatten()
        if len(outside):
            raise CheckpointError(f"{source}: d2t maps {len(outside)} draft ids (the first: {int(outside[0])}) to "
                                  f"target ids outside the target vocabulary of {vocab_size} tokens")


# --- export ------------------------------------------------------------------------------------


def layer_config(config: Eagle3Config) -> dict:
    """The decoder layer as the engines' Llama config, with rope in its classic fields, and the number of
    captured layers where it is not EAGLE-3's three (vLLM's and SGLang's `num_aux_hidden_states`: vLLM's
    Llama drafter sizes `fc` from it, or else from `eagle_config`, never from the top-level list)."""
    fields = {k: getattr(config, k) for k in LAYER_FIELDS if k not in ("rope_theta", "rope_scaling", "rope_parameters")}
    rope = dict(config.rope_parameters or {})
    fields["rope_theta"] = rope.pop("rope_theta", 10000.0)
    fields["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    count = config.num_aux_hidden_states
    return {"model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False, **fields,
            **({"num_aux_hidden_states": count} if count != 3 else {})}


def is_default_layers(ids: list[int]) -> bool:
    """Whether `ids` are EAGLE-3's [2, L//2, L-3] for the L they imply (L = ids[2] + 3)."""
    return len(ids) == 3 and ids == default_target_layer_ids(ids[2] + 3)


def unrepresentable(config: Eagle3Config, layout: str) -> list[str]:
    """What of this head `layout`'s readers would silently run differently; empty when nothing.

    SGLang 0.5.23 and SpecForge always keep the un-normed residual (no `norm_before_residual`);
    SafeAILab's cnets.Model has no 3.1 switch, no `norm_before_fc`, no layer ids, and reads the target's
    embedding only when `target_hidden_size` is absent.
    """
    problems = []
    if config.num_hidden_layers > 1:
        problems.append(f"num_hidden_layers {config.num_hidden_layers}: the {layout} layout's readers build the one-layer "
                        "EAGLE-3 head (this project reads its own multi-layer heads only); save with "
                        "layout='hf_eagle31'")
    if layout in ("eagle", "specforge") and config.norm_before_residual:
        problems.append("norm_before_residual: SGLang and SpecForge always add the un-normed feature to the residual "
                        "(only vLLM and speculators honour the flag); export with layout='speculators'")
    if layout != "eagle":
        return problems
    switches = [name for name in ("fc_norm", "norm_output", "norm_before_fc") if getattr(config, name)]
    if switches:
        problems.append(f"{', '.join(switches)}: SafeAILab's cnets.Model has none of them; export with "
                        "layout='specforge' (SGLang, vLLM) or 'speculators' (vLLM)")
    ids = config.target_layer_ids  # None: [2, L//2, L-3] of whichever target, which every engine assumes
    if ids is not None and not is_default_layers(ids):
        problems.append(f"target_layer_ids {ids}: the EAGLE reference cannot record them (it always captures "
                        "[2, L//2, L-3]); export with layout='specforge' or 'speculators'")
    if config.target_hidden_size != config.hidden_size and not config.include_embedding:
        problems.append("target_hidden_size differs from hidden_size, so SafeAILab loads no embedding and needs "
                        "embed_tokens.weight in the checkpoint, which this drafter does not carry")
    return problems


def without_trivial_maps(config: Eagle3Config, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state without d2t/t2d when the draft vocabulary is the full one: vLLM then builds no
    `draft_id_to_target_id` and refuses them, speculators and NeMo Automodel leave them out."""
    if config.draft_vocab_size < config.vocab_size:
        return state
    if state["d2t"].any() or not state["t2d"].all():
        raise ExportError("the draft vocabulary is the full one, yet d2t/t2d map it to other ids: not a layout any "
                          "engine reads (they take a full draft vocabulary as the identity)")
    return {k: v for k, v in state.items() if k not in ("d2t", "t2d")}


def switches(config: Eagle3Config) -> dict[str, bool]:
    """The 3.1 switches and norm_before_fc, only where on: an explicit false reads otherwise in SpecForge
    before its PR 879 (`norm_output: false` skipped the final norm), and every engine defaults them off."""
    return {name: True for name in ("fc_norm", "norm_output", "norm_before_fc") if getattr(config, name)}


def verifier_entry(name: str) -> dict:
    """speculators' `verifier`: the target's name and, when its config is at hand, its architectures."""
    from hf_eagle31.packaged import cached_folder

    try:
        found = PreTrainedConfig.get_config_dict(str(cached_folder(name) or name),
                                                 local_files_only=True)[0].get("architectures") or []
    except (OSError, ValueError):
        found = []
    return {"name_or_path": name, "architectures": found}


def speculators_config(model, config: Eagle3Config, verifier: str | None, local_verifier: bool = False) -> dict:
    """vLLM's native format: the verifier named (speculators' loader and `vllm serve` read the target from it), by
    its Hub id: a folder on this machine only with `local_verifier` (`--local-verifier`)."""
    from hf_eagle31.packaged import portable_name, require_hub_id

    verifier = verifier or config.verifier_name_or_path
    if not verifier:
        raise ExportError(
            "the speculators layout must name the verifier (speculators_config.verifier.name_or_path: speculators "
            "and `vllm serve` load the target from it), and this drafter records none: pass verifier= "
            "(hf-eagle31 convert --verifier) with the target's Hub id or path"
        )
    try:
        verifier = portable_name(verifier) if local_verifier else require_hub_id(
            verifier, "the speculators verifier", "local_verifier=True (hf-eagle31 convert --local-verifier)")
    except ValueError as err:
        raise ExportError(str(err)) from None
    tokens = getattr(model.generation_config, "num_assistant_tokens", None) or SPECULATORS_DEFAULT_TOKENS
    ids = config.target_layer_ids
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer_config(config),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(tokens)}],
            "default_proposal_method": "greedy",
            "verifier": verifier_entry(verifier),
        },
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "norm_before_residual": config.norm_before_residual,  # always: vLLM reads a missing one as true
        **switches(config),
        **({"eagle_aux_hidden_state_layer_ids": ids} if ids is not None else {}),
    }


def reference_config(config: Eagle3Config, layout: str) -> dict:
    """The EAGLE reference's Llama config; SpecForge's adds `eagle_config` (SGLang's ids, layer outputs)
    and the same layers as a top-level list (vLLM's, layer inputs)."""
    out = {"architectures": [EAGLE_ARCHITECTURE], **layer_config(config), "draft_vocab_size": config.draft_vocab_size,
           **switches(config)}
    if config.target_hidden_size != config.hidden_size or layout == "specforge":
        out["target_hidden_size"] = config.target_hidden_size  # its absence makes SafeAILab load the target's embedding
    ids = config.target_layer_ids
    if layout == "specforge":
        out["eagle_config"] = {"use_aux_hidden_state": True}
        if ids is not None:
            out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids]
            out["eagle_aux_hidden_state_layer_ids"] = ids
    return out


def save_in_layout(model, folder: str | Path, layout: str, verifier: str | None = None,
                   local_verifier: bool = False) -> Path:
    """Write `model` in `layout`, weights untouched, so its own project or vLLM / SGLang serves it as is.

    "eagle": the EAGLE reference (captured layers implied, so only the default ones); "specforge": the
    same keys with SpecForge's `eagle_config` and, for vLLM, the same layers as a top-level list;
    "speculators": vLLM's native format, naming `verifier` (default: the target the drafter records) by its Hub
    id (a local folder only with `local_verifier`);
    "hf_eagle31": `save_pretrained`. A head the layout's readers would run differently is refused
    (`ExportError`, naming a layout that carries it), never written with a flag they ignore.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    folder = Path(folder)
    if layout == "hf_eagle31":
        model.save_pretrained(folder)
        return folder
    config: Eagle3Config = model.config
    problems = unrepresentable(config, layout)
    if problems:
        raise ExportError(f"the {layout} layout cannot carry this head as it is: " + "; ".join(problems))
    state = without_trivial_maps(config, {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()})
    if layout == "speculators":
        out = speculators_config(model, config, verifier, local_verifier)
        state = {"layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k: v for k, v in state.items()}
    else:
        out = reference_config(config, layout)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(out, indent=2) + "\n")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
