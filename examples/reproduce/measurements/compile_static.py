"""EAGLE on transformers' compile path (static cache + `compile_config`) against eager decoding.

    python examples/reproduce/measurements/compile_static.py [--prompts 4] [--max-new-tokens 96]     # the real pair, on this CPU
    python examples/reproduce/measurements/compile_static.py --pair demo --device cuda               # the demo pair; CUDA graphs

One process: eager plain, eager EAGLE (dynamic cache, packed weights), compiled plain and compiled
EAGLE (static cache of a fixed size, so every call reuses one graph); the first compiled call of
each is reported apart (it compiles). Greedy outputs are checked against eager plain decoding.
On a CPU transformers compiles decoding only when asked (`CompileConfig._compile_all_devices`); on CUDA
its default mode, "reduce-overhead", replays each forward as a CUDA graph.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig

import hf_eagle31  # noqa: F401  (routes generate(assistant_model=<EAGLE drafter>))
from hf_eagle31 import Eagle3DraftModel
from hf_eagle31.packaged import load_packaged_model

HERE = Path(__file__).resolve().parents[2]  # examples/
PROMPTS = HERE.parent.parent / "shared" / "data" / "prompts" / "mt_bench.jsonl"
DEMO = HERE / "demo_pair"


def load_pair(pair: str, prompt_file: str, count: int, device: str) -> tuple:
    """The target, its EAGLE 3.1 drafter and `count` prompts: MT-Bench first turns through the chat template for
    the real pair, held-out code and prose openings for the demo pair (a completion model)."""
    if pair == "demo":
        target = AutoModelForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32)
        tokenizer, drafter = AutoTokenizer.from_pretrained(DEMO / "target"), Eagle3DraftModel.from_pretrained(DEMO / "eagle31")
        texts = [json.loads(line)["text"] for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()]
        prompts = [tokenizer(text, return_tensors="pt")["input_ids"] for text in texts[:count]]
    else:
        target, tokenizer = load_packaged_model("smollm2-135m-instruct")
        drafter = Eagle3DraftModel.from_pretrained(HERE / "smollm2" / "eagle31")
        turns = [json.loads(line)["turns"][0] for line in Path(prompt_file).read_text().splitlines()][:count]
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": turn}], add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True)["input_ids"] for turn in turns]
    return target.to(device), drafter.to(device), [p.to(device) for p in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="MT-Bench first turns measured")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--prompt-file", default=str(PROMPTS), help="JSONL with 'turns'")
    parser.add_argument("--freezing", action="store_true",
                        help="inductor's freezing: weights become constants, prepacked for oneDNN on a CPU")
    parser.add_argument("--pair", choices=["smollm2", "demo"], default="smollm2")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    target, drafter, prompts = load_pair(args.pair, args.prompt_file, args.prompts, args.device)
    mode = "reduce-overhead" if args.device.startswith("cuda") else "default"
    compile_config = CompileConfig(mode=None, options={"freezing": True}) if args.freezing else CompileConfig(mode=mode)
    compile_config._compile_all_devices = True
    static = dict(cache_implementation="static", compile_config=compile_config,
                  max_cache_len=max(p.shape[1] for p in prompts) + args.max_new_tokens + 16)  # one cache size: one graph
    methods = {"eager plain": {}, "eager EAGLE": {"assistant_model": drafter}, "compiled plain": static,
               "compiled EAGLE": {**static, "assistant_model": drafter}}
    reference, rows = None, []
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else lambda: None
    for name, extra in methods.items():
        began = time.perf_counter()  # the first call compiles (or warms up): timed apart, on the first prompt
        target.generate(prompts[0], do_sample=False, max_new_tokens=args.max_new_tokens, **extra)
        sync()
        first = time.perf_counter() - began
        outputs, seconds, tokens = [], 0.0, 0
        for prompt in prompts:
            began = time.perf_counter()
            out = target.generate(prompt, do_sample=False, max_new_tokens=args.max_new_tokens, **extra)
            sync()
            seconds += time.perf_counter() - began
            tokens += out.shape[1] - prompt.shape[1]
            outputs.append(out)
        reference = reference or outputs
        same = sum(torch.equal(a, b) for a, b in zip(outputs, reference))
        rows.append((name, tokens / seconds, first, same))
        print(f"{name}: {tokens / seconds:.1f} tokens/s, first call {first:.1f} s", flush=True)
    plain = {name.split()[0]: rate for name, rate, _, _ in rows if name.endswith("plain")}
    print("\n| method | tokens/s | vs plain of the same kind | first call (compiles, warms up) | identical to eager plain |")
    print("|---|---:|---:|---:|---:|")
    for name, rate, first, same in rows:
        print(f"| {name} | {rate:.1f} | {rate / plain[name.split()[0]]:.2f}x | "
              f"{first:.1f} s | {same}/{len(prompts)} |")


if __name__ == "__main__":
    main()
