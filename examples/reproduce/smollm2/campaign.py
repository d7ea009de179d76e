"""The real pair's training campaign: both drafters continued in lockstep over the rest of ShareGPT (resumable).

    python examples/reproduce/smollm2/campaign.py data                 # ShareGPT's own answers, every turn, chunked (~1 min)
    python examples/reproduce/smollm2/campaign.py distill &            # the target's own answers, one thread; stop and rerun at will
    python examples/reproduce/smollm2/campaign.py train --run round2 --hours 2   # train until then, checkpointing; rerun to go on
    python examples/reproduce/smollm2/campaign.py curve --run round2   # evaluate new snapshots: the learning curve, table and plot
    python examples/reproduce/smollm2/campaign.py mtbench --run round2 --step 750   # vs the shipped pair

Lockstep: the target computes the features of a batch once, and EAGLE-3 and EAGLE 3.1 each take one
optimizer step on it. Same data, order, steps, seed and schedule: only the two 3.1 switches differ, so
the two drafters have equal budgets at every point of the curve. Every run starts from the shipped drafters.
Runs (`RUNS`): round 1 trained on ShareGPT's own answers at a peak rate of 3e-4 and stayed flat; round 2
trains at 1e-4 and takes half its steps from the target's own answers (self-distilled by `distill`, which
runs beside it on the other core: when it falls behind, the step takes ShareGPT's answers instead); round 3
is round 2 with both draft vocabularies widened from 8,192 to 16,384 tokens (`widen_draft_vocab`: the shipped
vocabulary covers 87-93% of the answer tokens of fresh conversations); round 4 is round 2 with training-time test
unrolled 7 steps (EAGLE-3's) instead of 4; round 5 is round 2 with the LK-lambda loss (eta 3) instead of forward
KL; round 7 is round 6 (round 2 again, below) with a second decoder layer stacked on each drafter, starting as
the identity (`add_decoder_layers`), and round 8 is round 7 with that layer at a peak rate of 1e-3. Rounds 3-5, 7 and 8
are levers, each measured against round 2 or 6 on the same batches; round 9 is round 6 on the target's own answers
alone (round 1 took ShareGPT's alone, rounds 2 and 6 half and half).
Every `--snapshot-every` steps both drafters are saved as a snapshot; `curve` evaluates the snapshots not
yet measured, teacher-forced on the 48 held-out answers the target wrote (`train.py evaluate`'s measure:
greedy tau of an 8-token chain) and live (greedy `generate` with a fixed chain of 8 on 8 held-out questions,
128 new tokens each), each a row of `campaign/curve.csv`. Evaluating runs apart from training
(about 12 CPU-minutes a snapshot), when the CPU is free, so training never waits for it.
The conversations are those of distill.py's training split that neither earlier round used: the first
1,920 were self-distilled (distilled/), 7,680-9,215 given in round 2 of the shipped drafters' training.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from distill import PROMPTS, conversations
from train import calibration_prompts, chat_prompts
from hf_eagle31 import drafting_dtype
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.packaged import load_packaged_model
from hf_eagle31.training.capacity import add_decoder_layers
from hf_eagle31.training.data import EpochShuffle, TrainingSequence, collate, fit_length, load_sequences, read_jsonl
from hf_eagle31.training.distill import DistillSettings, distill_to_folder
from hf_eagle31.training.evaluation import evaluate_acceptance
from hf_eagle31.training.teacher import target_states
from hf_eagle31.training.trainer import TrainingConfig, lr_factor, training_step
from hf_eagle31.training.ttt import Unrolled
from hf_eagle31.training.vocab import token_counts, widen_draft_vocab

HERE = Path(__file__).resolve().parents[2] / "smollm2"  # the shipped pair: weights, data, prompts
TARGET = "smollm2-135m-instruct"
DRAFTERS = ("eagle3", "eagle31")  # shipped folders, trained side by side
USED = [(0, 1920), (7680, 9216)]  # conversations of the training split earlier rounds trained on
EARLIER_TOKENS = 5 * 452_849 + 854_394  # answer tokens each shipped drafter saw before the campaign (README)
SETTINGS = DistillSettings(max_length=1024, max_new_tokens=256, max_turns=None, batch_size=32)
SELF_SETTINGS = DistillSettings(max_length=1024, max_new_tokens=256, max_turns=2, batch_size=32)  # as distilled/
GIVEN_CHUNK, SELF_CHUNK = 256, 128  # conversations a chunk
SPLIT = 8192  # fresh conversations past this one are left to self-distillation (round 2 trains on given ones below)
BATCH, WARMUP, SEED = 2, 100, 0
CURVE = HERE / "campaign" / "curve.csv"
OWN = HERE / "campaign" / "selfdistilled"  # the target's own answers: token ids, committed (hours of CPU each)
COLUMNS = ["run", "step", "sequences", "answer_tokens", "self_distilled_tokens", "total_answer_tokens", "cpu_hours",
           "eagle3_tau", "eagle31_tau", "eagle3_acc1", "eagle31_acc1", "eagle3_live_tau", "eagle31_live_tau"]
LIVE_QUESTIONS, LIVE_TOKENS, LIVE_CHAIN = 8, 128, 8  # live tau: generate on held-out questions, a fixed chain


@dataclass(frozen=True)
class Run:
    lr: float  # peak learning rate
    self_distilled: float  # share of steps on the target's own answers (as far as the distiller has written them)
    given_conversations: int | None  # the fresh conversations whose ShareGPT answers the run trains on (None: all)
    draft_vocab: int = 8192  # draft vocabulary: the shipped drafters' 8,192 tokens, or widened to more first
    ttt_steps: int = 4  # draft steps unrolled in training (the shipped drafters': 4; EAGLE-3's: 7)
    lk_eta: float | None = None  # the LK-lambda loss with this eta instead of forward KL (losses.py)
    layers: int = 1  # decoder layers: the shipped drafters' one, or more stacked after it first (capacity.py)
    stacked_lr: float | None = None  # peak learning rate of the stacked layers (None: `lr`, as every other weight)

    def config(self) -> TrainingConfig:
        return TrainingConfig(ttt_steps=self.ttt_steps, steps=1, loss_decay=0.8, lk_eta=self.lk_eta)  # training_step's


RUNS = {"round1": Run(3e-4, 0.0, None), "round2": Run(1e-4, 0.5, SPLIT), "round3": Run(1e-4, 0.5, SPLIT, 16384),
        "round4": Run(1e-4, 0.5, SPLIT, ttt_steps=7), "round5": Run(1e-4, 0.5, SPLIT, lk_eta=3.0),
        "round6": Run(1e-4, 0.5, SPLIT),  # round 2 again from the shipped drafters (its state was lost with runs/),
        # its own answers now written by the bf16 target: at equal steps it measures whether they teach alike
        "round7": Run(1e-4, 0.5, SPLIT, layers=2),  # round 6 with a second decoder layer (the capacity lever)
        "round8": Run(1e-4, 0.5, SPLIT, layers=2, stacked_lr=1e-3),  # round 7, the new layer learning 10x faster
        "round9": Run(1e-4, 1.0, SPLIT)}  # round 6 on the target's own answers only (the data's other end: round 1)


def fresh_conversations() -> list:
    """The training split's conversations that no earlier round used, in a fixed order."""
    train, _, _ = conversations(PROMPTS, 200, 1500)
    taken = {i for start, end in USED for i in range(start, end)}
    return [c for i, c in enumerate(train) if i not in taken]


