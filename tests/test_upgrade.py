"""EAGLE-3 -> 3.1 upgrade: calibrated fc_norm keeps fc's input, and the fine-tuned upgrade beats the original."""

import json

import pytest
import torch
from huggingface_hub import ModelCard
from tiny_models import make_drafter, make_target

from hf_eagle31 import Eagle3DraftModel
from hf_eagle31.training.upgrade import fc_norm_weights, switch_on_eagle31, upgrade_drafter
from hf_eagle31.features import capture_request, select_features
from hf_eagle31.training import train_drafter
from hf_eagle31.training.data import self_distill


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def sequences(target):
    """12 prompts' continuations, 4 times over: the upgrade's held-out last 16 repeat sequences it trains on.

    A random tiny target does not generalise, so acceptance on unseen continuations is chance for any
    drafter; on continuations the drafters have fitted, it measures how well each one fitted them.
    """
    prompts = torch.randint(3, 256, (12, 6), generator=torch.Generator().manual_seed(1)).tolist()
    return self_distill(target, prompts * 4, max_new_tokens=24, batch_size=48)


def records(sequences):
    return [{"input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in sequences]


def features_of(target, drafter, sequences):
    ids = torch.tensor([s.input_ids for s in sequences if len(s.input_ids) == len(sequences[0].input_ids)])
    layer_ids = drafter.config.target_layer_ids
    with torch.no_grad():
        return select_features(target(ids, output_hidden_states=capture_request(layer_ids)).hidden_states, layer_ids)


def test_calibrated_fc_norm_reproduces_fc_input(sequences):
    """On a target whose states have a large scale (like real models'), the calibrated norms give fc
    nearly the input it was trained on; unit weights do not, and no other scale does better."""
    target = make_target(seed=3)
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(100.0)
    drafter = make_drafter(target, eagle31=False)
    calibration, evaluation = sequences[:32], sequences[32:]
    weights = fc_norm_weights(target, calibration, drafter.config.target_layer_ids)
    features = features_of(target, drafter, evaluation)
    scales = features.float().chunk(3, -1)
    assert all(s.pow(2).mean().sqrt() > 5 for s in scales)
    token_rms = torch.cat([features_of(target, drafter, [s])[0].chunk(3, -1)[0].pow(2).mean(-1).sqrt() for s in calibration])
    assert float(weights[0, 0]) == pytest.approx(float(token_rms.mean()), rel=1e-4)  # one sequence at a time

    def error(norm_weights):
        upgraded = switch_on_eagle31(drafter, norm_weights)
        with torch.no_grad():
            original, new = drafter.project_target_features(features), upgraded.project_target_features(features)
        return float((new - original).norm() / original.norm())

    calibrated = error(weights)
    assert calibrated < 0.15
    assert calibrated < 0.2 * error(torch.ones_like(weights))
    assert calibrated < min(error(weights * 0.9), error(weights * 1.1))


def test_switch_on_eagle31_keeps_weights_and_refuses_3_1(target):
    drafter = make_drafter(target, eagle31=False)
    upgraded = switch_on_eagle31(drafter, torch.full((3, 64), 2.0))
    assert upgraded.config.fc_norm and upgraded.config.norm_output
    assert not drafter.config.fc_norm  # the original is untouched
    torch.testing.assert_close(upgraded.midlayer.mlp.up_proj.weight, drafter.midlayer.mlp.up_proj.weight)
    assert torch.equal(upgraded.fc_norm[1].weight.detach(), torch.full((64,), 2.0))
    with pytest.raises(ValueError, match="already has an EAGLE 3.1 switch"):
        switch_on_eagle31(make_drafter(target, eagle31=True), torch.ones(3, 64))


@pytest.mark.slow
def test_upgrade_after_fine_tune_raises_acceptance(target, sequences, tmp_path):
    # tune_prompts=0: tuning the shape (test_train_command_end_to_end's business) took 280 of this test's 290 s
    original = train_drafter(target, records(sequences[:32]), tmp_path / "eagle3", arch="eagle3", steps=30, lr=1e-2,
                             batch_size=8, save_every=1000, tune_prompts=0)
    tuned, reports = upgrade_drafter(original, target, records(sequences), tmp_path / "eagle31", held_out=16,
                                     steps=60, lr=3e-3, batch_size=8, save_every=1000, tune_prompts=0)
    before = reports["EAGLE-3 (original)"]
    after = reports["EAGLE 3.1 (upgraded, fine-tuned)"]
    print({name: (report.acceptance, report.expected_length) for name, report in reports.items()})
    assert after.expected_length > before.expected_length
    assert after.acceptance[0] > before.acceptance[0]
    assert tuned.config.fc_norm and tuned.config.norm_output
    saved = Eagle3DraftModel.from_pretrained(tmp_path / "eagle31")
    assert saved.config.fc_norm and saved.config.norm_output
    card = ModelCard.load(tmp_path / "eagle31" / "README.md")
    assert "eagle3.1" in card.data.tags and "EAGLE-3 (original), held-out teacher-forced" in card.text
    runs = json.loads((tmp_path / "eagle31" / "upgrade_acceptance.json").read_text())["runs"]
    assert len(runs) == 3
    assert not [p for p in (tmp_path / "eagle31").iterdir() if p.is_dir()]  # no checkpoints/ or distilled/ left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eagle3", "eagle31"]  # nor the scratch folder


def test_too_few_prompts_are_refused_before_any_distillation(target, tmp_path, monkeypatch, capsys):
    import hf_eagle31.training.trainer as trainer
    from tiny_models import make_tokenizer

    from hf_eagle31.cli import main as cli_main

    target.save_pretrained(tmp_path / "target")
    make_tokenizer().save_pretrained(tmp_path / "target")
    make_drafter(target, eagle31=False).save_pretrained(tmp_path / "eagle3")
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"turns": [f"question {i}"]}) + "\n" for i in range(12)))
    monkeypatch.setattr(trainer, "distill_to_folder", lambda *a, **k: pytest.fail("distilled before validating"))
    argv = ["convert", str(tmp_path / "eagle3"), str(tmp_path / "out"), "--upgrade", "--target", str(tmp_path / "target"),
            "--data", str(tmp_path / "chats.jsonl")]
    assert cli_main(argv) == 2  # 12 prompts cannot spare 8 held out and 8 to tune on
    err = capsys.readouterr().err
    assert "held_out + tune_prompts = 8 + 8 prompts, got 12" in err and "--tune-prompts" in err
    assert not (tmp_path / "out").exists()
    assert cli_main([*argv, "--held-out", "0"]) == 2 and "--held-out must be at least 1" in capsys.readouterr().err
