"""Every EAGLE checkpoint layout loads with `from_pretrained`, to the same module outputs.

The foreign checkpoints are written here by hand, in the real key names and config shapes of each
project (see the header of hf_eagle31/conversion/layouts.py, and REFERENCE_KEYS below, spelled out literally),
not by our own exporter, so the reader is checked against the layouts themselves; the exporter is then
checked by round trips and against the engines' own reading rules (`engine_rules.py`, transcribed from
vLLM, SGLang and SafeAILab/EAGLE). Heads written by speculators' and SpecForge's own code are in
`test_peer_fixtures.py`. The drafters use a llama3-scaled rope so that a config field lost on the way
changes the outputs.
"""

import json

import pytest
import torch
import transformers
from engine_rules import read_folder, safeailab_reads, sglang_reads, vllm_reads
from safetensors.torch import save_file
from tiny_models import LAYERS, PROMPTS, make_drafter, make_target, trained_pair

from hf_eagle31 import Eagle3Config, Eagle3DraftModel
from hf_eagle31.checkpoints import convert_checkpoint
from hf_eagle31.cli import main as cli
from hf_eagle31.compat import LOAD_KWARGS
from hf_eagle31.configuration import safeailab_tree_settings
from hf_eagle31.conversion.layouts import (
    CheckpointError,
    ExportError,
    MissingCheckpointError,
    detect_layout,
    read_checkpoint,
    save_in_layout,
)
from hf_eagle31.drafting import DrafterState, draft_tree
from hf_eagle31.generation import prepare_drafter

ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
LLAMA_FIELDS = dict(  # as the engines' configs spell them: rope in the classic rope_theta / rope_scaling
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=500000.0,
    rope_scaling=ROPE_SCALING, vocab_size=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=False,
)
REFERENCE_KEYS = {  # SafeAILab/EAGLE eagle/model/cnets.py `Model`, SpecForge llama3_eagle.py
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
}
FC_NORM_KEYS = {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}  # vLLM / SGLang / speculators


def drafter_for(target, draft_vocab_size=200, **switches):
    drafter = make_drafter(target, eagle31=False, draft_vocab_size=draft_vocab_size,
                           rope_parameters={"rope_theta": 500000.0, **ROPE_SCALING}, **switches)
    with torch.no_grad():
        if draft_vocab_size < 256:  # a non-trivial vocabulary map
            drafter.d2t[:] = torch.arange(draft_vocab_size) % 57
            drafter.t2d.zero_()
            drafter.t2d[torch.arange(draft_vocab_size) + drafter.d2t] = True
        for norm in drafter.fc_norm or []:
            norm.weight.uniform_(0.5, 2.0)
        for name, param in drafter.named_parameters():  # norms away from 1, so a swapped norm shows
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 2.0)
    return drafter


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


@pytest.fixture(scope="module")
def plain(target):
    """An EAGLE-3 head (both switches off), for the error cases."""
    return drafter_for(target)


@pytest.fixture(params=[False, True], ids=["eagle3", "eagle3.1"])
def source(request, target):
    return drafter_for(target, fc_norm=request.param, norm_output=request.param)


def outputs(drafter, target):
    if drafter.config.target_hidden_size == drafter.config.hidden_size:
        drafter.set_target_embedding(target.get_input_embeddings())
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    features = torch.randn(1, 9, drafter.fc.in_features, generator=torch.Generator().manual_seed(1)).to(drafter.dtype)
    with torch.no_grad():
        first = drafter(ids, features)
        again = drafter(ids, first.hidden_states)  # a second step on the fed-back states: norm_output
    vocab = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size))
    return first.logits, first.hidden_states, again.logits, vocab


def assert_same_outputs(got, expected, target):
    for a, b in zip(outputs(got, target), outputs(expected, target)):
        assert torch.equal(a, b)


def reference_weights(drafter, embedding=False, rename=lambda k: k, extra=frozenset()):
    state = {k: v.contiguous() for k, v in drafter.state_dict().items()}
    assert set(state) == REFERENCE_KEYS | (FC_NORM_KEYS if drafter.config.fc_norm else set()) | extra
    if embedding:
        state["embed_tokens.weight"] = drafter.get_input_embeddings().weight.detach().clone()
    return {rename(k): v for k, v in state.items()}


def write(folder, config, state):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, folder / "model.safetensors")
    return folder


