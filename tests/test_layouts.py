"""Every EAGLE checkpoint layout loads with `from_pretrained`, to the same module outputs.

The foreign checkpoints are written here by hand, in the real key names and config shapes of each
project (see the header of conversion/layouts.py), not by our own exporter, so the reader is
checked against the layouts themselves; the exporter is then checked by round trips.
"""

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file
from tiny_models import LAYERS, make_drafter, make_target

from hf_eagle31 import Eagle3DraftModel
from hf_eagle31.cli import main as cli
from hf_eagle31.conversion.convert import convert_checkpoint
from hf_eagle31.conversion.layouts import CheckpointError
from hf_eagle31.generation import prepare_drafter

LLAMA_FIELDS = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=256,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
)


@pytest.fixture(params=[(False, False), (True, True)], ids=["eagle3", "eagle3.1"])
def source(request):
    fc_norm, norm_output = request.param
    target = make_target("llama")
    drafter = make_drafter(target, eagle31=False, fc_norm=fc_norm, norm_output=norm_output, draft_vocab_size=200)
    with torch.no_grad():
        drafter.d2t[:] = torch.arange(200) % 57  # a non-trivial vocabulary map
        drafter.t2d.zero_()
        drafter.t2d[torch.arange(200) + drafter.d2t] = True
        for norm in drafter.fc_norm or []:
            norm.weight.uniform_(0.5, 2.0)
    return target, drafter


def outputs(drafter, target):
    drafter.set_target_embedding(target.get_input_embeddings())
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    features = torch.randn(1, 9, 192, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = drafter(ids, features)
    return out.logits, out.hidden_states, drafter.draft_to_target(torch.arange(200))


def reference_weights(drafter, include_embedding=False, rename=lambda k: k):
    state = {rename(k): v.contiguous() for k, v in drafter.state_dict().items()}
    if include_embedding:
        state["embed_tokens.weight"] = drafter.get_input_embeddings().weight.detach().clone()
    return state


def write(folder, config, state):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, folder / "model.safetensors")
    return folder


def eagle_reference(folder, drafter):
    """SafeAILab/EAGLE: a Llama config with draft_vocab_size; midlayer.* keys; default layers only."""
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "draft_vocab_size": 200, "target_hidden_size": 64, **LLAMA_FIELDS}
    if drafter.config.fc_norm:
        config.update(fc_norm=True, norm_output=drafter.config.norm_output)
    return write(folder, config, reference_weights(drafter))


def specforge(folder, drafter):
    """SpecForge: the reference keys plus embed_tokens, and eagle_config's layer ids naming layer outputs."""
    ids = [i - 1 for i in drafter.config.target_layer_ids]
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "draft_vocab_size": 200, **LLAMA_FIELDS,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
              "fc_norm": drafter.config.fc_norm, "norm_output": drafter.config.norm_output}
    return write(folder, config, reference_weights(drafter, include_embedding=True))


