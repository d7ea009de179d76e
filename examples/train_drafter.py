"""Train an EAGLE 3.1 drafter end to end, measure its acceptance, and decode with it.

    python examples/train_drafter.py                                   # a tiny random target, ~1-2 min on CPU
    python examples/train_drafter.py --target DIR --data prompts.jsonl --steps 2000 --out drafter/

Without --target it builds a tiny Llama over a character-level tokenizer (so nothing is
downloaded), writes the prompts below as a question.jsonl, and trains on the target's own answers.
The same run is `hf-eagle31 train --target DIR --data FILE --out DIR ...` on the command line.
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_eagle31 import Eagle3DraftModel  # importing hf_eagle31 also routes generate() to EAGLE decoding
from hf_eagle31.model_cards.card import write_model_card
from hf_eagle31.training import drafter_config_for, evaluate_acceptance, train_drafter
from hf_eagle31.training.data import encode_prompt, self_distill

SUBJECTS = ["the sea", "a city", "bread", "a river", "music", "winter", "a garden", "the moon", "old maps", "trains",
            "coffee", "a library", "rain", "mountains", "chess", "bicycles"]
FORMS = ["Write a short poem about {}.", "Describe {} in one sentence.", "Why do people like {}?",
         "Tell a story about {}."]


def tiny_target(folder: Path) -> None:
    """A random 4-layer Llama and a character tokenizer, saved like any Hub checkpoint."""
    from tokenizers import Tokenizer, decoders, models

    chars = list(string.printable[:95])
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", *chars])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    target = LlamaForCausalLM(config)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)  # peaked next-token distributions, like a trained model's
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target model folder (default: build a tiny one)")
    parser.add_argument("--data", help="question.jsonl of prompts (default: built-in prompts)")
    parser.add_argument("--out", default="runs/train_drafter", help="output folder")
    parser.add_argument("--arch", default="eagle3.1", choices=["eagle3", "eagle3.1"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--acceptance-steps", type=int, default=10)
    parser.add_argument("--answer-max-new-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    out = Path(args.out)
    target_dir = Path(args.target) if args.target else out / "target"
    if not args.target:
        tiny_target(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    data = Path(args.data) if args.data else out / "prompts.jsonl"
    if not args.data:
        prompts = [form.format(subject) for subject in SUBJECTS for form in FORMS]
        data.write_text("".join(json.dumps({"question_id": i, "category": "demo", "turns": [p]}) + "\n"
                                for i, p in enumerate(prompts)))

    # held-out answers: the target's own continuations of prompts it does not train on
    held_out_prompts = [encode_prompt(tokenizer, f"Write a letter about {s}.") for s in SUBJECTS[:8]]
    held_out = self_distill(target, held_out_prompts, args.answer_max_new_tokens, batch_size=8,
                            pad_token_id=tokenizer.pad_token_id or 0)

    untrained = Eagle3DraftModel(drafter_config_for(target, args.arch))
    before = evaluate_acceptance(untrained, target, held_out, depth=5)
    drafter = train_drafter(target, data, out / "drafter", tokenizer=tokenizer, arch=args.arch, steps=args.steps,
                            acceptance_steps=args.acceptance_steps, lr=args.lr, batch_size=16,
                            answer_max_new_tokens=args.answer_max_new_tokens, save_every=50)
    after = evaluate_acceptance(drafter, target, held_out, depth=5)
    print("\nheld-out acceptance per depth (teacher-forced, greedy):")
    print("  untrained:", " ".join(f"{a:.2f}" for a in before.acceptance), f"| expected length {before.expected_length:.2f}")
    print("  trained:  ", " ".join(f"{a:.2f}" for a in after.acceptance), f"| expected length {after.expected_length:.2f}")

    # a random tiny target barely generalises, so decode a training prompt, where the drafter is good
    ids = torch.tensor([encode_prompt(tokenizer, json.loads(data.read_text().splitlines()[0])["turns"][0])])
    plain = target.generate(ids, max_new_tokens=32, do_sample=False)
    eagle = target.generate(ids, assistant_model=drafter, max_new_tokens=32, do_sample=False)
    assert torch.equal(plain, eagle), "speculative decoding changed the greedy output"
    print(f"generate(assistant_model=drafter) on a training prompt: same tokens as plain greedy, "
          f"{drafter.speculation_stats.tau:.2f} tokens per target forward")
    write_model_card(out / "drafter", benchmark={"runs": [{"name": "teacher-forced, held-out", **after.as_dict()}]})
    print(f"drafter, log and model card in {out / 'drafter'}")


if __name__ == "__main__":
    main()
