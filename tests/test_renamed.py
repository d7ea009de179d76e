"""Renamed names keep working for one release, with a FutureWarning naming the new one: the setting `pack_weights`
(now `cpu_backend`) wherever a setting is read, tuning reports saved with it, and `hf_eagle31.packed_weights` (now
`hf_eagle31.hold_products`). Both names of one setting at once is an error."""

import json

import pytest
import torch
from tiny_models import PROMPTS, trained_pair

import hf_eagle31
from hf_eagle31 import Eagle3DraftModel, generation
from hf_eagle31.backends.cpu import products as cpu_products
from hf_eagle31.tuning import apply_choice, report_cpu_backend

NEW = 12


@pytest.fixture
def backends(monkeypatch):
    """The `cpu_backend` each call asks `backend_for` for."""
    asked, backend_for = [], generation.backend_for
    monkeypatch.setattr(generation, "backend_for", lambda target, cpu_backend: asked.append(cpu_backend) or
                        backend_for(target, cpu_backend))
    return asked


def test_pack_weights_set_on_the_generation_config_is_cpu_backend_with_a_warning(backends):
    target, drafter = trained_pair("llama", True)
    expected = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=NEW)
    drafter.generation_config.pack_weights = False  # a loaded drafter's config holds cpu_backend=True as well
    with pytest.warns(FutureWarning, match="pack_weights .* is now called cpu_backend.*hf_eagle31 0.2"):
        old = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=NEW, assistant_model=drafter)
    assert backends == [False] and drafter.generation_config.cpu_backend is False
    assert "pack_weights" not in vars(drafter.generation_config)  # moved: a save writes the new name
    drafter.generation_config.cpu_backend = False
    new = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=NEW, assistant_model=drafter)
    assert torch.equal(old, expected) and torch.equal(new, expected) and backends == [False, False]


def test_pack_weights_given_to_from_pretrained_or_saved_loads_as_cpu_backend(tmp_path):
    _, drafter = trained_pair("llama", True)
    drafter.save_pretrained(tmp_path)
    with pytest.warns(FutureWarning, match="pack_weights .*from_pretrained.* is now called cpu_backend"):
        loaded = Eagle3DraftModel.from_pretrained(tmp_path, pack_weights=False)
    assert loaded.generation_config.cpu_backend is False and "pack_weights" not in vars(loaded.generation_config)
    file = tmp_path / "generation_config.json"
    saved = json.loads(file.read_text())
    saved.pop("cpu_backend", None)
    file.write_text(json.dumps({**saved, "pack_weights": False}))  # as saved before the rename
    with pytest.warns(FutureWarning, match="generation_config.json.* is now called cpu_backend"):
        loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    assert loaded.generation_config.cpu_backend is False
    assert Eagle3DraftModel.from_pretrained(tmp_path, cpu_backend=True).generation_config.cpu_backend is True


def test_both_names_of_one_setting_are_an_error(tmp_path):
    _, drafter = trained_pair("llama", True)
    drafter.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="both pack_weights=False and cpu_backend=True: pack_weights is the old name"):
        Eagle3DraftModel.from_pretrained(tmp_path, pack_weights=False, cpu_backend=True)
    file = tmp_path / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "pack_weights": False, "cpu_backend": True}))
    with pytest.raises(ValueError, match="generation_config.json gives both pack_weights"):
        Eagle3DraftModel.from_pretrained(tmp_path)


def test_pack_weights_given_to_generate_names_the_new_setting():
    target, drafter = trained_pair("llama", True)
    with pytest.raises(ValueError, match=r"set drafter.generation_config.cpu_backend = False \(pack_weights is the "
                                         r"old name of cpu_backend\)"):
        target.generate(PROMPTS[:1], max_new_tokens=5, assistant_model=drafter, pack_weights=False)


def test_a_tuning_report_saved_with_pack_weights_still_applies():
    _, drafter = trained_pair("llama", True)
    chain = {"tree_top_k": 1, "tree_depth": 3, "tree_total_tokens": 3, "speedup": 1.5}
    report = {"candidates": [chain], "choice": chain, "best_chain": chain, "best_tree": {}, "pack_weights": False}
    assert report_cpu_backend(report) is False and report_cpu_backend({}) is None
    apply_choice(drafter, report)
    assert drafter.generation_config.cpu_backend is False


def test_packed_weights_is_hold_products_with_a_warning():
    target, drafter = trained_pair("llama", True)
    if not cpu_products.can_pack(target):
        pytest.skip("no products to hold for this target here")
    expected = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=NEW)
    with pytest.warns(FutureWarning, match="packed_weights is now called hf_eagle31.hold_products"):
        block = hf_eagle31.packed_weights(target)
    with block:
        held = cpu_products._held(target)
        assert held is not None
        out = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=NEW, assistant_model=drafter)
        assert cpu_products._held(target) is held  # the call used the block's products, as in hold_products
    assert cpu_products._held(target) is None and torch.equal(out, expected)
