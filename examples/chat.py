"""Chat with SmolLM2-135M-Instruct and its EAGLE 3.1 drafter, the answer streamed as it is decoded.

    python examples/chat.py                      # type questions; an empty line ends
    python examples/chat.py --ask "Hi!" --ask "Tell me a joke."

The conversation goes through the chat template each turn; a streamer receives exactly the tokens plain
`generate` would produce (EAGLE emits several per step).
"""

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import TextStreamer  # noqa: E402

import hf_eagle31  # noqa: E402  (routes generate(assistant_model=<EAGLE drafter>))
from hf_eagle31.packaged import load_packaged_model  # noqa: E402

DRAFTER = Path(__file__).parent / "smollm2" / "eagle31"


def questions(asked: list[str] | None):
    if asked:
        yield from asked
        return
    while question := input("\nYou: ").strip():
        yield question


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ask", action="append", help="a question (repeatable); none: read them from the terminal")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    args = parser.parse_args()
    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
    drafter = hf_eagle31.Eagle3DraftModel.from_pretrained(DRAFTER).to(hf_eagle31.drafting_dtype(target)).eval()
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    messages = []
    for question in questions(args.ask):
        messages.append({"role": "user", "content": question})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        print(f"\nYou: {question}\nSmolLM2: ", end="", flush=True)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=False,
                              max_new_tokens=args.max_new_tokens, streamer=streamer)
        messages.append({"role": "assistant",
                         "content": tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)})
        print(f"[tau {drafter.speculation_stats.tau:.2f}]")


if __name__ == "__main__":
    main()
