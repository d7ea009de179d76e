"""GPU validation in one command, for a session that has a CUDA GPU:

    pip install -e . && python examples/gpu_validation.py --out runs/gpu   # writes gpu_validation.json

(An editable install: the CUDA tests run from the checkout, against its `hf_eagle31.kernels`.) `--parts` runs a
subset.

1. the CUDA test suite (Triton tree-attention kernel tests) under pytest;
2. the kernel against SDPA with a dense boolean mask at prefix 1k/4k/16k, tree size 64;
3. lossless decoding on CUDA in bf16: tiny Llama/Qwen2 pairs, chain and tree, with
   verify_mode="exact" (must match plain greedy exactly, alone and in a batch of 4 against plain batched
   greedy), "batched" and "kernel" (mismatches counted);
4. a randomly initialised Llama-3.1-8B-shaped target in bf16 and nf4 (nf4 needs bitsandbytes):
   single-token step time, verify cost curve t(n)/t(1) for n up to 128, drafter tree cost per depth,
   and the memory planner's prediction against torch.cuda.max_memory_allocated;
5. drafting beside that target, bf16 and nf4 (`--parts drafting_bf16 drafting_nf4`, sized for 8 minutes): the tree
   narrowed, static eager and replayed as a CUDA graph at depth 1-8, the syncs one draft makes, a step's time
   split, the batch-1 speedup projected at tau 3, 4, 5, and output equal to plain greedy.
Each part records its own error instead of stopping the rest.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples" / "reproduce" / "measurements"))  # bench_tree_attention


def cuda_tests() -> dict:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/"], cwd=ROOT,
                          capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    return {"returncode": done.returncode, "summary": lines[-1:], "failures": lines[-40:] if done.returncode else []}


def kernel_timings() -> dict:
    from bench_tree_attention import main as bench_main

    out = Path("/tmp/bench_tree_attention.json")
    bench_main(["--out", str(out)])
    return json.loads(out.read_text())


def lossless_on_cuda() -> dict:
    import hf_eagle31  # noqa: F401
    from tiny_models import PROMPTS, trained_pair

    from hf_eagle31.bench.batching import left_padded

    batch = left_padded([PROMPTS[0].tolist(), PROMPTS[1, :3].tolist(), PROMPTS[2].tolist(), [7]], 0, "cuda")
    results = {}
    for arch in ("llama", "qwen2"):
        target, drafter = trained_pair(arch, True, collapse_fallback=False)
        target, drafter = target.to("cuda", torch.bfloat16), drafter.to("cuda", torch.bfloat16)
        for verify in ("exact", "batched", "kernel"):
            for mode in ("chain", "tree"):
                drafter.generation_config.update(speculation_mode=mode, verify_mode=verify)
                same = 0
                for i in range(len(PROMPTS)):
                    prompt = PROMPTS[i : i + 1].cuda()
                    expected = target.generate(prompt, do_sample=False, max_new_tokens=48)
                    out = target.generate(prompt, do_sample=False, max_new_tokens=48, assistant_model=drafter)
                    same += bool(torch.equal(out, expected))
                results[f"{arch} {mode} {verify}"] = f"{same}/{len(PROMPTS)} identical"
                expected = target.generate(**batch, do_sample=False, max_new_tokens=40, pad_token_id=0)
                out = target.generate(**batch, do_sample=False, max_new_tokens=40, pad_token_id=0,
                                      assistant_model=drafter)
                rows = sum(torch.equal(a, b) for a, b in zip(out, expected))
                results[f"{arch} {mode} {verify}, batch of 4"] = f"{rows}/4 rows identical"
        target.cpu().float(), drafter.cpu().float()
    return results


def llama8b(quant: str):
    """A randomly initialised Llama-3.1-8B-shaped target in bf16 or nf4 and an EAGLE 3.1 drafter for it."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hf_eagle31.bench.projection import REAL_SHAPES
    from hf_eagle31.modeling import Eagle3DraftModel
    from hf_eagle31.training import drafter_config_for

    folder = Path("/tmp/llama8b-random")
    if not folder.exists():
        with torch.device("cuda"):
            AutoModelForCausalLM.from_config(REAL_SHAPES["Llama-3.1-8B"], dtype=torch.bfloat16).save_pretrained(folder)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    quantization = None if quant == "bf16" else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                                     bnb_4bit_compute_dtype=torch.bfloat16)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda",
                                                  quantization_config=quantization).eval()
    drafter = Eagle3DraftModel(drafter_config_for(target, "eagle3.1", 32000)).to("cuda", torch.bfloat16).eval()
    drafter.set_target_embedding(target.get_input_embeddings())
    return target, drafter