def llama_config(drafter, **extra):
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "draft_vocab_size": drafter.config.draft_vocab_size, **LLAMA_FIELDS, **extra}
    if drafter.config.fc_norm or drafter.config.norm_output:  # EAGLE 3.1, as SpecForge's eagle3.1 configs
        config.update(fc_norm=drafter.config.fc_norm, norm_output=drafter.config.norm_output)
    return config


def eagle_reference(folder, drafter):
    """SafeAILab/EAGLE: a Llama config with draft_vocab_size and target_hidden_size; no layer ids."""
    return write(folder, llama_config(drafter, target_hidden_size=64), reference_weights(drafter))


def specforge(folder, drafter, ids=None):
    """SpecForge: the reference keys plus embed_tokens; eagle_config's layer ids name layer outputs."""
    ids = [i - 1 for i in drafter.config.target_layer_ids] if ids is None else ids
    config = llama_config(drafter, eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True})
    return write(folder, config, reference_weights(drafter, embedding=True))


def model_prefixed(folder, drafter):
    """Trainers that save the engines' module names (NVIDIA-NeMo/Automodel: `model.fc_norm.0.weight`)."""
    prefixed = lambda k: k if k in ("lm_head.weight", "d2t", "t2d") else "model." + k  # noqa: E731
    return write(folder, llama_config(drafter), reference_weights(drafter, rename=prefixed))


def speculators_config(drafter, ids, **extra):
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
        "transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 1, **LLAMA_FIELDS},
        "draft_vocab_size": drafter.config.draft_vocab_size, "norm_before_fc": False,
        "eagle_aux_hidden_state_layer_ids": ids, "fc_norm": drafter.config.fc_norm,
        "norm_output": drafter.config.norm_output,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]}},
        **extra,
    }


def speculators_weights(drafter):
    layers = lambda k: "layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k  # noqa: E731
    state = reference_weights(drafter, embedding=True, rename=layers)
    state["verifier_norm.weight"] = torch.ones(64)  # training-only, in older speculators files
    return state


def speculators(folder, drafter, ids=None):
    """vllm-project/speculators: nested transformer_layer_config, layers.0.* keys, vLLM's layer ids."""
    ids = drafter.config.target_layer_ids if ids is None else ids
    config = speculators_config(drafter, ids, norm_before_residual=drafter.config.norm_before_residual)
    return write(folder, config, speculators_weights(drafter))


def to_layers0(key):
    return "layers.0." + key.removeprefix("midlayer.") if key.startswith("midlayer.") else key


def eagle_layers0(folder, drafter):
    """NeMo Automodel's vLLM export (components/speculative/serve_vllm.py): the reference config, `layers.0.*`
    keys (vLLM renames `midlayer.` to them, SGLang the other way)."""
    return write(folder, llama_config(drafter), reference_weights(drafter, embedding=True, rename=to_layers0))


def automodel_raw(folder, drafter):
    """NeMo Automodel's raw save (recipes/llm/train_eagle3.py): the target's whole config (its layer count
    included), `architectures: ["LlamaEagle3DraftModel"]`, both 3.1 flags written, keys under `model.`
    but `lm_head` and the vocabulary maps."""
    config = {**llama_config(drafter, target_hidden_size=64), "architectures": ["LlamaEagle3DraftModel"],
              "num_hidden_layers": LAYERS, "fc_norm": drafter.config.fc_norm, "norm_output": drafter.config.norm_output,
              "parallel_drafting": False, "attn_implementation": "eager"}
    prefixed = lambda k: k if k in ("lm_head.weight", "d2t", "t2d") else "model." + to_layers0(k)  # noqa: E731
    return write(folder, config, reference_weights(drafter, embedding=True, rename=prefixed))


def sglang_legacy(folder, drafter):
    """SGLang's legacy EAGLE 3.1 spelling (llama_eagle3.py `legacy_name_map`): `use_aux_norm: true`,
    `aux_norm_{low,mid,high}.weight`."""
    names = {"fc_norm.0.": "aux_norm_low.", "fc_norm.1.": "aux_norm_mid.", "fc_norm.2.": "aux_norm_high."}
    legacy = lambda k: next((new + k.removeprefix(old) for old, new in names.items() if k.startswith(old)), k)  # noqa: E731
    config = llama_config(drafter)
    if config.pop("fc_norm", False):
        config["use_aux_norm"] = True
    return write(folder, config, reference_weights(drafter, rename=legacy))


IMPLIED_LAYERS = (eagle_reference, model_prefixed, eagle_layers0, automodel_raw, sglang_legacy)