def speculators(folder, drafter):
    """vllm-project/speculators: nested transformer_layer_config, layers.0.* keys, verifier_* extras."""
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
        "transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 1, **LLAMA_FIELDS},
        "draft_vocab_size": 200, "norm_before_residual": False, "norm_before_fc": False,
        "eagle_aux_hidden_state_layer_ids": drafter.config.target_layer_ids,
        "fc_norm": drafter.config.fc_norm, "norm_output": drafter.config.norm_output,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]}},
    }
    state = reference_weights(drafter, include_embedding=True,
                              rename=lambda k: "layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k)
    state["verifier_norm.weight"] = torch.ones(64)
    return write(folder, config, state)


@pytest.mark.parametrize("writer", [eagle_reference, specforge, speculators])
def test_every_layout_loads_to_the_same_outputs(tmp_path, source, writer):
    target, drafter = source
    folder = writer(tmp_path / writer.__name__, drafter)
    loaded = Eagle3DraftModel.from_pretrained(folder)
    assert loaded.config.fc_norm == drafter.config.fc_norm and loaded.config.norm_output == drafter.config.norm_output
    if writer is eagle_reference:  # not stored: the default layers of whichever target it is attached to
        assert loaded.config.target_layer_ids is None
        prepare_drafter(target, loaded)
    assert loaded.config.target_layer_ids == drafter.config.target_layer_ids == [2, LAYERS // 2, LAYERS - 3]
    for got, expected in zip(outputs(loaded, target), outputs(drafter, target)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("layout", ["eagle", "specforge", "speculators", "hf_eagle31"])
def test_export_round_trips_losslessly(tmp_path, source, layout):
    target, drafter = source
    drafter.save_pretrained(tmp_path / "ours")
    convert_checkpoint(tmp_path / "ours", tmp_path / layout, layout)
    again = Eagle3DraftModel.from_pretrained(tmp_path / layout)
    for got, expected in zip(outputs(again, target), outputs(drafter, target)):
        assert torch.equal(got, expected)
    if layout != "hf_eagle31":
        config = json.loads((tmp_path / layout / "config.json").read_text())
        assert config.get("fc_norm") == drafter.config.fc_norm  # the 3.1 flags travel with the export


def test_own_layout_round_trips_bit_exactly_through_auto_model(tmp_path, source):
    _, drafter = source
    drafter.save_pretrained(tmp_path)
    loaded = transformers.AutoModel.from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), loaded.state_dict().values()))


def test_cli_converts(tmp_path, source):
    target, drafter = source
    eagle_reference(tmp_path / "ref", drafter)
    assert cli(["convert", str(tmp_path / "ref"), str(tmp_path / "out"), "--layout", "speculators"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["speculators_model_type"] == "eagle3"
    assert cli(["convert", str(tmp_path / "missing"), str(tmp_path / "x")]) == 2  # a clear one-line error


def test_bad_checkpoints_get_named_errors(tmp_path, source):
    target, drafter = source
    with pytest.raises(FileNotFoundError, match="neither a checkpoint folder nor a Hub"):
        Eagle3DraftModel.from_pretrained(tmp_path / "nothing" / "here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Eagle3DraftModel.from_pretrained(tmp_path / "empty")
    folder = eagle_reference(tmp_path / "noweights", drafter)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        Eagle3DraftModel.from_pretrained(folder)
    unknown = write(tmp_path / "unknown", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, {"x": torch.ones(1)})
    with pytest.raises(CheckpointError, match="unknown checkpoint layout"):
        Eagle3DraftModel.from_pretrained(unknown)
    state = reference_weights(drafter)
    state["fc.weight"] = torch.randn(64, 3 * 32)  # features of a 32-wide target
    config = json.loads((eagle_reference(tmp_path / "ok", drafter) / "config.json").read_text())
    with pytest.raises(CheckpointError, match="fc.weight has shape"):  # config says 64-wide features
        Eagle3DraftModel.from_pretrained(write(tmp_path / "shapes", config, state))
    state = reference_weights(drafter)
    del state["midlayer.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match="missing weights.*up_proj"):
        Eagle3DraftModel.from_pretrained(write(tmp_path / "partial", config, state))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(config))
    torch.save(reference_weights(drafter), pickled / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="allow_pickle=True"):
        Eagle3DraftModel.from_pretrained(pickled)
    assert Eagle3DraftModel.from_pretrained(pickled, allow_pickle=True).config.draft_vocab_size == 200
    ours = tmp_path / "ours"
    drafter.save_pretrained(ours)
    (ours / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="weights are missing"):
        Eagle3DraftModel.from_pretrained(ours)
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 40]}  # for a deeper target
    deep = Eagle3DraftModel.from_pretrained(write(tmp_path / "ids", config, reference_weights(drafter)))
    with pytest.raises(ValueError, match="out of range for the target"):
        prepare_drafter(target, deep)