def data(folder: Path) -> None:
    """ShareGPT's own answers to every fresh conversation, all turns that fit 1,024 tokens."""
    target, tokenizer = load_packaged_model(TARGET)
    _, report = distill_to_folder(target, tokenizer, fresh_conversations(), folder / "data", SETTINGS,
                                  chunk_size=GIVEN_CHUNK, answers="given")
    print(json.dumps(report.__dict__))


def distill(process: int, processes: int) -> None:
    """The target's own greedy answers (first two turns, as in distilled/) to the fresh conversations past SPLIT,
    written by the target in bf16, at one thread beside training, a chunk at a time with its CPU time (`cpu.log`:
    the chunk log's seconds are wall time, which counts the pauses for quiet measurements). Chunks are written whole
    into `OWN`, committed: stop at will, rerun (in any later session). With `processes` > 1 this process writes the
    chunks `i` with `i % processes == process`, so that more cores distil at once."""
    torch.set_num_threads(1)
    target, tokenizer = load_packaged_model(TARGET)
    target.to(torch.bfloat16)  # 1.8x the fp32 rate here (AVX-512 BF16), as EAGLE regenerates its data in bf16 on GPUs
    pool, out = fresh_conversations()[SPLIT:], OWN

    def mine() -> set[int]:  # the numbers of this process's chunks written so far
        return {n for n in (int(p.stem[6:]) for p in out.glob("chunk_*.jsonl")) if n % processes == process}

    while True:
        before, started = mine(), time.process_time()
        done = sum(sum(s.loss_mask) for path in out.glob("chunk_*.jsonl") for s in load_sequences(path))
        distill_to_folder(target, tokenizer, pool, out, SELF_SETTINGS, token_budget=done + 1, chunk_size=SELF_CHUNK,
                          process_index=process, num_processes=processes)
        written = mine() - before
        if not written:  # the budget stops it after one more chunk: none means every chunk of this process is done
            return
        with (out / "cpu.log").open("a") as log:
            log.write(json.dumps({"chunk": written.pop(), "cpu_seconds": time.process_time() - started}) + "\n")


