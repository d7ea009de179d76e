"""The real pair's training campaign: both drafters continued in lockstep over the rest of ShareGPT (resumable).

    python examples/smollm2/campaign.py data                 # ShareGPT's own answers, every turn, chunked (~1 min)
    python examples/smollm2/campaign.py train --hours 2      # train until then, checkpointing; rerun to go on
    python examples/smollm2/campaign.py curve                # evaluate new snapshots: the learning curve, table and plot

Lockstep: the target computes the features of a batch once, and EAGLE-3 and EAGLE 3.1 each take one
optimizer step on it. Same data, order, steps, seed and schedule: only the two 3.1 switches differ, so
the two drafters have equal budgets at every point of the curve. Both start from the shipped drafters.
Every `--snapshot-every` steps both drafters are saved as a snapshot; `curve` evaluates the snapshots not
yet measured, teacher-forced on the 48 held-out answers the target wrote (`train.py evaluate`'s measure:
greedy tau of an 8-token chain) and live (greedy `generate` with a fixed chain of 8 on 8 held-out questions,
128 new tokens each), each a row of `campaign/curve.csv`. Evaluating runs apart from training
(about 12 CPU-minutes a snapshot), when the CPU is free, so training never waits for it.
The conversations are those of distill.py's training split that neither earlier round used: the first
1,920 were self-distilled (distilled/), 7,680-9,215 given in round 2.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import torch

from distill import PROMPTS, conversations
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.packaged import load_packaged_model
from hf_eagle31.training.data import EpochShuffle, collate, fit_length, load_sequences
from hf_eagle31.training.distill import DistillSettings, distill_to_folder, load_distilled
from hf_eagle31.training.evaluation import evaluate_acceptance
from hf_eagle31.training.teacher import target_states
from hf_eagle31.training.trainer import TrainingConfig, lr_factor, training_step
from hf_eagle31.training.ttt import Unrolled

HERE = Path(__file__).parent
TARGET = "smollm2-135m-instruct"
DRAFTERS = ("eagle3", "eagle31")  # shipped folders, trained side by side
USED = [(0, 1920), (7680, 9216)]  # conversations of the training split earlier rounds trained on
EARLIER_TOKENS = 5 * 452_849 + 854_394  # answer tokens each shipped drafter saw before the campaign (README)
SETTINGS = DistillSettings(max_length=1024, max_new_tokens=256, max_turns=None, batch_size=32)
CONFIG = TrainingConfig(ttt_steps=4, steps=1, loss_decay=0.8)  # what training_step reads
BATCH, LR, WARMUP, SEED = 2, 3e-4, 100, 0
CURVE = HERE / "campaign" / "curve.csv"
COLUMNS = ["step", "sequences", "answer_tokens", "total_answer_tokens", "cpu_hours",
           "eagle3_tau", "eagle31_tau", "eagle3_acc1", "eagle31_acc1", "eagle3_live_tau", "eagle31_live_tau"]
LIVE_QUESTIONS, LIVE_TOKENS, LIVE_CHAIN = 8, 128, 8  # live tau: generate on held-out questions, a fixed chain


def data(work: Path) -> None:
    """ShareGPT's own answers to every conversation no earlier round used, all turns that fit 1,024 tokens."""
    train, _, _ = conversations(PROMPTS, 200, 1500)
    taken = {i for start, end in USED for i in range(start, end)}
    fresh = [c for i, c in enumerate(train) if i not in taken]
    target, tokenizer = load_packaged_model(TARGET)
    _, report = distill_to_folder(target, tokenizer, fresh, work / "data", SETTINGS, chunk_size=256, answers="given")
    print(json.dumps(report.__dict__))


