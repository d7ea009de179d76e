"""Upgrade an EAGLE-3 drafter to EAGLE 3.1: switch on `fc_norm` and `norm_output`, then fine-tune.

`fc_norm` puts an RMSNorm with weight w_i in front of `fc` on each captured state g_i, so `fc`,
trained on raw g_i, would suddenly see w_i * g_i / rms(g_i). The weights start where that is
closest to g_i over calibration tokens: for one scale per layer, least squares,

    argmin_w E ||w g / rms(g) - g||^2 = E[|g|^2 / rms(g)] / E[|g|^2 / rms(g)^2] = E[rms(g)],

is the mean rms of g_i over the tokens, so fc(norm(g)) ~= fc(g) up to each token's deviation from
that mean, and the first draft step starts near the original. (A separate scale per channel fits
the calibration tokens marginally better and new tokens worse: it only adds estimation noise.) `norm_output` changes what later steps are fed
(the post-norm state instead of the residual stream) and has no such fix: a short fine-tune with
the training pipeline adapts the head to it, and the acceptance before and after says whether
the upgrade paid. (Hence its place in training/: it distills, trains and measures acceptance with the training
pipeline, which sits above generation; `hf-eagle31 convert --upgrade` runs it.)
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import PreTrainedModel

from hf_eagle31.generation import prepare_drafter
from hf_eagle31.model_cards.card import write_model_card
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.packaged import hub_id
from hf_eagle31.training.data import SequenceDataset, TrainingSequence, collate, read_examples
from hf_eagle31.training.evaluation import AcceptanceReport, evaluate_acceptance
from hf_eagle31.training.teacher import target_states
from hf_eagle31.training.trainer import TrainingConfig, train_drafter, training_sequences


@torch.no_grad()
def fc_norm_weights(target: PreTrainedModel, sequences: list[TrainingSequence], layer_ids: list[int],
                    batch_size: int = 8) -> torch.Tensor:
    """`[n, H_t]` RMSNorm weights for the n captured layers: each one's mean rms over these sequences' tokens."""
    dataset = SequenceDataset(sequences)
    total, count = torch.zeros(len(layer_ids)), 0
    for start in range(0, len(dataset), batch_size):
        batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
        mask = batch["attention_mask"].to(target.device)
        features, _ = target_states(target, batch["input_ids"].to(target.device), mask, layer_ids)
        rms = torch.stack(features.float().chunk(len(layer_ids), dim=-1)).pow(2).mean(-1).sqrt()  # [n, B, L]
        total += (rms * mask).sum((1, 2)).cpu()
        count += int(mask.sum())
    return (total / count)[:, None].expand(len(layer_ids), features.shape[-1] // len(layer_ids)).clone()


def switch_on_eagle31(drafter: Eagle3DraftModel, norm_weights: torch.Tensor) -> Eagle3DraftModel:
    """A copy of an EAGLE-3 drafter with both 3.1 switches on and `fc_norm` initialised to `norm_weights`."""
    if drafter.config.fc_norm or drafter.config.norm_output:
        raise ValueError("this drafter already has an EAGLE 3.1 switch on (fc_norm or norm_output); "
                         "--upgrade takes an EAGLE-3 head")
    if drafter.config.norm_before_fc:
        raise ValueError("this drafter normalises its features with norm_before_fc, which excludes fc_norm; "
                         "--upgrade takes an EAGLE-3 head without it")
    config = copy.deepcopy(drafter.config)
    config.fc_norm = config.norm_output = True
    upgraded = Eagle3DraftModel(config).to(drafter.fc.weight.dtype)
    missing, unexpected = upgraded.load_state_dict(drafter.state_dict(), strict=False)
    if unexpected or any(not key.startswith("fc_norm.") for key in missing):
        raise ValueError(f"cannot map the drafter's weights (missing {missing}, unexpected {unexpected})")
    with torch.no_grad():
        for norm, weight in zip(upgraded.fc_norm, norm_weights):
            norm.weight.copy_(weight)
    if drafter.get_input_embeddings() is not None and drafter.embed_tokens is None:
        upgraded.set_target_embedding(drafter.get_input_embeddings())
    return upgraded.eval()


def stage(text: str) -> None:
    """Announce a long stage on stderr (the others show a progress bar): a CPU upgrade takes minutes."""
    print(f"upgrade: {text}", file=sys.stderr, flush=True)


def check_enough(count: int, held_out: int, tune_prompts: int, what: str) -> None:
    """The upgrade keeps `held_out` sequences for the before/after acceptance and `tune_prompts` to tune the draft
    shape on, and fine-tunes on the rest: checked on the prompts before any distillation, and on the sequences
    after it (a conversation too long for max_length gives none)."""
    if held_out < 1:
        raise ValueError(f"--held-out must be at least 1 (the before/after acceptance is measured on it), got {held_out}")
    if count <= held_out + tune_prompts:
        raise ValueError(f"the upgrade needs more than held_out + tune_prompts = {held_out} + {tune_prompts} {what}, "
                         f"got {count}: give more --data, or lower --held-out or --tune-prompts (0: keep the default "
                         "draft shape)")


def upgrade_drafter(
    drafter: Eagle3DraftModel,
    target: PreTrainedModel,
    data,
    out_dir: str | Path,
    tokenizer=None,
    held_out: int = 8,
    depth: int = 5,
    config: TrainingConfig | None = None,
    **settings,
) -> tuple[Eagle3DraftModel, dict[str, AcceptanceReport]]:
    """Upgrade, fine-tune on `data` (prompts the target answers, as in training) and save to `out_dir`.

    The last `held_out` sequences are kept out of calibration and fine-tuning; acceptance on them is
    reported for the original head, the upgraded head before its fine-tune, and after it, and goes
    into the model card. The distilled answers and training checkpoints live in a scratch folder beside
    `out_dir`, removed at the end: `out_dir` receives the drafter, its log, its card and the acceptance.
    """
    config = replace(config or TrainingConfig(steps=200), arch="eagle3.1", **settings)
    config.validate()
    data = data if isinstance(data, (str, Path)) else list(data)
    examples = read_examples(data)
    check_enough(len(examples.conversations) + len(examples.sequences) + len(examples.texts), held_out,
                 config.tune_prompts, "prompts")
    prepare_drafter(target, drafter)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}-work-", dir=out_dir.parent) as work:
        sequences = training_sequences(target, data, tokenizer, config, Path(work), Accelerator())
        check_enough(len(sequences), held_out, config.tune_prompts, "training sequences")
        train, evaluation = sequences[:-held_out], sequences[-held_out:]
        stage(f"calibrating the fc_norm weights on {min(len(train), 64)} sequences")
        upgraded = switch_on_eagle31(drafter, fc_norm_weights(target, train[:64], drafter.config.target_layer_ids))
        stage(f"measuring acceptance before the fine-tune on {held_out} held-out sequences")
        reports = {"EAGLE-3 (original)": evaluate_acceptance(drafter, target, evaluation, depth),
                   "EAGLE 3.1 (upgraded, before fine-tune)": evaluate_acceptance(upgraded, target, evaluation, depth)}
        records = [{"input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in train]
        tuned = train_drafter(target, records, work, drafter=upgraded, config=config)
        for file in Path(work).iterdir():  # the drafter and its records, not the distilled chunks or checkpoints
            if file.is_file():
                shutil.copy2(file, out_dir)
    stage("measuring acceptance after the fine-tune")
    reports["EAGLE 3.1 (upgraded, fine-tuned)"] = evaluate_acceptance(tuned, target, evaluation, depth)
    runs = [{"name": f"{name}, held-out teacher-forced", **report.as_dict()} for name, report in reports.items()]
    (out_dir / "upgrade_acceptance.json").write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    write_model_card(out_dir, base_model=hub_id(target.name_or_path), benchmark={"runs": runs})
    return tuned, reports
