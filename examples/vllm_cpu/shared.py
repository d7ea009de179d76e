"""What run_ours.py and run_vllm.py share: the held-out questions both engines answer, and the report each writes.

The questions: the first user turn of the first N held-out ShareGPT conversations
(`examples/smollm2/heldout_conversations.jsonl`, never trained on), through the target's chat template with its
default system prompt, as token ids (both engines get the same ids)."""

import argparse
import json
from pathlib import Path

HELDOUT = Path(__file__).parents[1] / "smollm2" / "heldout_conversations.jsonl"


def question_ids(target: str, count: int = 8) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    lines = HELDOUT.read_text().splitlines()[:count]
    chats = [[{"role": "user", "content": json.loads(line)["turns"][0]}] for line in lines]
    return [list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
                 ["input_ids"]) for chat in chats]


def write_report(engine: str, args, rows: list[dict], **extra) -> None:
    """Print the run's summary (tokens/s; with a drafter, acceptance length and accepted counts per draft position)
    and write it with every question's tokens and counters to `args.out`."""
    tokens, seconds = sum(len(r["tokens"]) for r in rows), sum(r["seconds"] for r in rows)
    summary = {"engine": engine, "drafter": args.drafter, "chain": args.tokens if args.drafter else 0,
               "dtype": args.dtype,
               "new_tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2), **extra}
    if args.drafter:
        drafts, accepted = sum(r["drafts"] for r in rows), sum(r["accepted"] for r in rows)
        summary |= {"acceptance_length": round(1 + accepted / max(drafts, 1), 3),
                    "per_position": [sum(p) for p in zip(*(r["per_position"] for r in rows))], "drafts": drafts}
    print(json.dumps(summary))
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "questions": rows}, f)


def run_arguments(description: str, drafter_help: str, tokens_help: str) -> argparse.ArgumentParser:
    """The arguments both runners take, with the same defaults: a comparison needs the same questions and lengths."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="the target's local HF folder")
    parser.add_argument("--drafter", help=f"{drafter_help}; none: target alone")
    parser.add_argument("--tokens", type=int, default=3, help=f"{tokens_help} (chain length)")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the target's dtype")
    parser.add_argument("--out", required=True)
    return parser
