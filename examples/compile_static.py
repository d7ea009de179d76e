"""EAGLE on transformers' compile path (static cache + `compile_config`) against eager decoding, on the real pair.

    python examples/compile_static.py [--prompts 4] [--max-new-tokens 96]

One process: eager plain, eager EAGLE (dynamic cache, packed weights), compiled plain and compiled
EAGLE (static cache of a fixed size, so every call reuses one graph); the first compiled call of
each is reported apart (it compiles). Greedy outputs are checked against eager plain decoding.
On a CPU transformers compiles decoding only when asked (`CompileConfig._compile_all_devices`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import CompileConfig

import hf_eagle31  # noqa: F401  (routes generate(assistant_model=<EAGLE drafter>))
from hf_eagle31 import Eagle3DraftModel
from hf_eagle31.packaged import load_packaged_model

HERE = Path(__file__).parent
PROMPTS = HERE.parent.parent / "shared" / "data" / "prompts" / "mt_bench.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="MT-Bench first turns measured")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--prompt-file", default=str(PROMPTS), help="JSONL with 'turns'")
    parser.add_argument("--freezing", action="store_true",
                        help="inductor's freezing: weights become constants, prepacked for oneDNN on a CPU")
    args = parser.parse_args()
    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
    drafter = Eagle3DraftModel.from_pretrained(HERE / "smollm2" / "eagle31")
    turns = [json.loads(line)["turns"][0] for line in Path(args.prompt_file).read_text().splitlines()][: args.prompts]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": turn}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"] for turn in turns]
    compile_config = CompileConfig(mode=None, options={"freezing": True}) if args.freezing else CompileConfig(mode="default")
    compile_config._compile_all_devices = True
    static = dict(cache_implementation="static", compile_config=compile_config,
                  max_cache_len=max(p.shape[1] for p in prompts) + args.max_new_tokens + 16)  # one cache size: one graph
    methods = {"eager plain": {}, "eager EAGLE": {"assistant_model": drafter}, "compiled plain": static,
               "compiled EAGLE": {**static, "assistant_model": drafter}}
    reference, rows = None, []
    for name, extra in methods.items():
        first = None
        if "compiled" in name:  # the first call compiles: timed apart, on the first prompt
            began = time.perf_counter()
            target.generate(prompts[0], do_sample=False, max_new_tokens=args.max_new_tokens, **extra)
            first = time.perf_counter() - began
        outputs, seconds, tokens = [], 0.0, 0
        for prompt in prompts:
            began = time.perf_counter()
            out = target.generate(prompt, do_sample=False, max_new_tokens=args.max_new_tokens, **extra)
            seconds += time.perf_counter() - began
            tokens += out.shape[1] - prompt.shape[1]
            outputs.append(out)
        reference = reference or outputs
        same = sum(torch.equal(a, b) for a, b in zip(outputs, reference))
        rows.append((name, tokens / seconds, first, same))
        print(f"{name}: {tokens / seconds:.1f} tokens/s" + (f", first call {first:.0f} s" if first else ""), flush=True)
    plain = {name.split()[0]: rate for name, rate, _, _ in rows if name.endswith("plain")}
    print("\n| method | tokens/s | vs plain of the same kind | first call (compiles) | identical to eager plain |")
    print("|---|---:|---:|---:|---:|")
    for name, rate, first, same in rows:
        print(f"| {name} | {rate:.1f} | {rate / plain[name.split()[0]]:.2f}x | "
              f"{'-' if first is None else f'{first:.0f} s'} | {same}/{len(prompts)} |")


if __name__ == "__main__":
    main()