def given_batches(folder: Path, run: Run) -> list[list[TrainingSequence]]:
    chunks = sorted((folder / "data").glob("chunk_*.jsonl"))
    if run.given_conversations is not None:
        chunks = chunks[: run.given_conversations // GIVEN_CHUNK]
    return shuffled_batches(fit_length([s for path in chunks for s in load_sequences(path)], SETTINGS.max_length), SEED)


def shuffled_batches(sequences: list[TrainingSequence], seed: int) -> list[list[TrainingSequence]]:
    order = list(EpochShuffle(len(sequences), seed, [len(s.input_ids) for s in sequences], BATCH))
    return [[sequences[i] for i in order[k : k + BATCH]] for k in range(0, len(order), BATCH)]


def campaign_token_counts(folder: Path, vocab_size: int) -> torch.Tensor:
    """Answer-token counts over the data the campaign chose its own words from: ShareGPT's answers to every fresh
    conversation and the target's own answers in distilled/ (fixed files, so a resumed run widens alike)."""
    paths = sorted((folder / "data").glob("chunk_*.jsonl")) + sorted((HERE / "distilled").glob("chunk_*.jsonl"))
    return token_counts([s for path in paths for s in load_sequences(path)], vocab_size)


class SelfDistilled:
    """The distiller's chunks as an append-only stream of batches: each chunk shuffled on its own, so the batches
    already trained on keep their places when the distiller adds chunks (what resuming relies on)."""

    def __init__(self, folder: Path):
        self.folder, self.chunks, self.batches = folder, 0, []

    def __getitem__(self, index: int) -> list[TrainingSequence] | None:
        if index >= len(self.batches):
            paths = sorted(self.folder.glob("chunk_*.jsonl"))
            paths = [p for number, p in enumerate(paths) if p.name == f"chunk_{number:05d}.jsonl"]  # whole from 0 on
            for number, path in enumerate(paths[self.chunks :], self.chunks):
                self.batches += shuffled_batches(fit_length(load_sequences(path), SELF_SETTINGS.max_length), SEED + number)
            self.chunks = len(paths)
        return self.batches[index] if index < len(self.batches) else None

    def seconds_per_token(self) -> float:
        """What the distiller spent per answer token, in CPU time (it counts against the run's budget)."""
        if not (self.folder / "cpu.log").exists():
            return 0.0
        timed = {e["chunk"]: e["cpu_seconds"] for e in read_jsonl(self.folder / "cpu.log")}
        tokens = sum(e["answer_tokens"] for e in read_jsonl(self.folder / "chunks.log") if e["chunk"] in timed)
        return sum(timed.values()) / max(1, tokens)


def train(folder: Path, run_name: str, hours: float, until_step: int | None, snapshot_every: int,
          save_every: int) -> None:
    torch.set_num_threads(1)
    run, work = RUNS[run_name], folder / run_name
    target, _ = load_packaged_model(TARGET)
    target.requires_grad_(False).eval()
    given, own = given_batches(folder, run), SelfDistilled(OWN)
    if run.self_distilled == 1:  # own answers only: every batch the distiller wrote, once (own[0] reads them all)
        total = len(own.batches) if own[0] else 0
    else:  # every given batch once, the own ones between them
        total = int(len(given) / (1 - run.self_distilled))
    last, config = min(total, until_step or total), run.config()
    drafters = {name: Eagle3DraftModel.from_pretrained(HERE / name, dtype=torch.float32) for name in DRAFTERS}
    widen = [d for d in drafters.values() if run.draft_vocab > d.config.draft_vocab_size]
    counts = campaign_token_counts(folder, target.config.vocab_size) if widen else None  # read once for both
    for drafter in drafters.values():
        drafter.set_target_embedding(target.get_input_embeddings())
        if drafter in widen:  # before a saved state loads: the same vocabulary at each start
            widen_draft_vocab(drafter, target, counts, run.draft_vocab)
        add_decoder_layers(drafter, run.layers)  # likewise the same layers (none added for one)
    models = {name: Unrolled(d).train() for name, d in drafters.items()}
    optimizers = {name: torch.optim.AdamW(parameter_groups(drafters[name], run), lr=run.lr, betas=(0.9, 0.95),
                                          weight_decay=0.0) for name in models}
    schedule = {name: torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_factor(s, WARMUP, total))
                for name, o in optimizers.items()}
    state_path = work / "state.pt"
    counts = {"step": 0, "given": 0, "own": 0, "tokens": 0, "own_tokens": 0, "cpu_seconds": 0.0}
    if state_path.exists():
        saved = torch.load(state_path, weights_only=False)
        for name in DRAFTERS:
            drafters[name].load_state_dict(saved[name]["model"])
            optimizers[name].load_state_dict(saved[name]["optimizer"])
            schedule[name].load_state_dict(saved[name]["scheduler"])
        counts |= {"given": saved["step"]} | {k: saved[k] for k in counts if k in saved}  # round 1: given only
    work.mkdir(parents=True, exist_ok=True)
    log = (work / "train_log.csv").open("a")
    stop = time.time() + hours * 3600
    print(f"campaign {run_name}: step {counts['step']} of {total}, until step {last} or {time.ctime(stop)}", flush=True)
    while counts["step"] < last and counts["given"] < len(given) and time.time() < stop:
        started = time.process_time()
        step = counts["step"]
        sequences = own[counts["own"]] if counts["own"] < run.self_distilled * (step + 1) else None
        kind = "given" if sequences is None else "own"
        sequences = sequences or given[counts["given"]]
        batch = collate([s.as_tensors() for s in sequences])
        batch["features"], batch["last_hidden"] = target_states(target, batch["input_ids"], batch["attention_mask"],
                                                                drafters["eagle3"].config.target_layer_ids)
        row = [step + 1]
        for name in DRAFTERS:  # one step each on the same batch: equal budgets at every point
            loss, stats = training_step(models[name], drafters[name], target, batch, config, False)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(models[name].parameters(), 1.0)
            optimizers[name].step(), optimizers[name].zero_grad(), schedule[name].step()
            row += [f"{loss.item():.4f}", f"{stats['acc_0']:.3f}"]
        answer_tokens = int((batch["loss_mask"] * batch["attention_mask"]).sum())
        counts[kind] += 1
        counts["tokens"] += answer_tokens
        counts["own_tokens"] += answer_tokens if kind == "own" else 0
        counts["cpu_seconds"] += time.process_time() - started
        counts["step"] = step = step + 1
        log.write(",".join(map(str, row + [kind])) + "\n"), log.flush()
        if step % 10 == 0:
            print(f"step {step}/{total} answer tokens {counts['tokens']} (own {counts['own_tokens']}) cpu "
                  f"{counts['cpu_seconds'] / 3600:.2f} h eagle3 loss/acc0 {row[1:3]} eagle31 {row[3:5]}", flush=True)
        if step % save_every == 0 or step % snapshot_every == 0:
            save(state_path, drafters, optimizers, schedule, counts)
        if step % snapshot_every == 0:
            snapshot(work / "snapshots" / f"step_{step:06d}", drafters, counts, own.seconds_per_token())
    save(state_path, drafters, optimizers, schedule, counts)