@pytest.mark.parametrize("writer", [*IMPLIED_LAYERS, specforge, speculators])
def test_every_layout_loads_to_the_same_outputs(tmp_path, target, source, writer):
    loaded = Eagle3DraftModel.from_pretrained(writer(tmp_path / writer.__name__, source))
    for switch in ("fc_norm", "norm_output", "norm_before_residual"):
        assert getattr(loaded.config, switch) == getattr(source.config, switch)
    assert loaded.config.rope_parameters == source.config.rope_parameters
    if writer in IMPLIED_LAYERS:  # not stored: the default layers of the target it serves
        assert loaded.config.target_layer_ids is None
        prepare_drafter(target, loaded)
    assert loaded.config.target_layer_ids == source.config.target_layer_ids == [2, LAYERS // 2, LAYERS - 3]
    assert_same_outputs(loaded, source, target)


@pytest.mark.parametrize("variant", ["four-layers", "norm-before-fc", "both"])
def test_sglang_spellings_of_more_layers_and_norm_before_fc(tmp_path, target, variant):
    """SGLang and vLLM size `fc` from `eagle_config`'s list and read `norm_before_fc` there too."""
    ids = [1, 2, 3, 5] if variant != "norm-before-fc" else [1, 3, 5]
    source = drafter_for(target, target_layer_ids=ids, norm_before_fc=variant != "four-layers")
    eagle_config = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True,
                    **({"norm_before_fc": True} if source.config.norm_before_fc else {})}
    state = reference_weights(source, extra={"input_norm.weight"} if source.config.norm_before_fc else set())
    loaded = Eagle3DraftModel.from_pretrained(write(tmp_path, llama_config(source, eagle_config=eagle_config), state))
    assert loaded.config.target_layer_ids == ids and loaded.config.norm_before_fc == source.config.norm_before_fc
    assert loaded.fc.in_features == 64 * len(ids)
    assert_same_outputs(loaded, source, target)


def test_speculators_norm_before_residual_and_its_vllm_default(tmp_path, target):
    source = drafter_for(target, norm_before_residual=True)
    config = speculators_config(source, source.config.target_layer_ids)  # no norm_before_residual field
    loaded = Eagle3DraftModel.from_pretrained(write(tmp_path, config, speculators_weights(source)))
    assert loaded.config.norm_before_residual  # as vLLM's speculators/algos.py reads a missing field
    assert_same_outputs(loaded, source, target)


def test_sharded_safetensors(tmp_path, target, plain):
    state = speculators_weights(plain)
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    tmp_path.mkdir(exist_ok=True)
    for name, names in shards.items():
        save_file({k: state[k] for k in names}, tmp_path / name)
    weight_map = {k: name for name, names in shards.items() for k in names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(speculators_config(plain, [2, 3, 3], norm_before_residual=False)))
    assert_same_outputs(Eagle3DraftModel.from_pretrained(tmp_path), plain, target)


def test_full_vocabulary_without_vocabulary_maps(tmp_path, target):
    source = drafter_for(target, draft_vocab_size=256)
    state = speculators_weights(source)
    del state["d2t"], state["t2d"]  # speculators leaves them out when the draft vocabulary is the full one
    config = speculators_config(source, [2, 3, 3], norm_before_residual=False)
    loaded = Eagle3DraftModel.from_pretrained(write(tmp_path, config, state))
    assert not loaded.d2t.any() and loaded.t2d.all()
    assert_same_outputs(loaded, source, target)


def engine_capture(target, layer_inputs, ids):
    """The features an engine captures: the input of each decoder layer in `layer_inputs`, by hooks on the
    real transformers layers (SGLang and vLLM keep `hidden_states + residual` entering that layer)."""
    captured, hooks = {}, []

    def keep(index):
        def hook(module, args, kwargs):
            captured[index] = args[0] if args else kwargs["hidden_states"]
        return hook

    for index in layer_inputs:
        hooks.append(target.model.layers[index].register_forward_pre_hook(keep(index), with_kwargs=True))
    with torch.no_grad():
        target(ids)
    for hook in hooks:
        hook.remove()
    return torch.cat([captured[i] for i in layer_inputs], dim=-1)


