"""Train an EAGLE-3 / EAGLE 3.1 drafter against a frozen target: `train_drafter(target, data, out_dir)`.

Stage 1 distils the target into the drafter with the training-time-test unroll (ttt.py): forward
KL per draft step against the target's distribution over the draft vocabulary, weighted by
`loss_decay ** k`. Stage 2 (optional, `acceptance_steps`) maximises the expected accepted length
sum_k prod_{j<=k} alpha_j directly. accelerate runs it all: mixed precision, gradient
accumulation, `accelerate launch` for several GPUs, and `save_state` checkpoints from which an
interrupted run resumes at the step it last saved, on the same batches.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import sys
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, set_seed
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from hf_eagle31.configuration import Eagle3Config
from hf_eagle31.generation import prepare_drafter
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.packaged import hub_id, model_name
from hf_eagle31.training.data import (
    EpochShuffle,
    SequenceDataset,
    TrainingSequence,
    collate,
    fit_length,
    read_examples,
)
from hf_eagle31.training.distill import DistillSettings, check_answers, distill_to_folder, load_distilled
from hf_eagle31.training.feature_cache import build_feature_cache
from hf_eagle31.training.losses import acceptance_loss, ahead, distillation_losses, step_mask
from hf_eagle31.training.teacher import draft_vocab_ids, target_logits, target_states
from hf_eagle31.training.ttt import Unrolled
from hf_eagle31.training.vocab import build_draft_vocab, target_head_rows, token_counts, widen_draft_vocab

ARCHITECTURES = {"eagle3": False, "eagle3.1": True}  # --arch -> both 3.1 switches on?
MAX_TTT_STEPS = 7
DISTILLED = "distilled"  # the self-distilled chunks, reused by a resumed or repeated run
LOG = "train_log.csv"
STATE = "trainer_state.json"  # written last into each checkpoint: its presence marks it complete
TRAINING_ARGS = "training_args.json"  # what the model card reports about training


@dataclass
class TrainingConfig:
    """Settings of one training run (the CLI flags of `hf-eagle31 train`)."""

    arch: str = "eagle3.1"
    draft_vocab_size: int | None = None  # None: the full target vocabulary
    ttt_steps: int = 4
    steps: int | None = None  # stage-1 optimizer steps; or give `epochs`
    epochs: int | None = None
    lr: float = 1e-4
    batch_size: int = 8
    grad_accum: int = 1
    max_length: int = 2048
    answer_max_new_tokens: int = 256
    answer_temperature: float = 0.0  # 0: the target answers greedily
    answers: str = "target"  # "given": train on the records' own answers instead (no generation, EAGLE-1's data)
    max_turns: int | None = None  # user turns answered per conversation (None: all that fit in max_length)
    distill_batch_size: int = 32  # prompts per generate call while the target answers
    token_budget: int | None = None  # stop self-distillation at this many answer tokens (None: all the data)
    tune_prompts: int = 8  # sequences held out of training to tune the draft shape on at the end (0: no tuning)
    acceptance_steps: int = 0  # stage-2 optimizer steps
    loss_decay: float = 0.8
    lk_eta: float | None = None  # the LK-lambda loss (losses.distillation_losses) with this eta; None: forward KL
    warmup_steps: int | None = None  # None: 10% of stage 1, at most 100
    save_every: int = 500
    mixed_precision: str = "no"
    seed: int = 0
    feature_cache: str | None = None
    resume: bool = False

    def validate(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {self.arch!r}")
        if not 1 <= self.ttt_steps <= MAX_TTT_STEPS:
            raise ValueError(f"ttt_steps must be between 1 and {MAX_TTT_STEPS}, got {self.ttt_steps}")
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of steps and epochs")
        if (self.steps or 0) < 0 or (self.epochs or 0) < 0 or self.acceptance_steps < 0:
            raise ValueError("steps, epochs and acceptance_steps cannot be negative")
        if (self.steps or self.epochs or 0) + self.acceptance_steps == 0:
            raise ValueError("nothing to train: steps/epochs and acceptance_steps are all 0")
        if self.max_length < 3:
            raise ValueError(f"max_length must be at least 3 tokens, got {self.max_length}")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"token_budget must be a positive number of answer tokens, got {self.token_budget}")
        if self.lk_eta is not None and self.lk_eta < 0:
            raise ValueError(f"lk_eta cannot be negative, got {self.lk_eta}")
        check_answers(self.answers)
        if self.tune_prompts < 0:
            raise ValueError(f"tune_prompts cannot be negative, got {self.tune_prompts}")


def drafter_config_for(target: PreTrainedModel, arch: str = "eagle3.1", draft_vocab_size: int | None = None,
                       **overrides) -> Eagle3Config:
    """A drafter shaped like one decoder layer of `target`, reading its default low/mid/high layers."""
    tc = target.config.get_text_config()
    fields_ = dict(
        vocab_size=tc.vocab_size,
        draft_vocab_size=draft_vocab_size,
        hidden_size=tc.hidden_size,
        target_hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None),
        head_dim=getattr(tc, "head_dim", None),
        hidden_act=getattr(tc, "hidden_act", "silu"),
        max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_parameters=getattr(tc, "rope_parameters", None),
        num_target_layers=tc.num_hidden_layers,
        fc_norm=ARCHITECTURES[arch],
        norm_output=ARCHITECTURES[arch],
        pad_token_id=tc.pad_token_id,
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
    )
    fields_.update(overrides)
    return Eagle3Config(**fields_)


# --- checkpoints and the log ---------------------------------------------------------------------


def resumable(out_dir: Path) -> bool:
    """Whether a run left something in `out_dir` that `--resume` or a repeated run reuses: a checkpoint, or answers."""
    return any((out_dir / "checkpoints").glob(f"step_*/{STATE}")) or any((out_dir / DISTILLED).glob("*"))


def latest_checkpoint(out_dir: Path) -> tuple[Path, int] | None:
    """The newest complete checkpoint and its step, checked readable before any long work starts."""
    complete = sorted((out_dir / "checkpoints").glob(f"step_*/{STATE}"))
    if not complete:
        return None
    folder = complete[-1].parent
    try:
        step = int(json.loads((folder / STATE).read_text())["step"])
        for weights in folder.glob("*.safetensors"):
            with safe_open(str(weights), framework="pt"):
                pass
    except Exception as err:  # any failure to read it: one clear message
        raise ValueError(f"checkpoint {folder} is unreadable ({type(err).__name__}: {err}); "
                         "delete it to resume from an earlier one") from None
    return folder, step


def save_checkpoint(accelerator: Accelerator, out_dir: Path, step: int, keep: int = 2) -> None:
    folder = out_dir / "checkpoints" / f"step_{step:08d}"
    accelerator.save_state(str(folder))
    if accelerator.is_main_process:
        (folder / STATE).write_text(json.dumps({"step": step}))
        for old in sorted((out_dir / "checkpoints").glob("step_*"))[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


class CsvLog:
    """One row per optimizer step; a resumed run drops the rows logged after its checkpoint."""

    def __init__(self, path: Path, ttt_steps: int, resume_step: int, enabled: bool):
        self.path, self.enabled = path, enabled
        self.columns = ["step", "stage", "lr", "loss"] + [
            f"{name}_{k}" for name in ("kl", "alpha", "acc") for k in range(ttt_steps)
        ]
        if not enabled:
            return
        kept = []
        if resume_step and path.exists():
            with path.open() as f:
                kept = [row for row in csv.DictReader(f) if int(row["step"]) <= resume_step]
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, self.columns)
            writer.writeheader()
            writer.writerows(kept)

    def write(self, row: dict) -> None:
        if self.enabled:
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, self.columns).writerow(row)


# --- data ----------------------------------------------------------------------------------------


def training_sequences(target: PreTrainedModel, data, tokenizer, config: TrainingConfig, out_dir: Path,
                       accelerator: Accelerator) -> list[TrainingSequence]:
    """Records as training sequences; conversations are answered by the target into `out_dir/distilled`.

    Distillation is chunked (see `hf_eagle31.training.distill`): chunks already written are reused,
    so an interrupted or repeated run with the same data and settings never answers a prompt twice.
    """
    examples = read_examples(data)
    text_config = target.config.get_text_config()
    if (examples.texts or examples.conversations) and tokenizer is None:
        raise ValueError("the training data needs a tokenizer (none was given and the target folder has none)")
    sequences = examples.sequences + [TrainingSequence(ids, [1] * len(ids))
                                      for ids in (tokenizer(t)["input_ids"] for t in examples.texts)]
    if any(not 0 <= i < text_config.vocab_size for s in sequences for i in s.input_ids):
        raise ValueError(f"the training data holds token ids outside the target's vocabulary of "
                         f"{text_config.vocab_size} tokens")
    if examples.conversations:
        settings = DistillSettings(
            max_length=min(config.max_length, text_config.max_position_embeddings),
            max_new_tokens=config.answer_max_new_tokens, max_turns=config.max_turns,
            batch_size=config.distill_batch_size, temperature=config.answer_temperature,
        )
        distill_to_folder(target, tokenizer, examples.conversations, out_dir / DISTILLED, settings,
                          config.token_budget, process_index=accelerator.process_index,
                          num_processes=accelerator.num_processes, answers=config.answers)
        accelerator.wait_for_everyone()
        answered, report = load_distilled(out_dir / DISTILLED)
        if report.too_long:
            warnings.warn(f"{report.too_long} of {report.conversations} conversations were left out: their first "
                          f"prompt leaves no tokens for an answer within max_length ({settings.max_length} tokens)",
                          stacklevel=2)
        sequences = answered + sequences
    sequences = fit_length(sequences, config.max_length)
    if not sequences:
        raise ValueError(f"the training data is empty: no sequence has a token to learn within max_length "
                         f"({config.max_length} tokens)")
    return sequences


def new_drafter(target: PreTrainedModel, config: TrainingConfig, sequences: list[TrainingSequence]) -> Eagle3DraftModel:
    size = config.draft_vocab_size
    if size is not None:
        counts = token_counts(sequences, target.config.get_text_config().vocab_size)
        seen = int((counts > 0).sum())
        if seen < size:  # the rest would be arbitrary ids the drafter never saw: size it from the data
            warnings.warn(f"the answers hold only {seen} distinct tokens, fewer than draft_vocab_size={size}: "
                          f"the draft vocabulary has {seen} tokens", stacklevel=2)
            size = seen
    drafter = Eagle3DraftModel(drafter_config_for(target, config.arch, size))
    if size is not None:
        d2t, t2d = build_draft_vocab(counts, size)
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
    rows = target_head_rows(target, draft_vocab_ids(drafter), drafter.lm_head.weight.shape[1])
    if rows is not None:
        with torch.no_grad():
            drafter.lm_head.weight.copy_(rows)
    return drafter


# --- one step ------------------------------------------------------------------------------------


def training_step(model, drafter: Eagle3DraftModel, target: PreTrainedModel, batch: dict, config: TrainingConfig,
                  acceptance_stage: bool) -> tuple[torch.Tensor, dict]:
    """The loss of one batch and what to log about it."""
    ids, mask = batch["input_ids"], batch["loss_mask"] * batch["attention_mask"]
    if "features" in batch:
        features, last = batch["features"], batch["last_hidden"]
    else:
        features, last = target_states(target, ids, batch["attention_mask"], drafter.config.target_layer_ids)
    # stage 1 needs logits only where the loss counts; the acceptance objective multiplies along each chain
    steps = model(features, ids, config.ttt_steps, None if acceptance_stage else mask)
    draft_ids = draft_vocab_ids(drafter)
    row = {}
    if acceptance_stage:
        full = target_logits(target, last)
        loss, alpha = acceptance_loss(steps, full, draft_ids, mask)
        restricted = full[..., draft_ids.to(full.device)]
        row.update({f"alpha_{k}": a for k, a in enumerate(alpha.detach().tolist())})
    else:
        restricted = target_logits(target, last, draft_ids)
        kl = distillation_losses(steps, restricted, mask, config.lk_eta)
        loss = (kl * config.loss_decay ** torch.arange(len(steps), device=kl.device)).sum()
        row.update({f"kl_{k}": v for k, v in enumerate(kl.detach().tolist())})
    target_tokens = restricted.argmax(-1)
    length = ids.shape[1] - 1
    for k, logits in enumerate(steps):
        keep = step_mask(mask, k, length).to(logits.device)
        counted = logits.detach()[keep] if acceptance_stage else logits.detach()
        match = counted.argmax(-1) == ahead(target_tokens, k + 1, length).to(logits.device)[keep]
        row[f"acc_{k}"] = float(match.float().mean()) if match.numel() else 0.0
    return loss, row


def lr_factor(step: int, warmup: int, stage1_steps: int) -> float:
    """Linear warmup, cosine decay to 10% over stage 1, then 10% through stage 2."""
    if step < warmup:
        return (step + 1) / warmup
    if step >= stage1_steps:
        return 0.1
    progress = (step - warmup) / max(1, stage1_steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


# --- the run -------------------------------------------------------------------------------------


def train_drafter(
    target: PreTrainedModel,
    data,
    out_dir: str | Path,
    tokenizer=None,
    drafter: Eagle3DraftModel | None = None,
    config: TrainingConfig | None = None,
    **settings,
) -> Eagle3DraftModel:
    """Train a drafter for `target` and save it to `out_dir` (with its log, checkpoints and model card).

    Args:
        target: the frozen target model (any transformers causal LM of the Llama/Qwen/Mistral kind).
        data: a JSONL path or an iterable of records (see `hf_eagle31.training.data`).
        tokenizer: the target's tokenizer; needed to read the records.
        drafter: a drafter to continue training (its architecture and vocabulary are kept); a new
            one shaped after the target otherwise.
        config, settings: a `TrainingConfig`, and/or its fields as keywords.
    """
    config = replace(config or TrainingConfig(), **settings)
    config.validate()
    out_dir = Path(out_dir)
    accelerator = Accelerator(
        mixed_precision=config.mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=config.grad_accum, sync_with_dataloader=False),
        step_scheduler_with_optimizer=False,
    )
    set_seed(config.seed)
    check_models(target, drafter, config, accelerator)
    checkpoint = checkpoint_to_resume(out_dir, config)
    sequences = training_sequences(target, data, tokenizer, config, out_dir, accelerator)
    out_dir.mkdir(parents=True, exist_ok=True)
    sequences, calibration = held_out(sequences, config)
    if drafter is None:
        drafter = new_drafter(target, config, sequences)
        drafter.set_target_embedding(target.get_input_embeddings())
    elif (config.draft_vocab_size or 0) > drafter.config.draft_vocab_size:  # the data asks for more tokens
        widen_draft_vocab(drafter, target, token_counts(sequences, drafter.t2d.shape[0]), config.draft_vocab_size)
    drafter.float().train()
    run = prepare_run(target, drafter, sequences, config, accelerator)
    run_steps(run, target, config, accelerator, out_dir, checkpoint)
    accelerator.wait_for_everyone()
    drafter = run.drafter.eval()
    if accelerator.is_main_process:
        if config.tune_prompts:
            tune_on(target, drafter, calibration, config.answer_max_new_tokens, out_dir)
        drafter.save_pretrained(out_dir)
        write_training_args(out_dir, target, data, config, sequences, run.total)
        from hf_eagle31.model_cards.card import write_model_card

        write_model_card(out_dir, base_model=hub_id(target.name_or_path))
    return drafter


def check_models(target: PreTrainedModel, drafter: Eagle3DraftModel | None, config: TrainingConfig,
                 accelerator: Accelerator) -> None:
    """Freeze the target on the training device; a drafter to continue must fit it and keep its vocabulary."""
    target.requires_grad_(False).eval()
    if getattr(target, "hf_device_map", None) is None and not getattr(target, "is_quantized", False):
        target.to(accelerator.device)
    if drafter is not None:
        prepare_drafter(target, drafter)
        if (config.draft_vocab_size or drafter.config.draft_vocab_size) < drafter.config.draft_vocab_size:
            raise ValueError(f"the given drafter has a draft vocabulary of {drafter.config.draft_vocab_size} tokens, "
                             f"more than draft_vocab_size={config.draft_vocab_size}: a vocabulary can grow, not shrink")


def checkpoint_to_resume(out_dir: Path, config: TrainingConfig) -> tuple[Path, int] | None:
    """The latest checkpoint where the run resumes; refuses to start afresh over an earlier run's checkpoints."""
    if not config.resume and any((out_dir / "checkpoints").glob("step_*")):
        raise ValueError(f"{out_dir} holds checkpoints of an earlier run: resume it (--resume) or choose another "
                         "output folder")
    return latest_checkpoint(out_dir) if config.resume else None


