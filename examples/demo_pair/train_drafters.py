"""Train the demo pair's EAGLE-3 and EAGLE 3.1 drafters with the training pipeline: same data, same budget.

    python examples/demo_pair/train_drafters.py      # after train_target.py; writes eagle3/ and eagle31/

The prompts are openings of Python functions and English paragraphs from the *training* split (the
held-out split only feeds the demo and the benchmarks); the target answers them itself. Both
drafters train on the very same self-distilled sequences, with one shared offline feature cache,
for the same number of steps; only the two EAGLE 3.1 switches differ. The tree shape stored in each
drafter's generation config is tuned on this machine with calibration prompts from the training split.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_eagle31  # noqa: F401
from hf_eagle31.model_cards.card import write_model_card
from hf_eagle31.training import train_drafter
from hf_eagle31.training.data import load_sequences
from hf_eagle31.training.trainer import DISTILLED
from hf_eagle31.tuning import apply_choice, choose_tree_shape

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from build_prompts import function_openings, paragraph_openings  # noqa: E402

BUDGET = dict(draft_vocab_size=4096, ttt_steps=6, steps=1500, batch_size=8, lr=1e-3, max_length=384,
              answer_max_new_tokens=160, save_every=250, seed=0)


def training_prompts(count: int) -> list[dict]:
    """Evenly spaced openings from the training split, half code, half prose."""
    records = [json.loads(line) for line in (HERE / "data" / "train.jsonl").read_text().splitlines()]
    code = [p for r in records if r["pool"] == "code" for p in function_openings(r["path"], r["text"])]
    prose = [p for r in records if r["pool"] != "code" for p in paragraph_openings(r["path"], r["text"])]
    pick = lambda items, n: [items[i * len(items) // n] for i in range(min(n, len(items)))]  # noqa: E731
    return [{"turns": [p["text"]]} for p in pick(code, count // 2) + pick(prose, count - count // 2)]


def tune_shape(target, drafter, tokenizer, prompts: list[dict]) -> dict:
    drafter.generation_config.update(speculation_mode="tree", dynamic_speculation=False, tree_depth=8,
                                     tree_total_tokens=64, collapse_fallback=False)
    ranks = []
    for record in prompts:
        ids = tokenizer(record["turns"][0], return_tensors="pt").input_ids
        target.generate(ids, do_sample=False, max_new_tokens=96, assistant_model=drafter)
        ranks += drafter.speculation_stats.accepted_ranks
    report = choose_tree_shape(target, drafter, ranks, top_k=10, max_depth=8, max_tokens=64)
    drafter.generation_config.update(dynamic_speculation=True, collapse_fallback=True)
    apply_choice(drafter, report)
    return report.as_dict()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="runs/demo_drafters", help="training runs, logs and the feature cache")
    parser.add_argument("--prompts", type=int, default=800)
    parser.add_argument("--steps", type=int, default=BUDGET["steps"])
    args = parser.parse_args()
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(HERE / "target", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(HERE / "target")
    prompts = training_prompts(args.prompts)
    work = Path(args.work)
    budget = {**BUDGET, "steps": args.steps, "feature_cache": str(work / "features")}
    data = prompts
    for arch, name in (("eagle3", "eagle3"), ("eagle3.1", "eagle31")):
        drafter = train_drafter(target, data, work / name, tokenizer, arch=arch, **budget)
        data = [{"input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in load_sequences(work / "eagle3" / DISTILLED)]
        tuning = tune_shape(target, drafter, tokenizer, prompts[:: max(1, len(prompts) // 6)][:6])
        drafter = drafter.to(torch.bfloat16)
        drafter.save_pretrained(HERE / name)
        (HERE / name / "tuning.json").write_text(json.dumps(tuning, indent=2, default=str))
        for file in ("training_args.json", "train_log.csv"):
            if (work / name / file).exists():
                (HERE / name / file).write_text((work / name / file).read_text())
        write_model_card(HERE / name)
        print(f"{name}: chosen tree {tuning['choice']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