@pytest.mark.parametrize("layout", ["eagle", "specforge", "speculators"])
def test_layer_ids_are_the_features_each_engine_captures(tmp_path, target, layout):
    """SGLang captures before layer id+1 for SpecForge's ids; vLLM before layer id for a top-level list."""
    source = drafter_for(target, target_layer_ids=[1, 3, 5])
    if layout == "specforge":
        folder, engine_layers = specforge(tmp_path, source, ids=[0, 2, 4]), [1, 3, 5]
    elif layout == "speculators":
        folder, engine_layers = speculators(tmp_path, source, ids=[1, 3, 5]), [1, 3, 5]
    else:  # an EAGLE-reference config with vLLM's top-level list
        folder, engine_layers = write(tmp_path, llama_config(source, eagle_aux_hidden_state_layer_ids=[1, 3, 5]),
                                      reference_weights(source)), [1, 3, 5]
    loaded = Eagle3DraftModel.from_pretrained(folder)
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    ours = torch.cat([states[i] for i in loaded.config.target_layer_ids], dim=-1)
    assert torch.equal(ours, engine_capture(target, engine_layers, ids))


def test_eagle_reference_default_layers_are_the_reference_capture(target):
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    drafter = drafter_for(target, target_layer_ids=None, num_target_layers=None)
    prepare_drafter(target, drafter)  # modeling_llama_kv.py: idx in (2, L//2, L-3), before layer idx
    ours = torch.cat([states[i] for i in drafter.config.target_layer_ids], dim=-1)
    assert torch.equal(ours, engine_capture(target, [2, LAYERS // 2, LAYERS - 3], ids))


@pytest.mark.parametrize("layout", ["eagle", "specforge", "speculators", "hf_eagle31"])
def test_export_round_trips_losslessly(tmp_path, target, source, layout):
    source.save_pretrained(tmp_path / "ours")
    if layout == "eagle" and source.config.fc_norm:  # SafeAILab's cnets.Model would run it as EAGLE-3
        with pytest.raises(ExportError, match="fc_norm, norm_output: SafeAILab's cnets.Model has none of them"):
            convert_checkpoint(tmp_path / "ours", tmp_path / layout, layout)
        assert not (tmp_path / layout).exists()
        return
    convert_checkpoint(tmp_path / "ours", tmp_path / layout, layout, verifier="example-org/target")
    again = Eagle3DraftModel.from_pretrained(tmp_path / layout)
    assert read_checkpoint(tmp_path / layout)[2] == layout
    implied = layout == "eagle"  # the reference layout stores no layers: the default ones of the target
    assert again.config.target_layer_ids == (None if implied else source.config.target_layer_ids)
    assert_same_outputs(again, source, target)
    if layout != "hf_eagle31":  # the 3.1 keys only where on: SpecForge before PR 879 misreads norm_output: false
        config = json.loads((tmp_path / layout / "config.json").read_text())
        on = {"fc_norm": True, "norm_output": True} if source.config.fc_norm else {}
        assert {k: config[k] for k in ("fc_norm", "norm_output", "norm_before_fc") if k in config} == on


@pytest.mark.parametrize("layout", ["specforge", "speculators"])
def test_export_keeps_custom_layer_ids_for_every_engine(tmp_path, target, layout):
    source = drafter_for(target, target_layer_ids=[0, 3, 6])  # the embedding output and the last layer too
    config = json.loads((save_in_layout(source, tmp_path, layout, "example-org/target") / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 3, 6]  # vLLM's reading
    if layout == "specforge":
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 2, 5]  # SGLang's (+1)
    assert Eagle3DraftModel.from_pretrained(tmp_path).config.target_layer_ids == [0, 3, 6]
    with pytest.raises(ExportError, match=r"target_layer_ids \[0, 3, 6\]: the EAGLE reference cannot record them"):
        save_in_layout(source, tmp_path / "eagle", "eagle")


def test_bfloat16_loads_like_transformers_loads_our_own_layout(tmp_path, target):
    """dtype goes through transformers for every layout: weights cast, rope frequencies kept in float32."""
    source = drafter_for(target, fc_norm=True, norm_output=True)
    source.save_pretrained(tmp_path / "ours")
    reference = Eagle3DraftModel.from_pretrained(tmp_path / "ours", dtype=torch.bfloat16)
    for layout in ("specforge", "speculators"):  # the EAGLE reference has no 3.1 switch
        save_in_layout(source, tmp_path / layout, layout, "example-org/target")
        loaded = Eagle3DraftModel.from_pretrained(tmp_path / layout, dtype=torch.bfloat16)
        assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.rotary_emb.inv_freq.dtype == torch.float32
        assert_same_outputs(loaded, reference, target)


def test_own_layout_round_trips_bit_exactly_through_auto_model(tmp_path, source):
    source.generation_config.num_assistant_tokens = 7
    source.save_pretrained(tmp_path)
    assert detect_layout(json.loads((tmp_path / "config.json").read_text())) == "hf_eagle31"
    loaded = transformers.AutoModel.from_pretrained(tmp_path)
    assert type(loaded) is Eagle3DraftModel and loaded.generation_config.num_assistant_tokens == 7
    assert loaded.state_dict().keys() == source.state_dict().keys()
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in source.state_dict().items())


def test_local_folders_come_before_the_hub(tmp_path, monkeypatch, target, plain):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("went to the Hub"))
    eagle_reference(tmp_path / "org" / "head", plain)
    monkeypatch.chdir(tmp_path)
    assert_same_outputs(Eagle3DraftModel.from_pretrained("org/head"), plain, target)


@pytest.mark.parametrize("config, keys, layout", [
    ({"model_type": "eagle3_drafter"}, set(), "hf_eagle31"),
    ({"architectures": ["LlamaForCausalLMEagle3"], "fc_norm": True, "norm_output": True}, set(), "eagle"),
    ({"model_type": "llama"}, {"midlayer.hidden_norm.weight"}, "eagle"),
    ({"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {}}, set(), "specforge"),
    ({"speculators_model_type": "eagle3", "fc_norm": True}, set(), "speculators"),
])
def test_detect_layout(config, keys, layout):
    assert detect_layout(config, keys) == layout


def test_cli_converts(tmp_path, plain, capsys):
    eagle_reference(tmp_path / "ref", plain)
    out = ["convert", str(tmp_path / "ref"), str(tmp_path / "out"), "--layout", "speculators"]
    assert cli(out) == 2  # the reference records no target, and speculators must name one
    assert "must name the verifier" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert cli([*out, "--verifier", "example-org/target"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == "example-org/target"
    assert cli(["convert", str(tmp_path / "missing"), str(tmp_path / "x")]) == 2
    assert f"no such folder: {tmp_path / 'missing'}" in capsys.readouterr().err  # one line, no trace


def test_missing_files_get_named_errors(tmp_path, plain):
    with pytest.raises(MissingCheckpointError, match="neither a checkpoint folder nor a Hub"):
        Eagle3DraftModel.from_pretrained(tmp_path / "nothing" / "here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingCheckpointError, match="no config.json"):
        Eagle3DraftModel.from_pretrained(tmp_path / "empty")
    folder = eagle_reference(tmp_path / "noweights", plain)
    (folder / "model.safetensors").unlink()
    with pytest.raises(MissingCheckpointError, match="no weights"):
        Eagle3DraftModel.from_pretrained(folder)
    plain.save_pretrained(tmp_path / "ours")
    (tmp_path / "ours" / "model.safetensors").unlink()
    with pytest.raises(MissingCheckpointError, match="weights are missing"):
        Eagle3DraftModel.from_pretrained(tmp_path / "ours")
    economize = tmp_path / "economize"  # economize's own format: economize_config.json, economize_model.safetensors
    economize.mkdir()
    (economize / "economize_config.json").write_text(json.dumps({"techniques": [{"technique": "eagle3"}]}))
    with pytest.raises(CheckpointError, match="an economize checkpoint .* cannot be read on its own"):
        Eagle3DraftModel.from_pretrained(economize)


def test_pickles_need_an_explicit_opt_in(tmp_path, target, plain):
    (tmp_path / "config.json").write_text(json.dumps(llama_config(plain, target_hidden_size=64)))
    torch.save(reference_weights(plain), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="allow_pickle=True"):
        Eagle3DraftModel.from_pretrained(tmp_path)
    assert_same_outputs(Eagle3DraftModel.from_pretrained(tmp_path, allow_pickle=True), plain, target)


def broken(drafter, change):
    """An EAGLE-reference checkpoint of `drafter` with one thing wrong: change(config, state)."""
    config, state = llama_config(drafter, target_hidden_size=64), reference_weights(drafter)
    change(config, state)
    return config, state


@pytest.mark.parametrize("change, error", [
    (lambda c, s: c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2") or s.pop("midlayer.hidden_norm.weight"),
     "unknown checkpoint layout: looked for model_type 'eagle3_drafter'.*speculators_model_type 'eagle3'.*"
     "LlamaForCausalLMEagle3.*found model_type 'gpt2'"),
    (lambda c, s: c.update(speculators_model_type="mlp"), "'mlp' is not EAGLE-3"),
    (lambda c, s: s.pop("midlayer.mlp.up_proj.weight"), r"missing weights \['midlayer.mlp.up_proj.weight'\]"),
    (lambda c, s: s.update({f"fc_norm.{i}.weight": torch.ones(64) for i in range(3)}),
     r"unexpected weights \['fc_norm.0.weight'.*fc_norm: true"),
    (lambda c, s: s.update({"fc.weight": torch.randn(64, 96)}),
     r"fc.weight has shape \(64, 96\) but the config implies \(64, 192\): fc reads 3 captured layers .* x "
     "target_hidden_size 64"),
    (lambda c, s: c.update(target_hidden_size=32), r"fc.weight has shape \(64, 192\) but the config implies \(64, 96\)"),
    (lambda c, s: c.update(hidden_size=32, head_dim=8), r"has shape .* but the config implies"),
    (lambda c, s: c.update(draft_vocab_size=100), r"lm_head.weight has shape \(200, 64\) but the config implies \(100, 64\)"),
    (lambda c, s: c.update(vocab_size=300), r"t2d has shape \(256,\) but the config implies \(300,\)"),
    (lambda c, s: c.update(norm_before_fc=True), r"missing weights \['input_norm.weight'\].*norm_before_fc: true"),
    (lambda c, s: s.update({"input_norm.weight": torch.ones(192)}), r"unexpected weights \['input_norm.weight'\]"),
    (lambda c, s: c.update(norm_before_fc=True, fc_norm=True), "exclude each other"),
    (lambda c, s: s.update({"layers.1.hidden_norm.weight": torch.ones(64)}), r"decoder layers \['1'\] beyond the first"),
    (lambda c, s: c.update(eagle_config={"use_aux_hidden_state": False}), "EAGLE-2 head"),
    (lambda c, s: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]}),
     r"fc.weight has shape \(64, 192\) but the config implies \(64, 256\): fc reads 4 captured layers"),
    (lambda c, s: c.update(num_aux_hidden_states=4), "num_aux_hidden_states is 4 but the config lists captured layers None"),
    (lambda c, s: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [-2, 2, 3]}), "out of range"),
    (lambda c, s: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
                           eagle_aux_hidden_state_layer_ids=[1, 2, 3]), "captured layers disagree"),
], ids=["unknown", "speculators-type", "missing", "unexpected", "fc-width", "target-hidden-size", "hidden-size",
        "draft-vocab", "vocab", "norm-before-fc-without-weight", "input-norm-without-flag", "two-input-norms",
        "second-layer", "eagle2", "four-layers-three-wide", "layer-count", "negative-layer", "layer-conventions"])
