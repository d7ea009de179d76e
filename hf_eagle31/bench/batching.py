"""`hf-eagle31 bench --batch-sizes 1,4,8,16`: plain batched `generate` against batched EAGLE decoding.

EAGLE runs as the drafter's chain and tree at every batch size, and with the shape tuning chose for
each batch size (`batch_shapes` in its generation config, see `hf_eagle31.tuning.batch_shapes`).

The same prompts run at every batch size, left-padded into batches of that size in order, each
method after one untimed warm-up batch, all in one process. Tokens per second count every row's
new tokens up to its stop; speedups are over plain batched `generate` at the same batch size.
Greedy rows are checked against plain `generate`'s.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_eagle31.bench.runner import Method
from hf_eagle31.training.data import eos_ids
from hf_eagle31.tuning import speculation_settings


def left_padded(prompts: list[list[int]], pad: int, device) -> dict[str, torch.Tensor]:
    width = max(len(p) for p in prompts)
    return {"input_ids": torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device),
            "attention_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)}


def new_tokens(out: torch.Tensor, prompt_width: int, eos: set[int]) -> int:
    """Each row's generated tokens up to and including its first stop token (the rest is padding)."""
    total = 0
    for row in out[:, prompt_width:].tolist():
        stops = [i for i, token in enumerate(row) if token in eos]
        total += stops[0] + 1 if stops else len(row)
    return total


def run_batch_sizes(target, prompts: list[list[int]], methods: list[Method], sizes: list[int], max_new_tokens: int,
                    pad: int) -> list[dict]:
    """One row per (batch size, method): tokens/s, speedup over the first method, tau, identical outputs."""
    eos = eos_ids(target)
    kwargs = {"do_sample": False, "max_new_tokens": max_new_tokens, "pad_token_id": pad}
    rows = []
    for size in sizes:
        batches = [left_padded(prompts[i : i + size], pad, target.device) for i in range(0, len(prompts), size)]
        reference, baseline = None, None
        for method in methods:
            drafter = method.drafter
            settings = speculation_settings(drafter, **method.speculation) if drafter is not None else None
            with settings if settings is not None else contextlib.nullcontext():
                target.generate(**batches[0], **{**kwargs, **method.generate_kwargs, "max_new_tokens": 8})
                outputs, seconds, tokens, taus = [], 0.0, 0, []
                for batch in tqdm(batches, desc=f"batch {size}: {method.name}", leave=False):
                    started = time.perf_counter()
                    out = target.generate(**batch, **kwargs, **method.generate_kwargs)
                    seconds += time.perf_counter() - started
                    outputs.append(out)
                    tokens += new_tokens(out, batch["input_ids"].shape[1], eos)
                    stats = drafter.speculation_stats if drafter is not None else None
                    if stats is not None and stats.speculative_forwards:  # else the batch was decoded plainly
                        taus += [row.tau for row in stats.per_row] if stats.per_row else [stats.tau]
            reference = reference or outputs
            rate = tokens / seconds
            baseline = baseline or rate
            rows.append({"batch_size": size, "method": method.name, "tokens": tokens, "seconds": seconds,
                         "tokens_per_second": rate, "speedup": rate / baseline,
                         "tau": sum(taus) / len(taus) if taus else None,
                         "identical": all(torch.equal(o, r) for o, r in zip(outputs, reference))})
            print(f"batch {size:>3} {method.name:<22} {rate:8.1f} tok/s  {rate / baseline:5.2f}x", flush=True)
    return rows


def batch_table(rows: list[dict]) -> str:
    lines = ["| batch | method | tokens/s | speedup | tau per row | identical |", "|---|---|---|---|---|---|"]
    for r in rows:
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else ("1.00" if r["method"] == "plain generate" else
                                                             "plain (tuned: no shape pays)")
        lines.append(f"| {r['batch_size']} | {r['method']} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}x | "
                     f"{tau} | {'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def run_batched_study(target, tokenizer, drafters: dict, texts: list[str], encode, args, meta: dict) -> int:
    """Write batched.json and batched.md to --out and print the table."""
    sizes = sorted({int(s) for s in args.batch_sizes.split(",")})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"--batch-sizes takes positive integers separated by commas, got {args.batch_sizes!r}")
    drafter = drafters.get("EAGLE 3.1") or next(iter(drafters.values()), None)
    if drafter is None:
        raise ValueError("--batch-sizes compares EAGLE decoding with plain generate: give a drafter (--eagle31)")
    name = "EAGLE 3.1" if "EAGLE 3.1" in drafters else next(iter(drafters))
    untuned = {"batch_shapes": None}  # the drafter's own chain / tree at every batch size
    methods = [Method("plain generate")] + [
        Method(f"{name} {mode}", {"assistant_model": drafter}, {"speculation_mode": mode, **untuned})
        for mode in ("chain", "tree")]
    if getattr(drafter.generation_config, "batch_shapes", None):
        methods.append(Method(f"{name} tuned per batch size", {"assistant_model": drafter}))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = run_batch_sizes(target, [encode(t) for t in texts], methods, sizes, args.max_new_tokens, pad)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "prompts": len(texts), "batch_sizes": sizes}
    (out / "batched.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
    table = batch_table(rows)
    (out / "batched.md").write_text(f"`{meta['command']}`\n\n{meta['date']}, {meta['machine']}, {meta['dtype']}, "
                                    f"{len(texts)} prompts, {args.max_new_tokens} new tokens, greedy\n\n{table}\n")
    print("\n" + table + f"\n\nwritten to {out}/ (batched.json, batched.md)")
    return 0
