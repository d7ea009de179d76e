"""`hf-eagle31 plan`: GPU memory for a target + EAGLE drafter from the target's config, before loading anything
(`hf_eagle31.planner`)."""

from __future__ import annotations

import argparse
import json

from hf_eagle31.planner import (DRAFT_VOCAB, DTYPES, GPUS, QUANTIZATIONS, GiB, MemoryPlan, Planner, gpu_memory,
                                parse_memory)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Plan GPU memory for a target + EAGLE drafter from the target's config, before loading anything."""
    add = parser.add_argument
    add("--target", required=True, help="the target's config.json, model folder, Hub id or packaged name")
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", help=f"a preset card: {', '.join(GPUS)}")
    gpu.add_argument("--gpu-mem", help="GPU memory, e.g. 24GiB, 24GB, 23034MiB (a bare number is GiB)")
    add("--quant", default="bf16", choices=QUANTIZATIONS, help="the target's weights: a dtype or bitsandbytes")
    add("--dtype", default="bf16", choices=list(DTYPES), help="drafter, KV cache and unquantized target parts")
    add("--context", type=int, default=8192, help="tokens in the target's cache (prompt + generated)")
    add("--tree-tokens", type=int, default=61, help="tokens in one verify forward (drafted nodes + the root)")
    add("--draft-vocab-size", type=int, default=None,
        help=f"the drafter's vocabulary (default {DRAFT_VOCAB}, or the target's if smaller)")
    add("--eagle3", action="store_true", help="an EAGLE-3 drafter (no 3.1 fc norms; a few KiB less)")
    add("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    gpu_name, gpu_bytes = gpu_memory(args.gpu) if args.gpu else (None, None)
    if args.gpu_mem is not None:  # '' is a mistake to name, not "no card given"
        gpu_name, gpu_bytes = args.gpu_mem, parse_memory(args.gpu_mem)
    planner = Planner(args.target, args.dtype, args.draft_vocab_size, eagle31=not args.eagle3)
    plan = planner.plan(args.quant, args.context, args.tree_tokens, gpu_bytes, gpu_name)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print_plan(plan, str(args.target))
    return 0 if plan.fits is not False else 1


def print_plan(plan: MemoryPlan, target: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"{target}: {plan.quant} target, context {plan.context}, tree {plan.tree_tokens} tokens",
                  highlight=False)
    table = Table()
    table.add_column("component")
    table.add_column("GiB", justify="right")
    for name, size in plan.components.items():
        table.add_row(name, f"{size / GiB:.2f}")
    table.add_row("total", f"{plan.total / GiB:.2f}", style="bold")
    if plan.gpu_bytes is not None:
        table.add_row(f"GPU ({plan.gpu_name})", f"{plan.gpu_bytes / GiB:.2f}")
    console.print(table)
    if plan.fits is not None:
        verdict = "[green]fits[/green]" if plan.fits else "[red]does not fit[/red]"
        console.print(f"verdict: {verdict}")
    for line in plan.advice:
        console.print(f"  - {line}", highlight=False)
