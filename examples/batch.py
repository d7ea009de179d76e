"""A batch of prompts in one EAGLE call: left-padded, decoded together, each row exactly as plain batched greedy
`generate` decodes it, with each row's own statistics.

    python examples/batch.py [--max-new-tokens 64]
"""

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import hf_eagle31  # noqa: E402  (routes generate(assistant_model=<EAGLE drafter>))
from hf_eagle31.packaged import load_packaged_model  # noqa: E402

DRAFTER = Path(__file__).parent / "smollm2" / "eagle31"
QUESTIONS = ["What is the boiling point of water?", "Name three primary colours.",
             "Write a haiku about the sea.", "How many legs does a spider have?"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
    drafter = hf_eagle31.Eagle3DraftModel.from_pretrained(DRAFTER).to(hf_eagle31.drafting_dtype(target)).eval()
    tokenizer.padding_side = "left"  # EAGLE, like plain generate, continues from the last real token of each row
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens)
    out = target.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens, assistant_model=drafter,
                          return_dict_in_generate=True)
    width = inputs["input_ids"].shape[1]
    for question, row, stats in zip(QUESTIONS, out.sequences, out.speculation_stats.per_row):
        answer = tokenizer.decode(row[width:], skip_special_tokens=True).strip()
        print(f"{question}\n  {answer[:120]}{'...' if len(answer) > 120 else ''}  [tau {stats.tau:.2f}]")
    identical = torch.equal(out.sequences, plain)
    print(f"every row identical to plain batched greedy generate: {'yes' if identical else 'NO'}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