def parameter_groups(drafter: Eagle3DraftModel, run: Run) -> list[dict]:
    """The stacked layers at `run.stacked_lr` when given: they start from nothing, the rest from trained weights."""
    named = list(drafter.named_parameters())
    if run.stacked_lr is None:
        return [{"params": [p for _, p in named]}]
    return [{"params": [p for n, p in named if not n.startswith("layers.")]},
            {"params": [p for n, p in named if n.startswith("layers.")], "lr": run.stacked_lr}]


def save(path: Path, drafters, optimizers, schedule, counts: dict) -> None:
    state = {name: {"model": drafters[name].state_dict(), "optimizer": optimizers[name].state_dict(),
                    "scheduler": schedule[name].state_dict()} for name in DRAFTERS}
    torch.save(state | counts, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)  # a checkpoint exists whole or not at all


def snapshot(folder: Path, drafters: dict, counts: dict, distill_seconds_per_token: float) -> None:
    """Both drafters and the budget spent: training's CPU time plus the distiller's for the own answers used."""
    for name, drafter in drafters.items():
        drafter.save_pretrained(folder / name)
    cpu = counts["cpu_seconds"] + counts["own_tokens"] * distill_seconds_per_token
    (folder / "point.json").write_text(json.dumps({
        "step": counts["step"], "sequences": counts["step"] * BATCH, "answer_tokens": counts["tokens"],
        "self_distilled_tokens": counts["own_tokens"], "cpu_hours": round(cpu / 3600, 2)}))


