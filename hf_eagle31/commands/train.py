"""Train an EAGLE-3 / EAGLE 3.1 drafter for a target model (self-distillation with training-time test).

`hf-eagle31 train --target DIR --data FILE --out DIR [...]`; `accelerate launch -m
hf_eagle31.cli train ...` runs the same command on several processes (distillation and training
are both split between them).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from accelerate import PartialState

from hf_eagle31.folders import removed_on_failure
from hf_eagle31.packaged import load_target
from hf_eagle31.training.distill import ANSWERS
from hf_eagle31.training.trainer import ARCHITECTURES, MAX_TTT_STEPS, TrainingConfig, resumable, train_drafter


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Train an EAGLE-3 / EAGLE 3.1 drafter for a target model."""
    defaults = TrainingConfig()
    add = parser.add_argument
    add("--target", required=True, help="the target model (folder, Hub id or packaged name), with its tokenizer")
    add("--data", required=True, help="ShareGPT JSON/JSONL, chat 'messages' or 'turns' records (the target answers "
        "them), 'text' or 'input_ids' records, or a folder written by `hf-eagle31 distill`")
    add("--out", required=True, help="output folder: the drafter, train_log.csv, checkpoints/, README.md")
    add("--drafter", help="continue training this drafter instead of starting a new one")
    add("--arch", choices=sorted(ARCHITECTURES), default=defaults.arch,
        help="eagle3.1: both 3.1 norms (fc_norm, norm_output) on; eagle3: the original head")
    add("--draft-vocab-size", type=int, help="keep the N most frequent answer tokens (default: the full vocabulary); "
        "continuing a drafter, widen its vocabulary to N (its tokens kept, the most frequent others added)")
    add("--ttt-steps", type=int, default=defaults.ttt_steps, help=f"draft steps unrolled in training (1..{MAX_TTT_STEPS})")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--steps", type=int, help="optimizer steps of stage 1")
    budget.add_argument("--epochs", type=int, help="epochs of stage 1")
    add("--acceptance-steps", type=int, default=0, help="optimizer steps of stage 2 (maximise expected accepted length)")
    add("--lr", type=float, default=defaults.lr, help="peak learning rate (AdamW, warmup then cosine decay)")
    add("--loss-decay", type=float, default=defaults.loss_decay, help="weight of unrolled step k: decay**k")
    add("--lk-eta", type=float, help="train with the LK-lambda loss (KL blended into total variation, eta 3 in its "
        "paper) instead of forward KL")
    add("--batch-size", type=int, default=defaults.batch_size, help="sequences per micro-batch (per process)")
    add("--grad-accum", type=int, default=defaults.grad_accum, help="micro-batches per optimizer step")
    add("--max-length", type=int, default=defaults.max_length, help="tokens per training sequence (longer ones are cut)")
    add("--answer-max-new-tokens", type=int, default=defaults.answer_max_new_tokens,
        help="tokens per answer the target writes in self-distillation")
    add("--answer-temperature", type=float, default=defaults.answer_temperature, help="0: greedy answers")
    add("--answers", choices=ANSWERS, default=defaults.answers,
        help="target: the target writes every answer (self-distillation); given: the records' own answers")
    add("--max-turns", type=int, help="user turns answered per conversation (default: all that fit in --max-length)")
    add("--distill-batch-size", type=int, default=defaults.distill_batch_size, help="prompts per generate call")
    add("--token-budget", type=int, help="stop self-distillation at this many answer tokens (resumable)")
    add("--tune-prompts", type=int, default=defaults.tune_prompts,
        help="sequences held out to tune the draft shape on at the end (0: keep the default shape)")
    add("--mixed-precision", choices=["no", "bf16", "fp16"], default=defaults.mixed_precision,
        help="autocast of the drafter's training (accelerate's setting)")
    add("--save-every", type=int, default=defaults.save_every, help="checkpoint every N optimizer steps")
    add("--feature-cache", help="folder for an offline cache of target features (default: computed online)")
    add("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    add("--seed", type=int, default=defaults.seed, help="seed of initialisation, shuffling and sampled answers")


def run(args: argparse.Namespace) -> None:
    from hf_eagle31.modeling import Eagle3DraftModel

    target, tokenizer = load_target(args.target)
    drafter = None
    if args.drafter:
        try:
            drafter = Eagle3DraftModel.from_pretrained(args.drafter)
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot load the drafter {args.drafter}: {err}") from None
    names = {"arch", "draft_vocab_size", "ttt_steps", "steps", "epochs", "acceptance_steps", "lr", "batch_size",
             "grad_accum", "max_length", "answer_max_new_tokens", "answer_temperature", "mixed_precision",
             "save_every", "feature_cache", "resume", "seed", "max_turns", "distill_batch_size", "token_budget",
             "tune_prompts", "loss_decay", "lk_eta", "answers"}
    config = TrainingConfig(**{name: getattr(args, name) for name in names})
    with removed_on_failure(args.out, resumable) if PartialState().is_main_process else contextlib.nullcontext():
        train_drafter(target, args.data, args.out, tokenizer=tokenizer, drafter=drafter, config=config)
    print(f"saved the drafter to {Path(args.out)}")
