"""`hf-eagle31 distill`: have the target answer chat prompts, training data written in resumable chunks
(`hf_eagle31.training.distill`)."""

from __future__ import annotations

import argparse

from hf_eagle31.packaged import load_target
from hf_eagle31.training.data import read_examples
from hf_eagle31.training.distill import ANSWERS, DistillSettings, distill_to_folder


def configure_parser(parser: argparse.ArgumentParser) -> None:
    defaults = DistillSettings()
    add = parser.add_argument
    add("--target", required=True, help="the target model (folder, Hub id or packaged name), with its tokenizer")
    add("--data", required=True, help="ShareGPT JSON/JSONL or chat records ('conversations', 'messages', 'turns')")
    add("--out", required=True, help="folder for the chunks; `hf-eagle31 train --data` reads it")
    add("--max-length", type=int, default=defaults.max_length, help="tokens per conversation")
    add("--max-new-tokens", type=int, default=defaults.max_new_tokens, help="tokens per answer")
    add("--max-turns", type=int, help="user turns answered per conversation (default: all that fit)")
    add("--batch-size", type=int, default=defaults.batch_size, help="prompts per generate call")
    add("--temperature", type=float, default=defaults.temperature, help="0: greedy answers")
    add("--token-budget", type=int, help="stop at this many answer tokens; rerun with a larger one to go on")
    add("--chunk-size", type=int, default=256, help="conversations per chunk file (the unit of resumption)")
    add("--answers", choices=ANSWERS, default="target",
        help="target: the target writes every answer; given: the records' own answers (no generation)")


def run(args: argparse.Namespace) -> None:
    target, tokenizer = load_target(args.target)
    if tokenizer is None:
        raise ValueError(f"the target {args.target} has no tokenizer to render the conversations with")
    examples = read_examples(args.data)
    if not examples.conversations:
        raise ValueError(f"{args.data} holds no conversation with a user turn to answer")
    settings = DistillSettings(args.max_length, args.max_new_tokens, args.max_turns, args.batch_size, args.temperature)
    _, report = distill_to_folder(target, tokenizer, examples.conversations, args.out, settings, args.token_budget,
                                  args.chunk_size, answers=args.answers)
    print(f"{args.out}: {report.conversations} conversations, {report.turns} answers, {report.answer_tokens} answer "
          f"tokens ({report.answer_tokens / max(report.seconds, 1e-9):.0f} tokens/s)")