def real_shape(quant: str) -> dict:
    from hf_eagle31.bench.projection import REAL_SHAPES
    from hf_eagle31.planner import Planner
    from hf_eagle31.tuning import draft_cost, verify_cost_curve

    target, drafter = llama8b(quant)
    context = 1024
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    curve = verify_cost_curve(target, sizes, drafter.config.target_layer_ids, context=context)
    kernel_curve = verify_cost_curve(target, sizes, drafter.config.target_layer_ids, context=context, mode="kernel")
    exact_curve = verify_cost_curve(target, sizes, drafter.config.target_layer_ids, context=context, mode="exact")
    drafts = {d: draft_cost(drafter, d, 10, context=context) for d in (1, 2, 4, 6, 8)}
    measured = torch.cuda.max_memory_allocated()
    plan = Planner(REAL_SHAPES["Llama-3.1-8B"]).plan(quant, context=context + 128, tree_tokens=128)
    del target, drafter
    torch.cuda.empty_cache()
    return {
        "step_ms": curve[1] * 1e3,
        "verify_cost_ratio": {n: t / curve[1] for n, t in curve.items()},
        "verify_cost_ratio_kernel": {n: t / curve[1] for n, t in kernel_curve.items()},
        "verify_cost_ratio_exact": {n: t / curve[1] for n, t in exact_curve.items()},
        "drafter_tree_ms": {d: s * 1e3 for d, s in drafts.items()},
        "max_memory_allocated_GiB": measured / 2**30,
        "planner_total_GiB": plan.total / 2**30,
    }


def drafting(quant: str) -> dict:
    """The draft tree (top-k 10) narrowed, static eager and replayed as a CUDA graph at depth 1-8, the syncs a draft
    makes, a step's split at depth 6 / 60 tokens, the batch-1 speedup projected at tau 3-5, output = plain."""
    import warnings

    from hf_eagle31.backends.graphs import GraphReplay
    from hf_eagle31.tuning import draft_cost, target_step, verify_cost_curve

    target, drafter = llama8b(quant)
    context, after, device = 1024, target_step(target), drafter.device
    paths = {"narrowed": (False, None), "static": (True, None), "graphed": (True, GraphReplay())}
    trees = {name: {d: 1e3 * draft_cost(drafter, d, 10, context, before=after, static=static, replay=replay)
                    for d in range(1, 9)} for name, (static, replay) in paths.items()}
    syncs = {}
    for name, (static, replay) in paths.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")  # each implicit synchronization warns
            draft_cost(drafter, 6, 10, context, repeats=2, static=static, replay=replay)
            torch.cuda.set_sync_debug_mode("default")
        syncs[name] = sum("synchroniz" in str(w.message) for w in caught)
    curve = verify_cost_curve(target, [1, 61], drafter.config.target_layer_ids, context=context)
    step, verify = 1e3 * curve[1], 1e3 * curve[61]
    draft = trees["graphed"][6]
    drafter.generation_config.update(tree_depth=6, tree_top_k=10, tree_total_tokens=60, dynamic_speculation=False,
                                     collapse_fallback=False, verify_mode="exact")
    prompt = torch.randint(3, target.config.vocab_size, (1, 64), device=device,
                           generator=torch.Generator(device).manual_seed(0))
    expected = target.generate(prompt, do_sample=False, max_new_tokens=12)
    same = bool(torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=12, assistant_model=drafter),
                            expected))
    del target, drafter
    torch.cuda.empty_cache()
    return {"tree_ms": trees, "syncs_per_draft_depth6": syncs, "step_ms": step, "verify_61_ms": verify,
            "graphed_depth6_ms": draft, "drafting_share": draft / (draft + verify),
            "projected_speedup": {tau: tau * step / (draft + verify) for tau in (3, 4, 5)},
            "exact_output_equals_plain": same}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/gpu")
    parser.add_argument("--parts", nargs="*", help="run only these parts (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_validation needs a CUDA GPU; nothing was measured.")
        return 1
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    parts = {"cuda_tests": cuda_tests, "kernel_vs_sdpa": kernel_timings, "lossless_bf16": lossless_on_cuda,
             "llama8b_bf16": lambda: real_shape("bf16"), "llama8b_nf4": lambda: real_shape("nf4"),
             "drafting_bf16": lambda: drafting("bf16"), "drafting_nf4": lambda: drafting("nf4")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in parts.items():
        if args.parts and name not in args.parts:
            continue
        print(f"== {name}", flush=True)
        try:
            report[name] = part()
        except Exception:  # noqa: BLE001  (one failing part must not hide the others' numbers)
            report[name] = {"error": traceback.format_exc(limit=3)}
        print(json.dumps(report[name], indent=1, default=str)[:2000], flush=True)
        (out / "gpu_validation.json").write_text(json.dumps(report, indent=2, default=str))  # kept if a later part hangs
    print(f"written to {out}/gpu_validation.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