def train(work: Path, hours: float, snapshot_every: int, save_every: int) -> None:
    torch.set_num_threads(1)
    target, _ = load_packaged_model(TARGET)
    target.requires_grad_(False).eval()
    sequences = fit_length(load_distilled(work / "data")[0], SETTINGS.max_length)
    order = list(EpochShuffle(len(sequences), SEED, [len(s.input_ids) for s in sequences], BATCH))
    batches = [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
    drafters = {name: Eagle3DraftModel.from_pretrained(HERE / name, dtype=torch.float32) for name in DRAFTERS}
    for drafter in drafters.values():
        drafter.set_target_embedding(target.get_input_embeddings())
    models = {name: Unrolled(d).train() for name, d in drafters.items()}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
                  for name, m in models.items()}
    schedule = {name: torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_factor(s, WARMUP, len(batches)))
                for name, o in optimizers.items()}
    state_path = work / "state.pt"
    step, tokens, cpu = 0, 0, 0.0
    if state_path.exists():
        saved = torch.load(state_path, weights_only=False)
        for name in DRAFTERS:
            drafters[name].load_state_dict(saved[name]["model"])
            optimizers[name].load_state_dict(saved[name]["optimizer"])
            schedule[name].load_state_dict(saved[name]["scheduler"])
        step, tokens, cpu = saved["step"], saved["tokens"], saved["cpu_seconds"]
    log = (work / "train_log.csv").open("a")
    stop = time.time() + hours * 3600
    print(f"campaign: step {step} of {len(batches)} ({len(sequences)} sequences), until {time.ctime(stop)}", flush=True)
    while step < len(batches) and time.time() < stop:
        started = time.process_time()
        batch = collate([sequences[i].as_tensors() for i in batches[step]])
        batch["features"], batch["last_hidden"] = target_states(target, batch["input_ids"], batch["attention_mask"],
                                                                drafters["eagle3"].config.target_layer_ids)
        row = [step + 1]
        for name in DRAFTERS:  # one step each on the same batch: equal budgets at every point
            loss, stats = training_step(models[name], drafters[name], target, batch, CONFIG, False)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(models[name].parameters(), 1.0)
            optimizers[name].step(), optimizers[name].zero_grad(), schedule[name].step()
            row += [f"{loss.item():.4f}", f"{stats['acc_0']:.3f}"]
        tokens += int((batch["loss_mask"] * batch["attention_mask"]).sum())
        cpu += time.process_time() - started
        step += 1
        log.write(",".join(map(str, row)) + "\n"), log.flush()
        if step % 10 == 0:
            print(f"step {step}/{len(batches)} answer tokens {tokens} cpu {cpu / 3600:.2f} h "
                  f"eagle3 loss/acc0 {row[1:3]} eagle31 {row[3:]}", flush=True)
        if step % save_every == 0 or step % snapshot_every == 0 or step == len(batches):
            save(state_path, drafters, optimizers, schedule, step, tokens, cpu)
        if step % snapshot_every == 0 or step == len(batches):
            snapshot(work / "snapshots" / f"step_{step:06d}", drafters, step, tokens, cpu)
    save(state_path, drafters, optimizers, schedule, step, tokens, cpu)


def save(path: Path, drafters, optimizers, schedule, step: int, tokens: int, cpu: float) -> None:
    state = {name: {"model": drafters[name].state_dict(), "optimizer": optimizers[name].state_dict(),
                    "scheduler": schedule[name].state_dict()} for name in DRAFTERS}
    torch.save(state | {"step": step, "tokens": tokens, "cpu_seconds": cpu}, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)  # a checkpoint exists whole or not at all


def snapshot(folder: Path, drafters: dict, step: int, tokens: int, cpu: float) -> None:
    for name, drafter in drafters.items():
        drafter.save_pretrained(folder / name)
    (folder / "point.json").write_text(json.dumps({"step": step, "sequences": step * BATCH, "answer_tokens": tokens,
                                                   "cpu_hours": round(cpu / 3600, 2)}))


