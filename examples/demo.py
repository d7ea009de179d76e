"""`make demo`: SmolLM2-135M-Instruct and its shipped EAGLE 3.1 drafter, offline. Asks a few chat questions
through the chat template with the target alone and with EAGLE 3.1, shows that the answers are identical,
and prints tokens/s, tau and the speedup."""

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import hf_eagle31  # noqa: E402,F401  (routes generate(assistant_model=<EAGLE drafter>))
from hf_eagle31 import Eagle3DraftModel, drafting_dtype  # noqa: E402
from hf_eagle31.packaged import load_packaged_model  # noqa: E402

DRAFTER = Path(__file__).parent / "smollm2" / "eagle31"
QUESTIONS = [  # none of them is in the training data or the benchmark sets
    "What is the capital of France, and what is it famous for?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give me three tips for sleeping better.",
]
MAX_NEW_TOKENS = 96


def timed_generate(target, prompt, max_new_tokens=MAX_NEW_TOKENS, **kwargs):
    started = time.perf_counter()
    out = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                          max_new_tokens=max_new_tokens, **kwargs)
    return out, time.perf_counter() - started


def main() -> int:
    torch.manual_seed(0)
    # float32: greedy output is compared token for token with the target alone
    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
    drafter = Eagle3DraftModel.from_pretrained(DRAFTER).to(drafting_dtype(target)).eval()  # bf16 where it is fast
    settings = drafter.generation_config
    shape = (f"chain of {settings.num_assistant_tokens} tokens" if settings.speculation_mode == "chain" else
             f"tree of {settings.tree_total_tokens} tokens (top-k {settings.tree_top_k}, depth {settings.tree_depth})")
    print(f"target: SmolLM2-135M-Instruct, {target.num_parameters() / 1e6:.0f}M parameters, {target.dtype}; "
          f"drafter: EAGLE 3.1, {drafter.num_parameters() / 1e6:.1f}M parameters, {drafter.dtype}, {shape}; "
          f"{torch.get_num_threads()} CPU threads\n")
    encode = lambda text: tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    warm_up = encode("Hello!")  # first calls pay one-time setup costs
    timed_generate(target, warm_up, 8)
    timed_generate(target, warm_up, 8, assistant_model=drafter)
    totals = {"target": [0, 0.0], "eagle": [0, 0.0]}
    forwards = tokens = 0
    all_identical = True
    for question in QUESTIONS:
        prompt = encode(question)
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
        print(f"\033[1mUser:\033[0m {question}\n\033[1mSmolLM2:\033[0m "
              + tokenizer.decode(eagle[0, prompt.shape[1]:], skip_special_tokens=True))
        print(f"[target alone {new / plain_seconds:5.1f} tok/s | EAGLE 3.1 {new / eagle_seconds:5.1f} tok/s | "
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
