"""`hf-eagle31 bench --verify-cost`: what verifying n tokens costs, on the default backend and on the CPU backend's
products (and compiled, with --compile-verify), and what a draft level costs beside it.

Both curves are measured in one process, in interleaved rounds (medians), and divided by the
same t(1): one plain step on the target's own weights, which is what speculation has to beat.
A draft level is split into the drafter's forward and the rest (top-k, tree bookkeeping, masks), each tree timed
after a target forward, as decoding drafts (`tuning.target_step`).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hf_eagle31.backends import backend_for
from hf_eagle31.drafting import drafting_width, forward_of
from hf_eagle31.tuning import draft_cost, target_step, verify_cost_curve

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
PATHS = {"default": False, "cpu backend": True}  # name -> `cpu_backend`: the CPU backend's products (hf_eagle31.backends)
COMPILED = "cpu backend, compiled"  # the CPU backend's lean forward compiled (`compile_verify`), with --compile-verify


def measure(target, layer_ids: list[int], rounds: int = 5, context: int = 256, compiled: bool = False,
            sizes: tuple[int, ...] = SIZES) -> dict:
    """Seconds per verify forward of each size on each path: the median over `rounds` interleaved rounds."""
    paths = {name: (pack, False) for name, pack in PATHS.items()} | ({COMPILED: (True, True)} if compiled else {})
    seconds = {name: {n: [] for n in sizes} for name in paths}
    for _ in range(rounds):
        for name, (pack, compile_verify) in paths.items():
            for n, t in verify_cost_curve(target, list(sizes), layer_ids, context=context, repeats=3,
                                          cpu_backend=pack, compiled=compile_verify).items():
                seconds[name][n].append(t)
    return {name: {n: statistics.median(ts) for n, ts in sizes.items()} for name, sizes in seconds.items()}


def draft_split(drafter, depth: int = 6, top_k: int = 10, repeats: int = 10,
                before: Callable[[], object] | None = None, products=None, forward=None) -> dict:
    """Seconds per draft level of a `top_k` tree `depth` levels deep: in all, and in the drafter's forward (a backend's
    whole `forward`, else its modules' on `products`).

    Best of `repeats` trees, as the verify costs and the tuner time theirs, each after an untimed call of `before`;
    a tree's catch-up forward on the accepted token counts as its first level. The set-up (the drafter catching up
    on the whole context) and the warm-up tree are left out.
    """
    spans: list[float] = []  # each drafter forward's seconds
    inner = forward_of(drafter, products, forward)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        spans.append(time.perf_counter() - start)
        return out

    tree = draft_cost(drafter, depth, top_k, repeats=repeats, before=before, forward=timed)
    forwards = [sum(spans[i : i + depth]) for i in range(1 + depth, len(spans), depth)]
    return {"level": tree / depth, "forward": min(forwards) / depth}


def table(seconds: dict) -> str:
    step, sizes = seconds["default"][1], list(seconds["default"])
    lines = [f"t(1) = {step * 1000:.1f} ms (one plain step on the default path)", "",
             "| path | " + " | ".join(f"t({n})" for n in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for name, sizes in seconds.items():
        lines.append(f"| {name} | " + " | ".join(f"{t / step:.2f}" for t in sizes.values()) + " |")
    return "\n".join(lines)


def plot(out: Path, seconds: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = seconds["default"][1]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, sizes in seconds.items():
        ax.plot(list(sizes), [t / step for t in sizes.values()], marker="o", label=name)
    ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("tokens verified in one forward (n)")
    ax.set_ylabel("t(n) / one plain step")
    ax.set_title(title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "verify_cost_paths.png", dpi=120)
    plt.close(fig)


def draft_table(drafting: dict, step: float) -> str:
    lines = ["| drafter weights, dtype, tree | per draft level | share of a plain step | drafter forward | top-k, tree, masks |",
             "|---|---:|---:|---:|---:|"]
    for name, split in drafting.items():
        lines.append(f"| {name} | {split['level'] * 1000:.2f} ms | {split['level'] / step:.1%} | "
                     f"{split['forward'] * 1000:.2f} ms | {(split['level'] - split['forward']) * 1000:.2f} ms |")
    return "\n".join(lines)


def run_verify_cost_study(target, drafters: dict, args, meta: dict) -> int:
    drafter = drafters.get("EAGLE 3.1", next(iter(drafters.values())))
    layer_ids = drafter.config.target_layer_ids
    seconds = measure(target, layer_ids, compiled=args.compile_verify)
    config = drafter.generation_config  # the tree decoding drafts (its tuned shape), and a deep one
    shipped = drafting_width(config.tree_top_k or 10, config.tree_total_tokens or 10)
    trees = dict.fromkeys([(shipped, config.tree_depth or 6), (10, 6)])  # (drafting width, depth)
    drafting, after_target = {}, target_step(target)
    for dtype in dict.fromkeys([target.dtype, torch.bfloat16]):  # a bf16 drafter beside an fp32 target too
        drafter.to(dtype)
        for name, pack in PATHS.items():
            backend = backend_for(target, pack)
            products = backend.products(drafter)
            if pack and products is None:
                continue
            forward = backend.draft_forward(drafter, products)
            for width, depth in trees:
                label = f"{name}, {str(dtype).removeprefix('torch.')} drafter, tree {width} wide, {depth} levels"
                drafting[label] = draft_split(drafter, depth, width, before=after_target, products=products,
                                              forward=forward)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_cost_paths.json").write_text(json.dumps({**meta, "seconds": seconds, "draft_level_seconds": drafting},
                                                           indent=1) + "\n")
    text = table(seconds) + "\n\nDrafting:\n\n" + draft_table(drafting, seconds["default"][1])
    (out / "verify_cost_paths.md").write_text(f"`{meta['command']}` ({meta['date']}, {meta['machine']}, "
                                              f"{meta['dtype']})\n\n{text}\n")
    plot(out, seconds, f"{meta['dtype']}, {meta['machine']}")
    print(text)
    return 0
