"""Train the demo target (20-layer Llama) or the baseline small LM (2-layer Llama) from scratch on CPU.

Both read the same token stream: documents from data/train.jsonl as `<s> text </s>`, one stream
per pool (Python code, English docs), and every batch takes half its windows from each pool so
neither drowns the other. The held-out split gives the reported loss and perplexity.

The target is deep and narrow on purpose: on a CPU a 1-token forward costs mostly per-layer
overhead, so 20 layers at width 256 make a target forward ~8x a 1-layer drafter's while staying
within ~34 MB in bf16 (see measure_shapes.py). Training runs fp32 weights under bf16 autocast
(~3x faster than fp32 here) and checkpoints every --ckpt-every steps; --resume picks up the last one.
`--device cuda` trains on a GPU instead (the shipped small LM was trained that way: same data, same steps).

    nice -n 15 python examples/reproduce/demo_pair/train_target.py --preset target
    nice -n 15 python examples/reproduce/demo_pair/train_target.py --preset small_lm
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    get_cosine_with_min_lr_schedule_with_warmup,
)

HERE = Path(__file__).resolve().parents[2] / "demo_pair"  # the shipped pair and its data
POOLS = ("code", "text")
SHAPES = {
    "target": dict(hidden_size=256, num_hidden_layers=20, intermediate_size=704),
    "small_lm": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512),
}
DEFAULT_STEPS = {"target": 1600, "small_lm": 1200}
SAMPLE_PROMPTS = ("def _read_header(self, fp):", "The following options are supported:")


def token_streams(data: Path, split: str, tokenizer: PreTrainedTokenizerBase) -> dict[str, np.ndarray]:
    """One flat uint16 array of `<s> doc </s>` per pool, cached next to the text."""
    streams = {}
    for pool in POOLS:
        cache = data / f"tokens_{split}_{pool}.npy"
        if not cache.exists():
            with (data / f"{split}.jsonl").open() as lines:
                docs = [doc["text"] for doc in map(json.loads, lines) if doc["pool"] == pool]
            ids = tokenizer(docs)["input_ids"]
            np.save(cache, np.fromiter((t for doc in ids for t in doc + [tokenizer.eos_token_id]), np.uint16))
        streams[pool] = np.load(cache)
    return streams


def sample_batch(streams: dict[str, np.ndarray], batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    rows = []
    for pool in POOLS:
        stream = streams[pool]
        for start in torch.randint(0, len(stream) - seq, (batch // len(POOLS),), generator=gen).tolist():
            rows.append(torch.from_numpy(stream[start : start + seq].astype(np.int64)))
    return torch.stack(rows)


def eval_windows(streams: dict[str, np.ndarray], seq: int, count: int) -> dict[str, torch.Tensor]:
    """`count` windows per pool spread evenly over the held-out stream; fixed, so evals compare."""
    windows = {}
    for pool, stream in streams.items():
        starts = np.linspace(0, len(stream) - seq, count).astype(np.int64)
        windows[pool] = torch.from_numpy(np.stack([stream[s : s + seq] for s in starts]).astype(np.int64))
    return windows


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, windows: dict[str, torch.Tensor], batch: int) -> dict[str, float]:
    model.eval()
    losses = {}
    for pool, ids in windows.items():
        total = 0.0
        for chunk in ids.split(batch):
            chunk = chunk.to(model.device)
            with torch.autocast(model.device.type, dtype=torch.bfloat16):
                total += model(chunk, labels=chunk).loss.item() * len(chunk)
        losses[pool] = total / len(ids)
    losses["mean"] = sum(losses[p] for p in POOLS) / len(POOLS)
    model.train()
    return losses


@torch.no_grad()
def greedy_samples(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, new_tokens: int = 40) -> str:
    model.eval()
    out = []
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").to(model.device)
        gen = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
        out.append(repr(tokenizer.decode(gen[0], skip_special_tokens=True)))
    model.train()
    return "\n".join(out)


def build_model(preset: str, tokenizer: PreTrainedTokenizerBase, max_positions: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer), num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        max_position_embeddings=max_positions, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **SHAPES[preset],
    )
    return LlamaForCausalLM(config)


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """Decay matrices only; norms are left alone, as usual for transformers."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def save_final(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, out: Path, summary: dict) -> None:
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False, max_new_tokens=128,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "training_summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(SHAPES), required=True)
    parser.add_argument("--data", type=Path, default=HERE / "data")
    parser.add_argument("--out", type=Path, help="default: examples/demo_pair/<preset>/")
    parser.add_argument("--steps", type=int, help=f"default: {DEFAULT_STEPS}")
    parser.add_argument("--batch", type=int, default=8, help="windows per step, half from each pool")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--eval-windows", type=int, default=48, help="held-out windows per pool")
    parser.add_argument("--ckpt-every", type=int, default=100)
    parser.add_argument("--resume", action="store_true", help="continue from <data>/ckpt_<preset>.pt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    steps = args.steps or DEFAULT_STEPS[args.preset]
    out = args.out or HERE / args.preset
    ckpt = args.data / f"ckpt_{args.preset}.pt"

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.data / "tokenizer")
    train, heldout = token_streams(args.data, "train", tokenizer), token_streams(args.data, "heldout", tokenizer)
    windows = eval_windows(heldout, args.seq, args.eval_windows)
    print("train tokens:", {p: len(s) for p, s in train.items()}, "held-out:", {p: len(s) for p, s in heldout.items()})

    model = build_model(args.preset, tokenizer, max_positions=4 * args.seq).to(args.device)
    optimizer = make_optimizer(model, args.lr)
    schedule = get_cosine_with_min_lr_schedule_with_warmup(optimizer, args.warmup, steps, min_lr_rate=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    start_step, history = 0, []
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False, map_location="cpu")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        gen.set_state(state["rng"])
        start_step, history = state["step"], state["history"]
        print(f"resumed from {ckpt} at step {start_step}")
    print(f"{args.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {steps} steps "
          f"of {args.batch}x{args.seq} tokens")
    if not history:
        history.append({"step": 0, **heldout_loss(model, windows, args.batch)})
        print("held-out loss", history[-1], flush=True)

    model.train()
    started = time.time()
    bar = tqdm(range(start_step, steps), initial=start_step, total=steps, mininterval=30)
    for step in bar:
        ids = sample_batch(train, args.batch, args.seq, gen).to(args.device)
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{schedule.get_last_lr()[0]:.2e}", refresh=False)
        done = step + 1
        if done % args.eval_every == 0 or done == steps:
            history.append({"step": done, **heldout_loss(model, windows, args.batch)})
            tqdm.write(f"step {done} held-out loss {history[-1]}\n{greedy_samples(model, tokenizer)}")
        if done % args.ckpt_every == 0 or done == steps:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": done,
                     "schedule": schedule.state_dict(), "rng": gen.get_state(), "history": history}
            torch.save(state, ckpt.with_suffix(".tmp"))
            ckpt.with_suffix(".tmp").replace(ckpt)

    final = {k: v for k, v in history[-1].items() if k != "step"}
    summary = {
        "preset": args.preset, "shape": SHAPES[args.preset], "steps": steps, "batch": args.batch, "seq": args.seq,
        "train_tokens_seen": steps * args.batch * args.seq, "lr": args.lr, "seed": args.seed, "device": args.device,
        "wall_minutes_this_run": round((time.time() - started) / 60, 1),
        "heldout_loss": final, "heldout_perplexity": {k: round(math.exp(v), 2) for k, v in final.items()},
        "heldout_eval_tokens_per_pool": args.eval_windows * args.seq,
        "corpus_sha256": json.loads((args.data / "summary.json").read_text())["sha256"], "history": history,
    }
    save_final(model.cpu(), tokenizer, out, summary)
    print(json.dumps({k: summary[k] for k in ("heldout_loss", "heldout_perplexity")}, indent=1))


if __name__ == "__main__":
    main()
