"""Benchmark output: a Markdown table, a JSON file and matplotlib plots, all from the same results."""

from __future__ import annotations

import json
from pathlib import Path

from hf_eagle31.bench.roofline import COUNTED, Roofline, speedup_claim
from hf_eagle31.bench.runner import MethodResult, best_plain
from hf_eagle31.bench.verify_cost import table
from hf_eagle31.tuning import report_cpu_backend


def bound(result: MethodResult, tuning: dict, prompts: int, baseline: MethodResult | None = None) -> float | None:
    """tau * t_target / (t_verify(n) + t_draft(d)): the speedup this run's tau allows with the draft shape it used.

    From this run's own costs where they were recorded (the loop's drafting and verifying time, the baseline's
    time per token), so that a slower or faster hour than tuning's does not move it; else from the costs tuning
    measured on this device (None without them)."""
    if baseline is not None and result.step_seconds:
        return (result.new_tokens - prompts) / result.step_seconds / baseline.tokens_per_second
    report = next((t for name, t in tuning.items() if result.name.startswith(name + " ")), None)
    shape = result.speculation
    if report is None or not shape:
        return None
    chain = shape["speculation_mode"] == "chain"
    key = (1, shape["num_assistant_tokens"], shape["num_assistant_tokens"]) if chain else \
        (shape["tree_top_k"], shape["tree_depth"], shape["tree_total_tokens"])
    for c in report.get("candidates", []):
        if (c["tree_top_k"], c["tree_depth"], c["tree_total_tokens"]) == key and c["tau"] > 0:
            return result.tau(prompts) * c["speedup"] / c["tau"]  # the candidate's speedup / tau is the cost ratio
    return None


def markdown_table(results: list[MethodResult], prompts: int, tuning: dict | None = None,
                   roofline: Roofline | None = None) -> str:
    """One row per method; with a `roofline`, beside its tokens/s its rate after the first token (the decoding steps
    alone: `MethodResult.decode_tokens_per_second`) and that rate over the floor rate."""
    floor = " after the first token | over floor rate |" if roofline else ""
    rows = [
        f"| method | tokens/s |{floor} speedup | vs default generate | tau | bound (reached) | acceptance by depth "
        "| identical to target | peak memory (MiB) |",
        "|---|---:|" + "---:|---:|" * bool(roofline) + "---:|---:|---:|---:|---|---|---:|",
    ]
    for r in results:
        acceptance = " ".join(f"{a:.2f}" for a in r.acceptance_per_depth[:8]) or "-"
        identical = "-" if r.identical_to_target is None else ("yes" if r.identical_to_target else "**NO**")
        identical += "" if r.identical_prompts is None else f" ({r.identical_prompts}/{prompts})"
        memory = "-" if r.peak_memory_bytes is None else f"{r.peak_memory_bytes / 2**20:.0f}"
        limit = bound(r, tuning or {}, prompts, best_plain(results))
        reach = "-" if limit is None else f"{limit:.2f}x ({r.speedup / limit:.0%})"
        floor = f" {_decode_cells(r, prompts, roofline)} |" if roofline else ""
        rows.append(
            f"| {r.name} | {r.tokens_per_second:.1f} |{floor} {r.speedup:.2f}x | {r.speedup_default:.2f}x | "
            f"{r.tau(prompts):.2f} | {reach} | {acceptance} | {identical} | {memory} |"
        )
    return "\n".join(rows)


def _decode_cells(result: MethodResult, prompts: int, roofline: Roofline) -> str:
    rate = result.decode_tokens_per_second(prompts)
    return "- | -" if rate is None else f"{rate:.1f} | {of_floor(result, prompts, roofline):.2f}"


def of_floor(result: MethodResult, prompts: int, roofline: Roofline | None) -> float | None:
    """The method's rate after the first token over the floor rate at the bandwidth probed around its own calls
    (`MethodResult.bandwidth`; the roofline's where none was), None without a roofline or first tokens.

    Why its own: a shared host's read bandwidth moves between levels for tens of seconds at a time, so a method
    that ran through a slow spell was judged against a floor probed in a fast one (bf16 SmolLM2's plain decoding
    at 0.43-0.51 of a run's fastest probe, at 0.70-0.84 of probes taken beside each of its calls)."""
    rate = result.decode_tokens_per_second(prompts)
    return None if roofline is None or rate is None else roofline.of_floor(rate, result.bandwidth)


