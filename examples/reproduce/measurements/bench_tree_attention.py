"""Time the Triton tree-attention kernel against torch SDPA with a dense boolean mask, on a CUDA GPU.

The case is tree verification on a Llama-8B-like target (32 query heads, 8 KV heads, head_dim 128,
bf16): a 64-node tree against a prefix of 1k, 4k and 16k tokens. SDPA needs the `[n, prefix + n]`
mask built in advance (not timed here); the kernel reads only the `[n, n]` tree mask.

    python examples/reproduce/measurements/bench_tree_attention.py --out runs/bench_tree_attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_eagle31.drafting import DraftTree

PREFIXES = (1024, 4096, 16384)
TREE_SIZE, Q_HEADS, KV_HEADS, HEAD_DIM, DTYPE = 64, 32, 8, 128, torch.bfloat16
TOLERANCE = 2e-2  # largest difference allowed, relative to the largest output: bf16, different summation orders


def four_ary_tree(size: int) -> DraftTree:
    """A complete 4-ary tree in level order, standing in for a dynamic draft tree of the same size."""
    parents, depths = [-1], [0]
    for node in range(1, size):
        parents.append((node - 1) // 4)
        depths.append(depths[parents[-1]] + 1)
    return DraftTree(torch.zeros(size, dtype=torch.long), torch.tensor(parents), torch.tensor(depths))


def bench_prefix(prefix: int, tail_mask: torch.Tensor) -> dict:
    from triton.testing import do_bench

    from hf_eagle31.kernels.tree_attention_triton import tree_attention_triton

    generator = torch.Generator(device="cuda").manual_seed(prefix)
    kv_len = prefix + TREE_SIZE
    query = torch.randn(1, Q_HEADS, TREE_SIZE, HEAD_DIM, device="cuda", dtype=DTYPE, generator=generator)
    key = torch.randn(1, KV_HEADS, kv_len, HEAD_DIM, device="cuda", dtype=DTYPE, generator=generator)
    value = torch.randn(1, KV_HEADS, kv_len, HEAD_DIM, device="cuda", dtype=DTYPE, generator=generator)
    dense_mask = torch.cat([tail_mask.new_ones(TREE_SIZE, prefix), tail_mask], dim=1)
    group = Q_HEADS // KV_HEADS
    key_rep, value_rep = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)

    candidates = {
        "triton": lambda: tree_attention_triton(query, key, value, tail_mask),
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=dense_mask, enable_gqa=True),
        "sdpa_repeated_kv": lambda: F.scaled_dot_product_attention(query, key_rep, value_rep, attn_mask=dense_mask),
    }
    outputs = {name: fn().float() for name, fn in candidates.items()}
    row = {"prefix": prefix, "tree_size": TREE_SIZE}
    for name in ("sdpa_gqa", "sdpa_repeated_kv"):
        error = ((outputs["triton"] - outputs[name]).abs().max() / outputs[name].abs().max()).item()
        if error > TOLERANCE:
            raise SystemExit(f"prefix {prefix}: the kernel differs from {name} by {error:.3g} of its largest output.")
        row[f"max_rel_diff_vs_{name}"] = error
    for name, fn in candidates.items():
        row[f"{name}_ms"] = do_bench(fn, warmup=25, rep=200, return_mode="median")
    row["speedup_vs_best_sdpa"] = min(row["sdpa_gqa_ms"], row["sdpa_repeated_kv_ms"]) / row["triton_ms"]
    return row


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| prefix | tree | triton ms | SDPA gqa ms | SDPA repeated-KV ms | speedup vs best SDPA | max rel diff |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        diff = max(r["max_rel_diff_vs_sdpa_gqa"], r["max_rel_diff_vs_sdpa_repeated_kv"])
        lines.append(
            f"| {r['prefix']} | {r['tree_size']} | {r['triton_ms']:.4f} | {r['sdpa_gqa_ms']:.4f} | "
            f"{r['sdpa_repeated_kv_ms']:.4f} | {r['speedup_vs_best_sdpa']:.2f}x | {diff:.2e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the results as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_tree_attention needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured.")

    import triton

    tail_mask = four_ary_tree(TREE_SIZE).ancestor_mask().cuda()
    rows = [bench_prefix(prefix, tail_mask) for prefix in PREFIXES]
    print(markdown_table(rows))
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(DTYPE),
        "q_heads": Q_HEADS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "timer": "triton.testing.do_bench, median of CUDA-event timings",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
