"""Heads saved by speculators' and SpecForge's own code load to the logits their own code computes.

`tests/fixtures/layouts/` holds small random heads written by speculators 0.9.0 and SpecForge 0.2.0
(`regenerate.py` there wrote them, with those projects installed) and, beside each, the inputs and two
draft steps of logits that the project's own forward computed. Here each head is loaded the README's
way, `AutoModel.from_pretrained`, and run for the same two steps: the first step from the captured
features, the second from the first step's fed-back states, one position further, attending to the
first step's keys up to its own position and to itself (the training-time-test pattern both projects
unroll, expressed with this project's tail mask).
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModel, DynamicCache

from hf_eagle31 import Eagle3DraftModel
from hf_eagle31.conversion.layouts import LAYOUTS, ExportError, read_checkpoint, save_in_layout

FIXTURES = Path(__file__).parent / "fixtures" / "layouts"
TOLERANCE = 1e-5


def two_steps(drafter: Eagle3DraftModel, reference: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    n = reference["input_ids"].shape[1]
    cache, positions = DynamicCache(), reference["position_ids"]
    tail = torch.cat([torch.ones(n, n, dtype=torch.bool).tril(), torch.eye(n, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        first = drafter(reference["input_ids"], reference["features"], position_ids=positions, cache=cache)
        second = drafter(reference["next_ids"], first.hidden_states, position_ids=positions + 1,
                         cache=cache, tail_mask=tail)
    return first.logits, second.logits


def reference_of(name: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / f"{name}.reference.safetensors")


def load(folder: Path, reference: dict[str, torch.Tensor]) -> Eagle3DraftModel:
    """The README's way; a head saved without an embedding (as SpecForge's trainer saves) gets the target's."""
    drafter = AutoModel.from_pretrained(folder)
    assert isinstance(drafter, Eagle3DraftModel)
    if "embedding" in reference:
        drafter.set_target_embedding(nn.Embedding.from_pretrained(reference["embedding"]))
    return drafter


def assert_matches(drafter: Eagle3DraftModel, reference: dict[str, torch.Tensor]) -> None:
    for got, expected in zip(two_steps(drafter, reference), (reference["logits_step1"], reference["logits_step2"])):
        assert_close(got, expected)


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert (got - expected).abs().max() < TOLERANCE


def test_speculators_eagle31_head_matches_speculators():
    """fc_norm, norm_output, norm_before_residual, a reduced vocabulary, layers [1, 3, 4], llama3 rope."""
    reference = reference_of("speculators-eagle3.1")
    drafter = load(FIXTURES / "speculators-eagle3.1", reference)
    config = drafter.config
    assert (config.fc_norm, config.norm_output, config.norm_before_residual) == (True, True, True)
    assert config.target_layer_ids == [1, 3, 4] and config.draft_vocab_size == 96
    assert config.verifier_name_or_path == "example-org/tiny-llama-target"
    assert_matches(drafter, reference)


def test_speculators_norm_before_fc_head_with_four_layers_matches_speculators():
    """One RMSNorm over four captured layers (input_norm), a full vocabulary saved without d2t/t2d."""
    reference = reference_of("speculators-norm-before-fc")
    drafter = load(FIXTURES / "speculators-norm-before-fc", reference)
    assert drafter.config.norm_before_fc and drafter.config.target_layer_ids == [1, 2, 3, 4]
    assert drafter.fc.in_features == 4 * 32 and not drafter.d2t.any() and drafter.t2d.all()
    assert_matches(drafter, reference)


def test_specforge_before_pr_879_reads_as_documented():
    """SpecForge <= 0.2.0 meant `norm_output: true` as "norm before lm_head", feeding back the pre-norm state.

    Read as the engines read it today (SGLang, SpecForge after PR 879: the post-norm state is fed back),
    the first step matches and the second does not; with `config.norm_output = False` (the README's
    advice for such heads) both match SpecForge 0.2.0's own outputs.
    """
    reference = reference_of("specforge-0.2.0-eagle3.1")
    drafter = load(FIXTURES / "specforge-0.2.0-eagle3.1", reference)
    assert read_checkpoint(FIXTURES / "specforge-0.2.0-eagle3.1")[2] == "specforge"
    assert drafter.config.fc_norm and drafter.config.norm_output and drafter.config.target_layer_ids == [1, 3, 4]
    first, second = two_steps(drafter, reference)
    assert_close(first, reference["logits_step1"])
    assert (second - reference["logits_step2"]).abs().max() > 100 * TOLERANCE
    drafter.config.norm_output = False
    assert_matches(drafter, reference)


@pytest.mark.parametrize("name, carried", [
    ("speculators-eagle3.1", {"hf_eagle31", "speculators"}),  # norm_before_residual: SGLang has none
    ("speculators-norm-before-fc", {"hf_eagle31", "specforge", "speculators"}),  # SafeAILab: neither the norm nor 4 layers
    ("specforge-0.2.0-eagle3.1", {"hf_eagle31", "specforge", "speculators"}),  # SafeAILab: no 3.1 switch
])
def test_peer_heads_survive_every_export_that_carries_them(tmp_path, name, carried):
    """Re-exported to each layout that can carry it (the others refuse it by name), a peer head keeps its logits."""
    reference = reference_of(name)
    drafter = load(FIXTURES / name, reference)
    expected = two_steps(drafter, reference)
    written = set()
    for layout in LAYOUTS:
        try:
            save_in_layout(drafter, tmp_path / layout, layout, verifier="example-org/tiny-llama-target")
        except ExportError:
            continue
        written.add(layout)
        for got, want in zip(two_steps(load(tmp_path / layout, reference), reference), expected):
            assert torch.equal(got, want)
    assert written == carried