def test_bad_checkpoints_get_named_errors(tmp_path, plain, change, error):
    with pytest.raises(CheckpointError, match=error):
        Eagle3DraftModel.from_pretrained(write(tmp_path, *broken(plain, change)))


def test_layers_beyond_the_target_are_refused_when_attached(tmp_path, target, plain):
    config, state = broken(plain, lambda c, s: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 40]}))
    deep = Eagle3DraftModel.from_pretrained(write(tmp_path, config, state))  # right for a deeper target
    assert deep.config.target_layer_ids == [2, 4, 41]
    with pytest.raises(ValueError, match="out of range for the target"):
        prepare_drafter(target, deep)


def test_convert_rejects_an_unknown_layout(tmp_path, plain):
    with pytest.raises(ValueError, match="unknown layout 'vllm'"):
        convert_checkpoint(eagle_reference(tmp_path / "ref", plain), tmp_path / "out", "vllm")


# --- exports as the engines read them (engine_rules.py: vLLM 0.33, SGLang 0.5.23, SafeAILab cb7e084) -------

EXPORTED = {  # the heads the exports are checked with: every variant an engine reads differently
    "eagle3": {},
    "eagle3-full-vocabulary": {"draft_vocab_size": 256},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
    "eagle3.1-four-layers": {"fc_norm": True, "norm_output": True, "target_layer_ids": [1, 2, 3, 5]},
    "norm-before-fc": {"norm_before_fc": True},
    "norm-before-residual": {"norm_before_residual": True},
    "two-decoder-layers": {"fc_norm": True, "norm_output": True, "num_hidden_layers": 2},
}
REFUSED = {  # layout -> variants its readers would run differently (conversion.layouts.unrepresentable)
    "eagle": {"eagle3.1", "eagle3.1-four-layers", "norm-before-fc", "norm-before-residual", "two-decoder-layers"},
    "specforge": {"norm-before-residual", "two-decoder-layers"},
    "speculators": {"two-decoder-layers"},
}