def curve(folder: Path, run_name: str) -> None:
    """Evaluate the shipped drafters (step 0) and every snapshot of run `run_name` not yet in curve.csv (or lacking a
    column); then the plot."""
    rows = read_curve()
    done = {key for key, row in rows.items() if all(row.get(c) for c in COLUMNS if c != "self_distilled_tokens")}
    points = [(("shipped", 0), None, {"step": 0, "sequences": 0, "answer_tokens": 0, "cpu_hours": 0.0})]
    for snap in sorted((folder / run_name / "snapshots").glob("step_*")):
        if (snap / "point.json").exists():
            point = json.loads((snap / "point.json").read_text())
            points.append(((run_name, point["step"]), snap, point))
    todo = [(key, snap, point) for key, snap, point in points if key not in done]
    if todo:
        target, tokenizer = load_packaged_model(TARGET)
        held_out = load_sequences(HERE / "heldout_answers.jsonl")
        prompts = calibration_prompts(tokenizer, LIVE_QUESTIONS)  # the first questions of held-out conversations
    for key, snap, point in todo:
        row = rows.get(key) or dict(point, run=key[0], total_answer_tokens=EARLIER_TOKENS + point["answer_tokens"])
        for drafter_name in DRAFTERS:  # the columns the row lacks
            drafter = Eagle3DraftModel.from_pretrained((snap or HERE) / drafter_name, dtype=torch.float32)
            if not row.get(f"{drafter_name}_tau"):
                report = evaluate_acceptance(drafter, target, held_out, depth=8)
                row |= {f"{drafter_name}_tau": round(1 + report.greedy_length, 3),
                        f"{drafter_name}_acc1": round(report.acceptance[0], 3)}
            if not row.get(f"{drafter_name}_live_tau"):
                row[f"{drafter_name}_live_tau"] = round(live_tau(target, drafter, prompts), 3)
        rows[key] = row
        write_curve(rows)
        print(f"curve: {row}", flush=True)
    plot_curve(rows)