def curve(work: Path) -> None:
    """Evaluate the shipped drafters (step 0) and every snapshot not yet in curve.csv (or lacking a column); then
    the plot."""
    rows = {int(row["step"]): row for row in csv.DictReader(CURVE.open())} if CURVE.exists() else {}
    done = {step for step, row in rows.items() if all(row.get(c) for c in COLUMNS)}
    points = [(0, None, {"step": 0, "sequences": 0, "answer_tokens": 0, "cpu_hours": 0.0})]
    points += [(int(json.loads((f / "point.json").read_text())["step"]), f, json.loads((f / "point.json").read_text()))
               for f in sorted((work / "snapshots").glob("step_*")) if (f / "point.json").exists()]
    todo = [(folder, point) for step, folder, point in points if step not in done]
    if todo:
        target, tokenizer = load_packaged_model(TARGET)
        held_out = load_sequences(HERE / "heldout_answers.jsonl")
        questions = [json.loads(line)["turns"][0] for line in
                     (HERE / "heldout_conversations.jsonl").read_text().splitlines()[:LIVE_QUESTIONS]]
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True)["input_ids"] for q in questions]
    for folder, point in todo:
        row = rows.get(point["step"]) or dict(point, total_answer_tokens=EARLIER_TOKENS + point["answer_tokens"])
        for name in DRAFTERS:  # the columns the row lacks
            drafter = Eagle3DraftModel.from_pretrained((folder or HERE) / name, dtype=torch.float32)
            if not row.get(f"{name}_tau"):
                report = evaluate_acceptance(drafter, target, held_out, depth=8)
                row |= {f"{name}_tau": round(1 + report.greedy_length, 3),
                        f"{name}_acc1": round(report.acceptance[0], 3)}
            if not row.get(f"{name}_live_tau"):
                row[f"{name}_live_tau"] = round(live_tau(target, drafter, prompts), 3)
        write_curve_row(row)
    plot_curve()


def live_tau(target, drafter: Eagle3DraftModel, prompts: list[torch.Tensor]) -> float:
    """Tokens per target forward of greedy `generate` with a fixed chain: decoding as users run it, where the
    teacher-forced measure scores the drafter on the target's own answers."""
    drafter.generation_config.update(speculation_mode="chain", num_assistant_tokens=LIVE_CHAIN,
                                     dynamic_speculation=False, collapse_fallback=False)
    tokens = forwards = 0
    for ids in prompts:
        target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=LIVE_TOKENS,
                        assistant_model=drafter)
        tokens += drafter.speculation_stats.speculative_tokens
        forwards += drafter.speculation_stats.speculative_forwards
    return tokens / forwards


def write_curve_row(row: dict) -> None:
    rows = [r for r in csv.DictReader(CURVE.open()) if int(r["step"]) != int(row["step"])] if CURVE.exists() else []
    rows = sorted(rows + [row], key=lambda r: int(r["step"]))
    CURVE.parent.mkdir(exist_ok=True)
    with CURVE.open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"curve: {row}", flush=True)


def plot_curve() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(CURVE.open()))
    tokens = [int(r["total_answer_tokens"]) / 1e6 for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for (name, label), color in zip((("eagle3", "EAGLE-3"), ("eagle31", "EAGLE 3.1")), ("tab:blue", "tab:orange")):
        ax.plot(tokens, [float(r[f"{name}_tau"]) for r in rows], marker="o", color=color,
                label=f"{label}, teacher-forced")
        ax.plot(tokens, [float(r[f"{name}_live_tau"]) for r in rows], marker="s", linestyle="--", color=color,
                label=f"{label}, live (generate)")
    ax.set_xlabel("answer tokens seen (millions, shipped drafters' 3.12M included)")
    ax.set_ylabel("held-out tau (chain of 8)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(CURVE.with_suffix(".png"), dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["data", "train", "curve"])
    parser.add_argument("--work", type=Path, default=Path("runs/smollm2/campaign"), help="data and checkpoints")
    parser.add_argument("--hours", type=float, default=2.0, help="train: stop (checkpointed) after this long")
    parser.add_argument("--snapshot-every", type=int, default=500, help="train: steps between points of the curve")
    parser.add_argument("--save-every", type=int, default=50, help="train: steps between checkpoints")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.stage == "data":
        data(args.work)
    elif args.stage == "train":
        train(args.work, args.hours, args.snapshot_every, args.save_every)
    else:
        curve(args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