@pytest.mark.parametrize("variant", EXPORTED)
@pytest.mark.parametrize("layout", REFUSED)
def test_exports_are_what_the_engines_read(tmp_path, target, variant, layout):
    source = drafter_for(target, **EXPORTED[variant])
    if variant in REFUSED[layout]:
        with pytest.raises(ExportError, match=f"the {layout} layout cannot carry this head"):
            save_in_layout(source, tmp_path, layout, "example-org/target")
        return
    folder = save_in_layout(source, tmp_path, layout, "example-org/target")
    config = source.config
    vllm = vllm_reads(folder, target_vocab=256)  # vLLM serves all three layouts
    assert vllm["refused"] == set() and vllm["unfilled"] <= {"model.embed_tokens.weight"}
    assert vllm["fc_inputs"] == source.fc.in_features
    for switch in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert vllm[switch] == getattr(config, switch)
    if layout != "speculators":  # SGLang serves LlamaForCausalLMEagle3 configs
        sglang = sglang_reads(folder)
        assert sglang["serves"] and sglang["dropped"] == set() and sglang["unfilled"] <= {"model.embed_tokens.weight"}
        assert sglang["fc_inputs"] == source.fc.in_features and not config.norm_before_residual
        assert all(sglang[switch] == getattr(config, switch) for switch in ("fc_norm", "norm_before_fc", "norm_output"))
    if layout == "eagle":
        safeailab = safeailab_reads(folder)
        assert safeailab["embedding"] == "target" and safeailab["dropped"] == safeailab["unfilled"] == set()
        assert safeailab["fc_inputs"] == source.fc.in_features
    again = Eagle3DraftModel.from_pretrained(folder)
    if layout == "eagle":
        prepare_drafter(target, again)
    assert_same_outputs(again, source, target)