def live_tau(target, drafter: Eagle3DraftModel, prompts: list[torch.Tensor]) -> float:
    """Tokens per target forward of greedy `generate` with a fixed chain: decoding as users run it, where the
    teacher-forced measure scores the drafter on the target's own answers."""
    drafter.generation_config.update(speculation_mode="chain", num_assistant_tokens=LIVE_CHAIN)
    return pooled_tau(live_counts(target, drafter, prompts))


def pooled_tau(counts: list[tuple[int, int]]) -> float:
    return sum(tokens for tokens, _ in counts) / sum(forwards for _, forwards in counts)


def live_counts(target, drafter: Eagle3DraftModel, prompts: list[torch.Tensor]) -> list[tuple[int, int]]:
    """(tokens, target forwards) of each prompt's greedy `generate`, in the drafter's shape held fixed."""
    drafter.generation_config.update(dynamic_speculation=False, collapse_fallback=False)
    counts = []
    for ids in prompts:
        target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=LIVE_TOKENS,
                        assistant_model=drafter)
        counts.append((drafter.speculation_stats.speculative_tokens, drafter.speculation_stats.speculative_forwards))
    return counts


def mtbench(folder: Path, run_name: str, step: int, questions: int) -> None:
    """Live tau on MT-Bench's first turns, a snapshot's drafters against the shipped ones, paired question by
    question: the benchmark's measure, both in the shipped drafter's tuned shape (held fixed; a snapshot keeps the
    shape its run started from, which a later re-tune of the shipped drafter may have changed) and decoding dtype."""
    target, tokenizer = load_packaged_model(TARGET)
    turns = [json.loads(line)["turns"][0] for line in (HERE / "prompts" / "mt_bench.jsonl").open()][:questions]
    prompts = chat_prompts(tokenizer, turns)
    snapshot = folder / run_name / "snapshots" / f"step_{step:06d}"
    for name in DRAFTERS:
        taus, shape = [], None
        for path in (HERE / name, snapshot / name):
            drafter = Eagle3DraftModel.from_pretrained(path).to(drafting_dtype(target))
            shape = drafter.generation_config if shape is None else shape  # the shipped drafter's, loaded first
            drafter.generation_config = shape
            counts = live_counts(target, drafter, prompts)
            taus.append([t / f for t, f in counts])
            print(f"{name} {path}: tau {pooled_tau(counts):.3f}", flush=True)
        gains = [new - old for old, new in zip(*taus)]
        spread = statistics.stdev(gains) / len(gains) ** 0.5
        print(f"{name}: snapshot - shipped, per question: {statistics.mean(gains):+.3f} +- {spread:.3f} (standard "
              f"error), higher on {sum(g > 0 for g in gains)} of {len(gains)}", flush=True)


def read_curve() -> dict[tuple[str, int], dict]:
    rows = csv.DictReader(CURVE.open()) if CURVE.exists() else []
    return {(row["run"], int(row["step"])): row for row in rows}


def write_curve(rows: dict[tuple[str, int], dict]) -> None:
    CURVE.parent.mkdir(exist_ok=True)
    with CURVE.open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(rows[key] for key in sorted(rows, key=lambda k: (k[0] != "shipped", k)))


