"""`make demo`: the shipped demo pair, offline. Generates from held-out prompts with the target alone and with
EAGLE 3.1, shows that the text is identical, and prints tokens/s, tau and the speedup."""

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import hf_eagle31  # noqa: E402,F401  (routes generate(assistant_model=<EAGLE drafter>))
from hf_eagle31 import Eagle3DraftModel  # noqa: E402

DEMO = Path(__file__).parent / "demo_pair"
PROMPTS, MAX_NEW_TOKENS = 4, 96


def timed_generate(target, prompt, **kwargs):
    started = time.perf_counter()
    out = target.generate(prompt, do_sample=False, max_new_tokens=MAX_NEW_TOKENS, **kwargs)
    return out, time.perf_counter() - started


def main() -> int:
    if not (DEMO / "target").is_dir() or not (DEMO / "eagle31").is_dir():
        print("no demo pair yet (examples/demo_pair/target and eagle31 are built by examples/demo_pair/)")
        return 0
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(DEMO / "target")
    # float32: most CPUs have no bf16 matrix units, and batched bf16 matmuls are slow there
    target = AutoModelForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32).eval()
    drafter = Eagle3DraftModel.from_pretrained(DEMO / "eagle31").to(target.dtype).eval()
    records = [json.loads(line) for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()][:PROMPTS]
    settings = drafter.generation_config
    shape = (f"chain of {settings.num_assistant_tokens} tokens" if settings.speculation_mode == "chain" else
             f"tree of {settings.tree_total_tokens} tokens (top-k {settings.tree_top_k}, depth {settings.tree_depth})")
    print(f"target: {target.config.num_hidden_layers}-layer Llama, {target.num_parameters() / 1e6:.1f}M parameters, "
          f"{target.dtype}; drafter: EAGLE 3.1, {shape}; {torch.get_num_threads()} CPU threads\n")
    warm_up = tokenizer(records[0]["text"], return_tensors="pt").input_ids  # first calls pay one-time setup costs
    timed_generate(target, warm_up)
    timed_generate(target, warm_up, assistant_model=drafter)
    totals = {"target": [0, 0.0], "eagle": [0, 0.0]}
    forwards = tokens = 0
    all_identical = True
    for record in records:
        prompt = tokenizer(record["text"], return_tensors="pt").input_ids
        plain, plain_seconds = timed_generate(target, prompt)
        eagle, eagle_seconds = timed_generate(target, prompt, assistant_model=drafter)
        new = plain.shape[1] - prompt.shape[1]
        identical = torch.equal(plain, eagle)
        all_identical &= identical
        stats = drafter.speculation_stats
        forwards += stats.speculative_forwards
        tokens += stats.speculative_tokens
        totals["target"][0] += new
        totals["target"][1] += plain_seconds
        totals["eagle"][0] += eagle.shape[1] - prompt.shape[1]
        totals["eagle"][1] += eagle_seconds
        print("-" * 100)
        print(tokenizer.decode(prompt[0]) + "\033[1m" + tokenizer.decode(eagle[0, prompt.shape[1]:]) + "\033[0m")
        print(f"[target alone {new / plain_seconds:6.1f} tok/s | EAGLE 3.1 {new / eagle_seconds:6.1f} tok/s | "
              f"tau {stats.tau:.2f} | identical text: {'yes' if identical else 'NO'}]")
    target_rate = totals["target"][0] / totals["target"][1]
    eagle_rate = totals["eagle"][0] / totals["eagle"][1]
    print("=" * 100)
    print(f"target alone: {target_rate:.1f} tokens/s   EAGLE 3.1: {eagle_rate:.1f} tokens/s   "
          f"tau: {tokens / max(forwards, 1):.2f}   speedup: {eagle_rate / target_rate:.2f}x   "
          f"identical output: {'yes' if all_identical else 'NO'}")
    return 0 if all_identical else 1


if __name__ == "__main__":
    sys.exit(main())
