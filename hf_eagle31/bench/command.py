"""Benchmark EAGLE-3 / 3.1 against the target alone, assisted generation and prompt lookup, in one run.

`hf-eagle31 bench` (defaults: the shipped demo pair) writes results.json, results.md and plots to
--out. With a drafter, the tree shape is first tuned to this device (see `hf_eagle31.tuning`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch

DEMO = Path("examples/demo_pair")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Benchmark EAGLE decoding against the target alone and other speculative methods."""
    add = parser.add_argument
    add("--target", default=str(DEMO / "target"), help="target model folder or Hub id (with its tokenizer)")
    add("--eagle3", default=str(DEMO / "eagle3"), help="EAGLE-3 drafter ('' to skip)")
    add("--eagle31", default=str(DEMO / "eagle31"), help="EAGLE 3.1 drafter ('' to skip)")
    add("--assistant", default=str(DEMO / "small_lm"), help="small LM for transformers' assisted generation ('' to skip)")
    add("--prompts", default=str(DEMO / "heldout_prompts.jsonl"), help="JSONL with 'text' or 'turns' per line")
    add("--num-prompts", type=int, default=10)
    add("--max-new-tokens", type=int, default=128)
    add("--prompt-lookup-tokens", type=int, default=10)
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    add("--no-tune", action="store_true", help="keep the drafters' tree shapes instead of tuning them here")
    add("--drift", action="store_true", help="run the EAGLE-3 vs EAGLE 3.1 attention-drift study instead")
    add("--project", nargs="+", metavar="SHAPE", help="also project speedups to real model shapes "
        "(Llama-3.1-8B, Qwen2.5-7B) from costs measured here and this run's EAGLE 3.1 acceptance")
    add("--out", default="runs/bench")


def read_texts(path: str, limit: int) -> list[str]:
    """Prompt texts from JSONL lines with `text` or `turns` (the first turn)."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    texts = [r["text"] if "text" in r else r["turns"][0] for r in records][:limit]
    if not texts:
        raise ValueError(f"no prompts in {path}")
    return texts


def load_models(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_eagle31.generation import prepare_drafter
    from hf_eagle31.modeling import Eagle3DraftModel

    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    drafters = {}
    for name, path in (("EAGLE-3", args.eagle3), ("EAGLE 3.1", args.eagle31)):
        if path:
            drafter = Eagle3DraftModel.from_pretrained(path).to(args.device, target.dtype).eval()
            prepare_drafter(target, drafter)
            drafters[name] = drafter
    assistant = None
    if args.assistant:
        assistant = AutoModelForCausalLM.from_pretrained(args.assistant, dtype=target.dtype).to(args.device).eval()
    return target, tokenizer, drafters, assistant


def tune(target, drafter, prompts, max_new_tokens) -> dict:
    """Calibrate on a few prompts with a large tree, then choose the shape for this device."""
    from hf_eagle31.tuning import apply_choice, choose_tree_shape

    top_k, depth, tokens = drafter.generation_config.tree_top_k or 10, 8, 64
    saved = {k: getattr(drafter.generation_config, k) for k in ("speculation_mode", "dynamic_speculation", "tree_depth", "tree_total_tokens", "collapse_fallback")}
    drafter.generation_config.update(speculation_mode="tree", dynamic_speculation=False, tree_depth=depth,
                                     tree_total_tokens=tokens, collapse_fallback=False)
    ranks = []
    for prompt in prompts[:3]:
        target.generate(prompt.to(target.device), do_sample=False, max_new_tokens=max_new_tokens, assistant_model=drafter)
        ranks += drafter.speculation_stats.accepted_ranks
    drafter.generation_config.update(**saved)
    report = choose_tree_shape(target, drafter, ranks, top_k=top_k, max_depth=depth, max_tokens=tokens)
    apply_choice(drafter, report)
    return {**report.as_dict(), "calibration_ranks": ranks}


def methods_for(drafters, assistant, lookup_tokens):
    from hf_eagle31.bench.runner import Method

    methods = [Method("target alone")]
    if assistant is not None:
        methods.append(Method("assisted (small LM)", {"assistant_model": assistant}))
    methods.append(Method("prompt lookup", {"prompt_lookup_num_tokens": lookup_tokens}))
    for name, drafter in drafters.items():
        for mode in ("chain", "tree"):
            methods.append(Method(f"{name} {mode}", {"assistant_model": drafter},
                                  {"speculation_mode": mode, "verify_chunk_depth": None}))
    if "EAGLE 3.1" in drafters:  # the micro-batched ("batch-sequential") verification option, measured
        methods.append(Method("EAGLE 3.1 tree, micro-batched verify", {"assistant_model": drafters["EAGLE 3.1"]},
                              {"speculation_mode": "tree", "verify_chunk_depth": 2}))
    return methods


def projections(args, tuning: dict) -> dict:
    from hf_eagle31.bench.projection import REAL_SHAPES, measure_costs, project

    ranks = tuning.get("EAGLE 3.1", next(iter(tuning.values()), {})).get("calibration_ranks")
    if not ranks:
        raise ValueError("--project needs the EAGLE 3.1 acceptance measured by tuning (drop --no-tune)")
    unknown = set(args.project) - set(REAL_SHAPES)
    if unknown:
        raise ValueError(f"unknown shapes {sorted(unknown)}; known: {sorted(REAL_SHAPES)}")
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 65]
    return {
        shape: project(measure_costs(REAL_SHAPES[shape], sizes, list(range(1, 9)), device=args.device), ranks)
        for shape in args.project
    }


def run(args: argparse.Namespace) -> int:
    from hf_eagle31.bench.report import markdown_table, tuning_table, write_results
    from hf_eagle31.bench.runner import run_all

    target, tokenizer, drafters, assistant = load_models(args)
    texts = read_texts(args.prompts, args.num_prompts)
    if args.drift:
        from hf_eagle31.bench.drift import run_drift_study

        return run_drift_study(target, tokenizer, drafters, texts, args)
    prompts = [tokenizer(text, return_tensors="pt").input_ids.to(args.device) for text in texts]
    tuning = {} if args.no_tune else {name: tune(target, d, prompts, args.max_new_tokens) for name, d in drafters.items()}
    results = run_all(target, prompts, methods_for(drafters, assistant, args.prompt_lookup_tokens), args.max_new_tokens)
    meta = {
        "command": "hf-eagle31 bench " + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "command"),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} threads, "
        + (torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"),
        "torch": torch.__version__,
        "dtype": str(target.dtype),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
    }
    if args.project:
        meta["projections"] = projections(args, tuning)
    write_results(Path(args.out), results, len(prompts), meta, tuning)
    print(markdown_table(results, len(prompts)))
    if tuning:
        print("\n" + tuning_table(tuning))
    for shape, projection in meta.get("projections", {}).items():
        best = projection["best"]
        print(f"\nPROJECTION for {shape} on this device (costs extrapolated, acceptance of the demo EAGLE 3.1): "
              f"step {projection['step_seconds'] * 1000:.1f} ms, best tree depth {best['tree_depth']} with "
              f"{best['tree_total_tokens']} tokens, tau {best['tau']:.2f}, projected speedup {best['speedup']:.2f}x")
    print(f"\nwritten to {args.out}/ (results.json, results.md, speed.png, acceptance.png, verify_cost.png)")
    return 0
