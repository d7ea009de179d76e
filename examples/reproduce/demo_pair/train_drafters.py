"""Train the demo pair's EAGLE-3 and EAGLE 3.1 drafters with the training pipeline: same data, same budget.

    python examples/reproduce/demo_pair/train_drafters.py                 # after train_target.py; writes eagle3/ and eagle31/
    python examples/reproduce/demo_pair/train_drafters.py --stage train   # training only (~3 h on 2 CPU cores, minutes on a GPU)
    python examples/reproduce/demo_pair/train_drafters.py --stage tune    # then on the CPU the demo runs on

The prompts are openings of Python functions and English paragraphs from the *training* split (the
held-out split only feeds the demo and the benchmarks); the target answers them itself. Both
drafters train on the very same self-distilled sequences, with one shared offline feature cache,
for the same number of steps; only the two EAGLE 3.1 switches differ. The tree shape stored in each
drafter's generation config is tuned on the machine that runs `--stage tune` (the right tree size depends
on the device's verify cost curve), with calibration prompts from the training split. The prompts are
cached in `<work>/prompts.jsonl`, so a machine without `data/train.jsonl` can train from that file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_eagle31  # noqa: F401
from hf_eagle31.model_cards.card import write_model_card
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.training import train_drafter
from hf_eagle31.training.data import encode_prompt, load_sequences, save_sequences, self_distill
from hf_eagle31.tuning import tune_drafter

REPO = Path(__file__).resolve().parents[3]
HERE = Path("examples/demo_pair")  # relative to REPO, where main() runs: shipped files name no machine's paths
TARGET_NAME = str(HERE / "target")  # the cards' base_model: built here, named by its place in the repository
sys.path.insert(0, str(Path(__file__).resolve().parent))  # build_prompts, beside this script
from build_prompts import function_openings, paragraph_openings  # noqa: E402

BUDGET = dict(draft_vocab_size=4096, ttt_steps=6, steps=800, batch_size=16, lr=1e-3, max_length=320, save_every=100,
              seed=0, tune_prompts=0, mixed_precision="bf16" if torch.cuda.is_available() else "no")  # bf16 is slow on CPUs without AMX
ANSWER_TOKENS, ANSWER_BATCH = 128, 64  # the target answers each prompt greedily, 64 prompts per generate call
ARCHITECTURES = (("eagle3", "eagle3"), ("eagle3.1", "eagle31"))  # (--arch, folder)


def training_prompts(count: int, cache: Path) -> list[dict]:
    """Evenly spaced openings from the training split, half code, half prose."""
    if cache.exists():
        return [json.loads(line) for line in cache.read_text().splitlines()][:count]
    records = [json.loads(line) for line in (HERE / "data" / "train.jsonl").read_text().splitlines()]
    code = [p for r in records if r["pool"] == "code" for p in function_openings(r["path"], r["text"])]
    prose = [p for r in records if r["pool"] != "code" for p in paragraph_openings(r["path"], r["text"])]
    pick = lambda items, n: [items[i * len(items) // n] for i in range(min(n, len(items)))]  # noqa: E731
    prompts = [{"turns": [p["text"]]} for p in pick(code, count // 2) + pick(prose, count - count // 2)]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return prompts


def distill(target, tokenizer, prompts: list[dict], saved: Path) -> list[dict]:
    """The target's own answers, computed once so both drafters train on exactly the same sequences."""
    if not saved.exists():
        ids = sorted((encode_prompt(tokenizer, p["turns"][0]) for p in prompts), key=len)  # less padding per batch
        save_sequences(self_distill(target, ids, ANSWER_TOKENS, ANSWER_BATCH, pad_token_id=tokenizer.pad_token_id), saved)
    return [{"input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in load_sequences(saved)]


def train(target, tokenizer, prompts: list[dict], work: Path, steps: int) -> None:
    budget = {**BUDGET, "steps": steps, "feature_cache": str(work / "features")}
    data = distill(target, tokenizer, prompts, work / "distilled.jsonl")
    for arch, name in ARCHITECTURES:
        drafter = train_drafter(target, data, work / name, tokenizer, arch=arch, **budget)
        drafter.to("cpu", torch.bfloat16).save_pretrained(HERE / name)
        for file in ("training_args.json", "train_log.csv"):
            if (work / name / file).exists():
                (HERE / name / file).write_text((work / name / file).read_text())
        write_model_card(HERE / name, base_model=TARGET_NAME, local_base_model=True)


def tune(target, tokenizer, prompts: list[dict]) -> None:
    calibration = [tokenizer(p["turns"][0], return_tensors="pt").input_ids for p in prompts[:: max(1, len(prompts) // 6)][:6]]
    for _, name in ARCHITECTURES:
        drafter = Eagle3DraftModel.from_pretrained(HERE / name).to(target.dtype)
        report = tune_drafter(target, drafter, calibration)
        drafter.to(torch.bfloat16).save_pretrained(HERE / name)  # bf16 on disk, as shipped
        (HERE / name / "tuning.json").write_text(json.dumps(report.as_dict(), indent=2, default=str))
        write_model_card(HERE / name, base_model=TARGET_NAME, local_base_model=True)
        print(f"{name}: chosen {report.choice}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="runs/demo_drafters", help="training runs, logs and the feature cache")
    parser.add_argument("--prompts", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=BUDGET["steps"])
    parser.add_argument("--stage", choices=["all", "train", "tune"], default="all")
    args = parser.parse_args()
    os.chdir(REPO)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = AutoModelForCausalLM.from_pretrained(HERE / "target", dtype=torch.float32, device_map=device).eval()  # fp32, as the demo runs it
    tokenizer = AutoTokenizer.from_pretrained(HERE / "target")
    work = Path(args.work)
    prompts = training_prompts(args.prompts, work / "prompts.jsonl")
    if args.stage in ("all", "train"):
        train(target, tokenizer, prompts, work, args.steps)
    if args.stage in ("all", "tune"):
        tune(target.to("cpu"), tokenizer, prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
