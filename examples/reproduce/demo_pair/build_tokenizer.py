"""Train the demo pair's byte-level BPE on the train split and save it as a transformers tokenizer.

Byte-level so any text round-trips (no unknown token); 8k entries so the embedding stays a small
part of a ~34 MB target. Encoding prepends <s> like Llama's tokenizers do, so `tokenizer(prompt)`
gives what the models were trained on (documents are `<s> text </s>` in the training stream).

    python examples/reproduce/demo_pair/build_tokenizer.py      # reads data/train.jsonl, writes data/tokenizer/
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parents[2] / "demo_pair"  # the shipped pair and its data
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def texts(path: Path) -> Iterator[str]:
    with path.open() as lines:
        for line in lines:
            yield json.loads(line)["text"]


def train_tokenizer(train_jsonl: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    bpe.train_from_iterator(texts(train_jsonl), trainer=trainer)
    bos = SPECIAL["bos_token"]
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bpe.token_to_id(bos))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe, model_max_length=4096, **SPECIAL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=HERE / "data")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()
    tokenizer = train_tokenizer(args.data / "train.jsonl", args.vocab_size)
    tokenizer.save_pretrained(args.data / "tokenizer")
    sample = "def add(a, b):\n    return a + b\n"
    ids = tokenizer(sample)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == sample, "byte-level BPE must round-trip"
    print(f"vocab {len(tokenizer)}; {sample!r} -> {len(ids)} ids {tokenizer.convert_ids_to_tokens(ids)}")


if __name__ == "__main__":
    main()