def held_out(sequences: list[TrainingSequence], config: TrainingConfig
             ) -> tuple[list[TrainingSequence], list[TrainingSequence]]:
    """The training sequences and the last `tune_prompts` held out of training: the draft shape is tuned on
    prompts the drafter never saw."""
    if not config.tune_prompts:
        return sequences, []
    if len(sequences) <= config.tune_prompts:
        raise ValueError(f"{len(sequences)} training sequences cannot spare tune_prompts={config.tune_prompts} "
                         "for tuning; give more data or set tune_prompts=0")
    return sequences[: -config.tune_prompts], sequences[-config.tune_prompts :]


@dataclass
class Run:
    """What the training loop steps: the unrolled drafter, its optimizer, schedule and batches, as accelerate
    prepared them; `stage1` steps of the training-time test, then the acceptance stage up to `total`."""

    model: torch.nn.Module
    drafter: Eagle3DraftModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: torch.utils.data.DataLoader
    stage1: int
    total: int


def prepare_run(target: PreTrainedModel, drafter: Eagle3DraftModel, sequences: list[TrainingSequence],
                config: TrainingConfig, accelerator: Accelerator) -> Run:
    if config.feature_cache:
        with accelerator.main_process_first():
            dataset = build_feature_cache(target, sequences, drafter.config.target_layer_ids, config.feature_cache,
                                          config.batch_size)
    else:
        dataset = SequenceDataset(sequences)
    sampler = EpochShuffle(len(dataset), config.seed, [len(s.input_ids) for s in sequences], config.batch_size)
    loader = torch.utils.data.DataLoader(dataset, batch_size=config.batch_size, sampler=sampler, collate_fn=collate)
    model = Unrolled(drafter)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    stage1 = config.steps if config.steps is not None else config.epochs * math.ceil(len(loader) / config.grad_accum)
    warmup = config.warmup_steps if config.warmup_steps is not None else min(100, stage1 // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup, stage1))
    accelerator.register_for_checkpointing(scheduler)
    return Run(model, accelerator.unwrap_model(model).drafter, optimizer, scheduler, loader, stage1,
               stage1 + config.acceptance_steps)


def run_steps(run: Run, target: PreTrainedModel, config: TrainingConfig, accelerator: Accelerator, out_dir: Path,
              checkpoint: tuple[Path, int] | None) -> None:
    """Optimizer steps from the checkpoint's (or 0) to `run.total`, logged, checkpointed every `save_every`."""
    step = 0
    if checkpoint is not None:
        try:
            accelerator.load_state(str(checkpoint[0]))
        except Exception as err:  # a corrupt or mismatched state: say which, not a torch traceback
            raise ValueError(f"cannot resume from checkpoint {checkpoint[0]}: {type(err).__name__}: {err}") from None
        step = checkpoint[1]
    log = CsvLog(out_dir / LOG, config.ttt_steps, step, accelerator.is_main_process)
    epoch, skip = divmod(step * config.grad_accum, len(run.loader))
    progress = tqdm(total=run.total, initial=step, desc="training", unit="step",
                    disable=not accelerator.is_local_main_process)
    sums: dict[str, float] = {}
    while step < run.total:
        run.loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(run.loader, skip) if skip else run.loader
        skip = 0
        for batch in batches:
            with accelerator.accumulate(run.model):
                loss, row = training_step(run.model, run.drafter, target, batch, config, step >= run.stage1)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(run.model.parameters(), 1.0)
                run.optimizer.step()
                run.optimizer.zero_grad()
            for key, value in {"loss": loss.item(), **row}.items():
                sums[key] = sums.get(key, 0.0) + value / config.grad_accum
            if not accelerator.sync_gradients:
                continue
            lr = run.scheduler.get_last_lr()[0]
            run.scheduler.step()
            step += 1
            log.write({"step": step, "stage": 2 if step > run.stage1 else 1, "lr": lr, **sums})
            progress.set_postfix(loss=f"{sums['loss']:.4f}")
            progress.update()
            sums = {}
            if step % config.save_every == 0 or step == run.total:
                save_checkpoint(accelerator, out_dir, step)
            if step >= run.total:
                break
        epoch += 1
    progress.close()


def tune_on(target: PreTrainedModel, drafter: Eagle3DraftModel, held_out: list[TrainingSequence],
            max_new_tokens: int, out_dir: Path) -> None:
    """Choose the draft shape for this device from held-out prompts (the part of each sequence before its
    first training target) and store it in the drafter's generation config; the report goes to tuning.json."""
    from hf_eagle31.tuning import tune_drafter

    prompts = [torch.tensor([s.input_ids[: s.loss_mask.index(1)]]) for s in held_out if 1 in s.loss_mask[1:]]
    prompts = [p for p in prompts if p.shape[1] > 0]
    if not prompts:
        return
    tqdm.write(f"tuning the draft shape for this device on {len(prompts)} held-out prompts", file=sys.stderr)
    report = tune_drafter(target, drafter, prompts, min(max_new_tokens, 96))
    (out_dir / "tuning.json").write_text(json.dumps(report.as_dict(), indent=1, default=str) + "\n")


def write_training_args(out_dir: Path, target: PreTrainedModel, data, config: TrainingConfig,
                        sequences: list[TrainingSequence], total_steps: int) -> None:
    record = {
        "target": model_name(target),
        "data": str(data) if isinstance(data, (str, Path)) else f"{type(data).__name__} of records",
        "sequences": len(sequences),
        "answer_tokens": sum(sum(s.loss_mask) for s in sequences),
        "optimizer_steps": total_steps,
        **{f.name: getattr(config, f.name) for f in fields(config)},
    }
    (out_dir / TRAINING_ARGS).write_text(json.dumps(record, indent=2) + "\n")
