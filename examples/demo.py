"""`make demo`: SmolLM2-135M-Instruct and its shipped EAGLE 3.1 drafter, offline. Asks a few chat questions
through the chat template three ways: plain `generate` at default settings, `hf_eagle31.fast_decoding` (plain
decoding on this package's fastest forward), and EAGLE 3.1; shows that the answers are identical, and prints
tokens/s, tau, the memory roofline (the machine's read bandwidth, a step's floor, and each way's tokens/s after the
first token over the floor rate: the floor bounds a decoding step, not the prompt's prefill) and the speedup over
the faster of the two plain ways (with the CPU, threads and dtype), or, where it exceeds tau, a warning that the
plain baseline is handicapped in its place."""

import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import hf_eagle31  # noqa: E402  (routes generate(assistant_model=<EAGLE drafter>))
from hf_eagle31 import Eagle3DraftModel, drafting_dtype  # noqa: E402
from hf_eagle31.bench.roofline import Roofline, read_bandwidth, speedup_claim  # noqa: E402
from hf_eagle31.bench.runner import first_token_seconds  # noqa: E402
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


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> int:
    torch.manual_seed(0)
    # float32: greedy output is compared token for token with the target alone
    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
    drafter = Eagle3DraftModel.from_pretrained(DRAFTER).to(drafting_dtype(target)).eval()  # bf16 where it is fast
    settings = drafter.generation_config
    shape = (f"chain of {settings.num_assistant_tokens} tokens" if settings.speculation_mode == "chain" else
             f"tree of {settings.tree_total_tokens} tokens (top-k {settings.tree_top_k}, depth {settings.tree_depth})")
    machine = f"{cpu_name()}, {torch.get_num_threads()} threads, {str(target.dtype).removeprefix('torch.')}"
    print(f"target: SmolLM2-135M-Instruct, {target.num_parameters() / 1e6:.0f}M parameters; drafter: EAGLE 3.1, "
          f"{drafter.num_parameters() / 1e6:.1f}M parameters, {drafter.dtype}, {shape}\n{machine}\n")
    encode = lambda text: tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    methods = {"generate": {}, "fast decoding": {"custom_generate": hf_eagle31.fast_decoding},
               "EAGLE 3.1": {"assistant_model": drafter}}
    warm_up = encode("Hello!")  # first calls pay one-time setup costs
    for kwargs in methods.values():
        timed_generate(target, warm_up, 8, **kwargs)
    tokens, seconds, first = dict.fromkeys(methods, 0), dict.fromkeys(methods, 0.0), dict.fromkeys(methods, 0.0)
    forwards = emitted = 0
    all_identical = True
    bandwidths = []  # the roofline's probe before each question too: the fastest is the floor (`Roofline.measure`)
    for question in QUESTIONS:
        bandwidths.append(read_bandwidth())
        prompt = encode(question)
        outputs = {}
        for name, kwargs in methods.items():  # the first token timed apart, before the call the drafter's stats tell
            first[name] += first_token_seconds(target, [prompt], {"do_sample": False, **kwargs})
            outputs[name], took = timed_generate(target, prompt, **kwargs)
            tokens[name] += outputs[name].shape[1] - prompt.shape[1]
            seconds[name] += took
        identical = all(torch.equal(out, outputs["generate"]) for out in outputs.values())
        all_identical &= identical
        stats = drafter.speculation_stats
        forwards += stats.speculative_forwards
        emitted += stats.speculative_tokens
        print("-" * 100)
        print(f"\033[1mUser:\033[0m {question}\n\033[1mSmolLM2:\033[0m "
              + tokenizer.decode(outputs["EAGLE 3.1"][0, prompt.shape[1]:], skip_special_tokens=True))
        print(f"[tau {stats.tau:.2f} | identical text: {'yes' if identical else 'NO'}]")
    rates = {name: tokens[name] / seconds[name] for name in methods}
    decoding = {name: (tokens[name] - len(QUESTIONS)) / (seconds[name] - first[name]) for name in methods}
    best, tau = max(("generate", "fast decoding"), key=rates.get), emitted / max(forwards, 1)
    roofline = Roofline.measure(target, bandwidths)  # the fastest a plain step can go here: its weights read once
    print("=" * 100)
    print(f"target alone: generate {rates['generate']:.1f} tokens/s, fast decoding {rates['fast decoding']:.1f} "
          f"tokens/s   EAGLE 3.1: {rates['EAGLE 3.1']:.1f} tokens/s   tau: {tau:.2f}")
    print(f"roofline: {roofline.describe()}; after the first token, over the floor rate: "
          + ", ".join(f"{name} {roofline.of_floor(rate):.2f}" for name, rate in decoding.items()))
    claim = speedup_claim(rates["EAGLE 3.1"] / rates[best], tau, best, roofline.of_floor(decoding[best]))
    print(f"{claim}   (over generate at default settings: {rates['EAGLE 3.1'] / rates['generate']:.2f}x)   "
          f"identical output: {'yes' if all_identical else 'NO'}   [{machine}]")
    return 0 if all_identical else 1


if __name__ == "__main__":
    sys.exit(main())
