"""What verify_mode="exact" costs a batch: the real pair in bf16, 4 MT-Bench first turns, 64 new tokens.

    python examples/reproduce/measurements/exact_batch_cost.py

One process, two rounds, best of each: plain batched greedy, EAGLE with "batched" verification,
EAGLE with "exact" verification; each row is checked against plain batched greedy.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

import hf_eagle31  # noqa: F401  (routes generate(assistant_model=<EAGLE drafter>))
from hf_eagle31 import Eagle3DraftModel
from hf_eagle31.packaged import load_packaged_model

HERE = Path(__file__).resolve().parents[2]  # examples/
PROMPTS = HERE.parent.parent / "shared" / "data" / "prompts" / "mt_bench.jsonl"


def main() -> None:
    target, tokenizer = load_packaged_model("smollm2-135m-instruct", dtype=torch.bfloat16)
    drafter = Eagle3DraftModel.from_pretrained(HERE / "smollm2" / "eagle31", dtype=torch.bfloat16)
    tokenizer.padding_side = "left"
    turns = [json.loads(line)["turns"][0] for line in PROMPTS.read_text().splitlines()][:4]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": turn}], add_generation_prompt=True,
                                           tokenize=False) for turn in turns]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    settings = drafter.generation_config.to_dict()

    def run(verify_mode: str | None) -> tuple[torch.Tensor, float]:
        extra = {}
        if verify_mode is not None:
            drafter.generation_config = GenerationConfig(**{**settings, "verify_mode": verify_mode,
                                                            "collapse_fallback": False, "batch_shapes": None})
            extra = {"assistant_model": drafter}
        began = time.perf_counter()
        out = target.generate(**batch, do_sample=False, max_new_tokens=64, pad_token_id=tokenizer.pad_token_id, **extra)
        return out, time.perf_counter() - began

    reference, _ = run(None)  # warm-up, and the rows every method must give
    best = {}
    for _ in range(2):
        for name, mode in (("plain", None), ("batched", "batched"), ("exact", "exact")):
            out, seconds = run(mode)
            best[name] = min(seconds, best.get(name, seconds))
            same = sum(torch.equal(row, expected) for row, expected in zip(out, reference))
            print(f"{name}: {seconds:.2f} s, {same}/{len(reference)} rows equal to plain batched greedy", flush=True)
    print(", ".join(f"{name} {best['plain'] / seconds:.2f}x" for name, seconds in best.items()))


if __name__ == "__main__":
    main()