def dataset_table(per_dataset: dict[str, list[MethodResult]], prompts: dict[str, int]) -> str:
    """tau and speedup of every method on every dataset."""
    names = list(per_dataset)
    rows = ["| method | " + " | ".join(f"{n} tau | {n} speedup" for n in names) + " |",
            "|---|" + "---:|---:|" * len(names)]
    for index, first in enumerate(per_dataset[names[0]]):
        cells = [f"{per_dataset[n][index].tau(prompts[n]):.2f} | {per_dataset[n][index].speedup:.2f}x" for n in names]
        rows.append(f"| {first.name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


DEEP = 5  # "deep" drafts start here: where attention drift shows (SPEC section 8)


def headline(results: list[MethodResult], prompts: int, roofline: Roofline | None = None) -> list[str]:
    """The comparisons the README quotes, every ratio from this one run: EAGLE 3.1's faster mode over the best
    plain decoding (a warning in its place above tau, `speedup_claim`) and over default `generate`, against the
    other speculative baselines, and EAGLE 3.1 against EAGLE-3 in each mode (tau, acceptance at depth >= DEEP)."""
    by_name = {r.name: r for r in results}
    lines = []
    eagle31 = [by_name[name] for name in ("EAGLE 3.1 chain", "EAGLE 3.1 tree", "EAGLE 3.1 sampling shape")
               if name in by_name]
    if eagle31:
        best, plain = max(eagle31, key=lambda r: r.tokens_per_second), best_plain(results)
        share = of_floor(plain, prompts, roofline)
        lines.append(f"{best.name}: {speedup_claim(best.speedup, best.tau(prompts), plain.name, share)} "
                     f"({best.speedup_default:.2f}x over {results[0].name} at default settings)")
        for baseline in ("assisted (small LM)", "prompt lookup"):
            if baseline in by_name:
                ratio = best.tokens_per_second / by_name[baseline].tokens_per_second
                lines.append(f"{best.name} vs {baseline}: {ratio:.2f}x tokens/s")
    for mode in ("chain", "tree"):
        old, new = by_name.get(f"EAGLE-3 {mode}"), by_name.get(f"EAGLE 3.1 {mode}")
        if old is None or new is None:
            continue
        line = (f"EAGLE 3.1 vs EAGLE-3, {mode}: tau {new.tau(prompts):.2f} vs {old.tau(prompts):.2f} "
                f"({new.tau(prompts) / old.tau(prompts):.2f}x)")
        deep_new, deep_old = new.acceptance_from(DEEP), old.acceptance_from(DEEP)
        if deep_new is not None and deep_old is not None:
            line += f", acceptance at depth >= {DEEP}: {deep_new:.2f} vs {deep_old:.2f}"
        lines.append(line)
    return lines


def tuning_table(tuning: dict[str, dict], source: str | None = None) -> str:
    """Each drafter's tuning: its verify cost curve and the draft shapes it predicts fastest; `source` says where
    they were measured (the shipped ones on another machine, perhaps in another dtype: their predicted speedups are
    not this run's)."""
    lines = [f"Draft shapes and costs from {source}:"] if source and tuning else []
    for name, report in tuning.items():
        ratios = report["verify_cost_ratio"]
        lines.append(f"**{name}**: verify cost t(n)/t(1): " + ", ".join(f"{n}: {r:.2f}" for n, r in ratios.items()))
        if report.get("paths"):  # tuning chose between the CPU backend and torch's default path
            lines.append(f"verify path: {'CPU backend' if report_cpu_backend(report) else 'torch default'} (best "
                         "predicted speedup: " + ", ".join(f"{path} {best['speedup']:.2f}x"
                                                           for path, best in report["paths"].items()) + ")")
        sampling = report.get("sampling") or {}
        shapes = {"best chain": report.get("best_chain"), "best tree": report.get("best_tree"),
                  f"sampling at temperature {sampling.get('temperature')}": sampling.get("shape")}
        for label, shape in shapes.items():
            if shape:
                lines.append(
                    f"{label}: top-k {shape['tree_top_k']}, depth {shape['tree_depth']}, "
                    f"{shape['tree_total_tokens']} tokens (predicted tau {shape['tau']:.2f}, "
                    f"predicted speedup {shape['speedup']:.2f}x)"
                )
    return "\n\n".join(lines)


def roofline_text(roofline: Roofline, verify_seconds: dict | None, results: list[MethodResult] = ()) -> str:
    """The roofline in words, the bandwidth probed around each method's calls (its "over floor rate" is against
    that), and beside them the verify cost curve: n rows in one forward over one plain step."""
    text = f"**Roofline**: {roofline.describe()}; counted: {COUNTED}."
    probed = [f"{r.name} {r.bandwidth / 1e9:.1f}" for r in results if r.bandwidth]
    if probed:
        text += f"\n\nRead bandwidth probed around each method's calls (GB/s, its floor's): {', '.join(probed)}."
    if verify_seconds:
        floor = roofline.floor_seconds / verify_seconds["default"][1]
        text += f"\n\nVerify cost, {table(verify_seconds)}\n\nthe floor (a step's weights read once): {floor:.2f} t(1)"
    return text


def _rows(results: list[MethodResult], prompts: int, tuning: dict, roofline: Roofline | None = None) -> list[dict]:
    return [
        {
            "name": r.name,
            "tokens_per_second": r.tokens_per_second,
            "decode_tokens_per_second": r.decode_tokens_per_second(prompts),
            "of_floor": of_floor(r, prompts, roofline),
            "bandwidth_bytes_per_second": r.bandwidth,
            "speedup": r.speedup,
            "speedup_default": r.speedup_default,
            "tau": r.tau(prompts),
            "acceptance_per_depth": r.acceptance_per_depth,
            "reached_per_depth": r.reached,
            "accepted_per_depth": r.accepted,
            "new_tokens": r.new_tokens,
            "seconds": r.seconds,
            "first_token_seconds": r.first_token_seconds,
            "target_forwards": r.target_forwards,
            "peak_memory_bytes": r.peak_memory_bytes,
            "identical_to_target": r.identical_to_target,
            "identical_prompts": r.identical_prompts,
            "speculation": r.speculation,
            "bound": bound(r, tuning, prompts, best_plain(results)),
        }
        for r in results
    ]


def write_results(out_dir: Path, results: list[MethodResult], prompts: int, meta: dict, tuning: dict,
                  per_dataset: dict[str, tuple[list[MethodResult], int]] | None = None,
                  roofline: Roofline | None = None, verify_seconds: dict | None = None) -> dict:
    """results.json, results.md and plots; `per_dataset` maps a dataset to its results and prompt count,
    `verify_seconds` a verify path to its seconds per block size (`verify_cost.measure`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        **meta,
        "methods": _rows(results, prompts, tuning, roofline),
        "datasets": {name: {"prompts": n, "methods": _rows(rs, n, tuning, roofline)}
                     for name, (rs, n) in (per_dataset or {}).items()},
        "headline": headline(results, prompts, roofline),
        "roofline": {**roofline.as_dict(), "verify_seconds": verify_seconds} if roofline else None,
        "tuning": tuning,
    }
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2, default=str))
    summary = "".join(f"- {line}\n" for line in payload["headline"])
    datasets = ""
    if per_dataset:
        datasets = dataset_table({k: v[0] for k, v in per_dataset.items()}, {k: v[1] for k, v in per_dataset.items()})
        datasets = f"\n{datasets}\n"
    floor = f"{roofline_text(roofline, verify_seconds, results)}\n\n" if roofline else ""
    (out_dir / "results.md").write_text(f"{markdown_table(results, prompts, tuning, roofline)}\n{datasets}\n"
                                        f"{summary}\n{floor}{tuning_table(tuning, meta.get('tuning_source'))}\n")
    plot_results(out_dir, results, prompts, tuning)
    return payload


def plot_results(out_dir: Path, results: list[MethodResult], prompts: int, tuning: dict) -> None:
    """speed.png (tokens/s per method), acceptance.png (per depth), verify_cost.png (t(n)/t(1))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh([r.name for r in results][::-1], [r.tokens_per_second for r in results][::-1], color="tab:blue")
    for i, r in enumerate(results[::-1]):
        ax.text(r.tokens_per_second, i, f" {r.speedup:.2f}x", va="center")
    ax.set_xlabel("tokens / s")
    fig.tight_layout()
    fig.savefig(out_dir / "speed.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        if r.acceptance_per_depth:
            depths = range(1, len(r.acceptance_per_depth) + 1)
            ax.plot(depths, r.acceptance_per_depth, marker="o", label=r.name)
    ax.set_xlabel("draft depth")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "acceptance.png", dpi=120)
    plt.close(fig)

    if tuning:
        plot_verify_cost(out_dir, tuning)


def plot_verify_cost(out_dir: Path, tuning: dict) -> None:
    """verify_cost.png: the measured t(n)/t(1) and, on it, the block size each drafter's tuning chose."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    first = next(iter(tuning.values()))["verify_cost_ratio"]  # one target: the drafters measure the same curve
    ax.plot([int(n) for n in first], list(first.values()), marker="o", color="tab:gray", label="measured")
    for index, (name, report) in enumerate(tuning.items()):  # the chosen shape verifies its tokens plus the root
        choice = report["choice"]
        drafts = choice["tree_total_tokens"]
        kind = "chain" if choice["tree_top_k"] == 1 else f"tree (top-k {choice['tree_top_k']})"
        ax.axvline(drafts + 1, linestyle="--", color=f"C{index}",  # one colour per drafter, as in the drift plot
                   label=f"{name}: {kind} of {drafts} drafts, predicted {choice['speedup']:.2f}x")
    ax.set_xlabel("tokens verified in one forward (n)")
    ax.set_ylabel("t(n) / t(1)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "verify_cost.png", dpi=120)
    plt.close(fig)