def test_full_vocabulary_exports_leave_the_vocabulary_maps_out(tmp_path, target):
    """vLLM builds no draft_id_to_target_id for a full draft vocabulary and refuses a d2t (issue 16, point 1)."""
    source = drafter_for(target, draft_vocab_size=256)
    for layout in ("eagle", "specforge", "speculators"):
        save_in_layout(source, tmp_path / layout, layout, "example-org/target")
        assert not {"d2t", "t2d"} & read_folder(tmp_path / layout)[1]
        assert vllm_reads(tmp_path / layout, target_vocab=256)["refused"] == set()
    reduced = drafter_for(target)  # and a reduced one keeps them, which vLLM then requires
    save_in_layout(reduced, tmp_path / "reduced", "specforge")
    assert {"d2t", "t2d"} <= read_folder(tmp_path / "reduced")[1]
    with torch.no_grad():
        source.d2t[5] = 1  # a full vocabulary that is not the identity: no engine reads it so
    with pytest.raises(ExportError, match="full one, yet d2t/t2d map it"):
        save_in_layout(source, tmp_path / "odd", "specforge")


# --- speculators exports name the verifier (issue 16, point 2) -----------------------------------------------


def verifier_of(folder):
    return json.loads((folder / "config.json").read_text())["speculators_config"]["verifier"]


def test_speculators_export_names_the_verifier(tmp_path, target, plain):
    with pytest.raises(ExportError, match="must name the verifier"):  # nothing recorded, nothing given
        save_in_layout(plain, tmp_path / "none", "speculators")
    target.save_pretrained(tmp_path / "target")  # a local target: refused unless insisted on, its architectures read
    with pytest.raises(ExportError, match="must be a Hub id.*local_verifier=True"):
        save_in_layout(plain, tmp_path / "given", "speculators", str(tmp_path / "target"))
    save_in_layout(plain, tmp_path / "given", "speculators", str(tmp_path / "target"), local_verifier=True)
    assert verifier_of(tmp_path / "given") == {"name_or_path": str(tmp_path / "target"),
                                                "architectures": ["LlamaForCausalLM"]}
    config = speculators_config(plain, plain.config.target_layer_ids, norm_before_residual=False)
    config["speculators_config"]["verifier"]["name_or_path"] = "example-org/recorded"
    write(tmp_path / "spec", config, speculators_weights(plain))  # recorded by speculators, kept through our layout
    convert_checkpoint(tmp_path / "spec", tmp_path / "ours", "hf_eagle31")
    convert_checkpoint(tmp_path / "ours", tmp_path / "again", "speculators")
    assert verifier_of(tmp_path / "again")["name_or_path"] == "example-org/recorded"
    eagle_reference(tmp_path / "carded", plain)  # a Hub head's model card names its target as base_model
    (tmp_path / "carded" / "README.md").write_text("---\nbase_model: example-org/from-card\n---\n# head\n")
    convert_checkpoint(tmp_path / "carded", tmp_path / "from-card", "speculators")
    assert verifier_of(tmp_path / "from-card")["name_or_path"] == "example-org/from-card"