def plot_curve(rows: dict[tuple[str, int], dict]) -> None:
    """Teacher-forced and live tau against answer tokens seen: a line per drafter (colour) and run (line style),
    each from the shipped drafters' point; one legend below for both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    dashes = ("-", "--", ":", "-.", (0, (1, 4)), (0, (5, 1, 1, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (8, 2)), (0, (2, 2)))
    if len(RUNS) > len(dashes):
        raise ValueError(f"{len(RUNS)} runs and {len(dashes)} line styles: add styles to plot every run")
    start, styles = rows[("shipped", 0)], dict(zip(RUNS, dashes))
    drafters = {"eagle3": ("EAGLE-3", "tab:blue"), "eagle31": ("EAGLE 3.1", "tab:orange")}
    plotted = [run for run in RUNS if any(key[0] == run for key in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), sharex=True)
    for ax, measure, title in zip(axes, ("tau", "live_tau"), ("teacher-forced", "live (generate)")):
        for run in plotted:
            points = [start] + [rows[key] for key in sorted(rows) if key[0] == run]
            for drafter, (_, color) in drafters.items():
                ax.plot([int(r["total_answer_tokens"]) / 1e6 for r in points],
                        [float(r[f"{drafter}_{measure}"]) for r in points], marker="o", linestyle=styles[run],
                        color=color)
        ax.set_title(f"held-out tau, {title}, chain of 8")
        ax.set_xlabel("answer tokens seen (M; the shipped drafters' 3.12M included)")
    handles = [Line2D([], [], color=color, marker="o", label=label) for label, color in drafters.values()]
    handles += [Line2D([], [], color="black", linestyle=styles[run], label=f"{run}: {describe(RUNS[run])}")
                for run in plotted]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.02 + 0.035 * ((len(handles) + 1) // 2), 1, 1))
    fig.savefig(CURVE.with_suffix(".png"), dpi=120)
    plt.close(fig)


def describe(run: Run) -> str:
    return (f"lr {run.lr:.0e}, {run.self_distilled:.0%} own answers, {run.draft_vocab:,} draft tokens, "
            f"unroll {run.ttt_steps}{'' if run.lk_eta is None else f', LK loss (eta {run.lk_eta:g})'}"
            f"{'' if run.layers == 1 else f', {run.layers} decoder layers'}"
            f"{'' if run.stacked_lr is None else f' (learning at {run.stacked_lr:.0e})'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["data", "distill", "train", "curve", "mtbench"])
    parser.add_argument("--run", choices=RUNS, default="round2", help="train, curve: which run (RUNS)")
    parser.add_argument("--folder", type=Path, default=Path("runs/smollm2/campaign"),
                        help="data (ShareGPT's answers, rebuilt by `data`) and each run's checkpoints and snapshots")
    parser.add_argument("--hours", type=float, default=2.0, help="train: stop (checkpointed) after this long")
    parser.add_argument("--process", type=int, default=0, help="distill: this process's index (of --processes)")
    parser.add_argument("--processes", type=int, default=1, help="distill: processes writing chunks at once")
    parser.add_argument("--until-step", type=int, help="train: stop (checkpointed) at this step")
    parser.add_argument("--step", type=int, help="mtbench: the snapshot's step")
    parser.add_argument("--questions", type=int, default=40, help="mtbench: its first questions")
    parser.add_argument("--snapshot-every", type=int, default=500, help="train: steps between points of the curve")
    parser.add_argument("--save-every", type=int, default=50, help="train: steps between checkpoints")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    if args.stage == "data":
        data(args.folder)
    elif args.stage == "distill":
        distill(args.process, args.processes)
    elif args.stage == "train":
        train(args.folder, args.run, args.hours, args.until_step, args.snapshot_every, args.save_every)
    elif args.stage == "mtbench":
        mtbench(args.folder, args.run, args.step, args.questions)
    else:
        curve(args.folder, args.run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
