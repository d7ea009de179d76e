"""The collapse fallback's cost on the real pair: EAGLE 3.1 chain and tree with `collapse_fallback` on and off.

The fallback switches to plain steps when it measures speculation losing; plain steps count one
token per target forward, so where it fires on a drafter that pays on average, tau drops and
tokens/s may follow. All methods run in one process on the same prompts (greedy, chat template).

    .venv/bin/python examples/reproduce/smollm2/fallback.py --prompts mt_bench --count 5
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hf_eagle31 import Eagle3DraftModel
from hf_eagle31.bench.suite import read_texts
from hf_eagle31.bench.drift import prompt_encoders
from hf_eagle31.bench.report import markdown_table
from hf_eagle31.bench.runner import Method, run_all
from hf_eagle31.packaged import load_packaged_model

HERE = Path(__file__).resolve().parents[2] / "smollm2"  # the shipped pair: weights, data, prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", nargs="+", default=["mt_bench"], help="datasets in examples/smollm2/prompts")
    parser.add_argument("--count", type=int, default=5, help="the first prompts of each dataset")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--drafter", default=str(HERE / "eagle31"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
    drafter = Eagle3DraftModel.from_pretrained(args.drafter)
    encode, _ = prompt_encoders(tokenizer, True)
    prompts = [torch.tensor([encode(text)]) for name in args.prompts
               for text in read_texts(str(HERE / "prompts" / f"{name}.jsonl"))[: args.count]]
    methods = [Method("target alone")] + [
        Method(f"EAGLE 3.1 {mode}, fallback {'on' if fallback else 'off'}", {"assistant_model": drafter},
               {"speculation_mode": mode, "collapse_fallback": fallback})
        for mode in ("chain", "tree") for fallback in (True, False)
    ]
    print(markdown_table(run_all(target, prompts, methods, args.max_new_tokens), len(prompts)))


if __name__ == "__main__":
    main()
