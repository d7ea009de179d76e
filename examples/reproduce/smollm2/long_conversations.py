"""Long conversations: the target alone against the shipped EAGLE 3.1 drafter when the prompt is a whole held-out
chat history (1,000-3,000 tokens up to its last question) instead of one question.

    .venv/bin/python examples/reproduce/smollm2/long_conversations.py [--dtype bfloat16] [--conversations 6]

Greedy, batch 1, each call as a user makes it (the EAGLE call packs its own weights, plain decoding runs the target's
own), the two interleaved per conversation. Each prompt's prefill is also timed alone (`max_new_tokens=1`) so the
decoding's own rate can be given beside the end-to-end one: at 2,000 tokens the 2-core CPU spends seconds on it.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_eagle31 import Eagle3DraftModel, drafting_dtype
from hf_eagle31.packaged import packaged_model_path

HERE = Path(__file__).resolve().parents[2] / "smollm2"  # the shipped pair: weights, data, prompts


def histories(tokenizer, count: int, shortest: int, longest: int) -> list[list[int]]:
    """The first `count` held-out conversations whose history up to the last user turn has shortest-longest tokens."""
    prompts = []
    for line in (HERE / "heldout_conversations.jsonl").read_text().splitlines():
        messages = json.loads(line)["messages"]
        last = max(i for i, message in enumerate(messages) if message["role"] == "user")
        ids = tokenizer.apply_chat_template(messages[: last + 1], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        if shortest <= len(ids) <= longest:
            prompts.append(list(ids))
        if len(prompts) == count:
            break
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--min-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=3000)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    path = packaged_model_path("smollm2-135m-instruct")
    target = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    drafter = Eagle3DraftModel.from_pretrained(HERE / "eagle31").to(drafting_dtype(target)).eval()
    prompts = histories(AutoTokenizer.from_pretrained(path), args.conversations, args.min_tokens, args.max_tokens)
    print("prompt tokens:", [len(ids) for ids in prompts])
    runs = {"target alone": {}, "EAGLE 3.1": {"assistant_model": drafter}}
    seconds = {name: 0.0 for name in runs}
    prefill = {name: 0.0 for name in runs}
    tokens = {name: 0 for name in runs}
    identical = forwards = speculated = 0
    target.generate(torch.tensor([prompts[0][:64]]), max_new_tokens=8, do_sample=False, assistant_model=drafter)
    for index, ids in enumerate(prompts):
        outputs = {}
        for name in list(runs)[:: 1 if index % 2 == 0 else -1]:
            prompt = torch.tensor([ids])
            started = time.perf_counter()
            target.generate(prompt, max_new_tokens=1, do_sample=False, **runs[name])
            prefill[name] += time.perf_counter() - started
            started = time.perf_counter()
            out = target.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False, **runs[name])
            seconds[name] += time.perf_counter() - started
            outputs[name] = out[0, len(ids):].tolist()
            tokens[name] += len(outputs[name])
            if name == "EAGLE 3.1":
                forwards += drafter.speculation_stats.speculative_forwards
                speculated += drafter.speculation_stats.speculative_tokens
        identical += outputs["target alone"] == outputs["EAGLE 3.1"]
    rates = {name: (tokens[name] / seconds[name],
                    (tokens[name] - len(prompts)) / (seconds[name] - prefill[name])) for name in runs}
    print(f"\n{args.dtype}, {len(prompts)} conversations, {args.max_new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads\n")
    print("| | end to end, tokens/s | decoding alone, tokens/s | prefill, s a prompt |\n|---|---:|---:|---:|")
    for name, (whole, decoding) in rates.items():
        print(f"| {name} | {whole:.2f} | {decoding:.2f} | {prefill[name] / len(prompts):.2f} |")
    (whole, decoding), (plain_whole, plain_decoding) = rates["EAGLE 3.1"], rates["target alone"]
    print(f"\nspeedup: {whole / plain_whole:.2f}x end to end, {decoding / plain_decoding:.2f}x decoding alone; "
          f"tau {speculated / max(forwards, 1):.2f}; "
          f"{identical} of {len(prompts)} outputs identical to the target alone")


if __name__ == "__main__":
    main()