# --- the EAGLE reference reads the target's embedding only without target_hidden_size (issue 16, point 3) ------


def test_eagle_export_gives_safeailab_an_embedding(tmp_path, target, plain):
    config = json.loads((save_in_layout(plain, tmp_path / "same", "eagle") / "config.json").read_text())
    assert "target_hidden_size" not in config and safeailab_reads(tmp_path / "same")["embedding"] == "target"
    torch.manual_seed(3)  # a drafter narrower than its target: SafeAILab then needs the embedding in the file
    narrow = Eagle3DraftModel(Eagle3Config.from_dict(
        {**plain.config.to_dict(), "target_hidden_size": 96, "include_embedding": True})).eval()
    folder = save_in_layout(narrow, tmp_path / "narrow", "eagle")
    assert json.loads((folder / "config.json").read_text())["target_hidden_size"] == 96
    assert safeailab_reads(folder)["embedding"] == "checkpoint"
    assert_same_outputs(Eagle3DraftModel.from_pretrained(folder), narrow, target)
    narrow.embed_tokens, narrow.config.include_embedding = None, False
    with pytest.raises(ExportError, match="needs embed_tokens.weight in the checkpoint"):
        save_in_layout(narrow, tmp_path / "no-embedding", "eagle")


# --- the README's loading line on every layout (issue 16, point 6) -------------------------------------------


@pytest.mark.parametrize("writer", [eagle_reference, specforge, speculators, automodel_raw, eagle_layers0, "ours"])
def test_auto_model_loads_every_layout_for_generate(tmp_path, writer):
    target, drafter = trained_pair("llama", eagle31=True, speculation_mode="chain", dynamic_speculation=False)
    folder = tmp_path / "head"
    drafter.save_pretrained(folder) if writer == "ours" else writer(folder, drafter)
    loaded = transformers.AutoModel.from_pretrained(folder)
    assert type(loaded) is Eagle3DraftModel
    prompt = PROMPTS[:1]
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
    got = target.generate(prompt, assistant_model=loaded, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected) and loaded.speculation_stats.tau > 1.5


def test_a_head_loaded_the_wrong_way_names_eagle_and_the_right_call(tmp_path, target, plain):
    eagle_reference(tmp_path / "head", plain)
    with pytest.raises(CheckpointError, match=r"EAGLE-3 drafter head .*AutoModel.from_pretrained"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "head")
    folder = tmp_path / "target"
    target.save_pretrained(folder)  # every other model is transformers' business, as before
    assert type(transformers.AutoModel.from_pretrained(folder, **LOAD_KWARGS)) is transformers.LlamaModel
    assert type(transformers.AutoModelForCausalLM.from_pretrained(folder, **LOAD_KWARGS)) is transformers.LlamaForCausalLM


# --- SafeAILab's tree settings keep their meaning (issue 16, point 8) ----------------------------------------


def test_safeailab_tree_settings_keep_their_meaning(tmp_path, target, plain):
    """SafeAILab/EAGLE cnets.py (cb7e084): `self.total_tokens = total_tokens - 1` draft tokens are kept
    (`topk(scores_list, total_tokens)`) and the root is prepended; `topK_genrate` expands once, then
    `for i in range(depth)`. So `total_token` counts the root and there are `depth + 1` draft levels."""
    eagle_reference(tmp_path, plain)
    drafter = Eagle3DraftModel.from_pretrained(tmp_path, total_token=60, depth=7, top_k=10)
    settings = drafter.generation_config
    assert (settings.speculation_mode, settings.tree_total_tokens, settings.tree_depth, settings.tree_top_k) == (
        "tree", 59, 8, 10)
    chain = safeailab_tree_settings(total_token=9, depth=7, top_k=1)  # SafeAILab: 8 levels of 1, with the root 9
    prepare_drafter(target, drafter)
    state, ids = DrafterState(drafter), PROMPTS[:1]
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    state.push(torch.cat([states[i] for i in drafter.config.target_layer_ids], dim=-1)[:, :-1], ids[:, 1:])
    (tree,) = draft_tree(state, ids[0, -1:], chain["tree_depth"], chain["tree_top_k"], chain["tree_total_tokens"])
    assert len(tree) == 9 and tree.depth == 8
    with pytest.raises(ValueError, match="SafeAILab's -1"):
        safeailab_tree_settings(total_token=-1)
