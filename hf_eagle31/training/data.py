"""Training data: prompts answered by the target itself (self-distillation), or conversations as given.

Three kinds of record, mixed freely, from a JSONL file or any iterable of dicts (a `datasets.Dataset`
iterates as dicts, so it needs no special case):
  * `{"question_id", "category", "turns": [...]}` (EAGLE's question.jsonl): the first turn is a prompt,
    formatted with the tokenizer's chat template when it has one, and the target writes the answer;
  * `{"text": ...}`: a finished conversation, used as-is (every token is a training target);
  * `{"input_ids": [...], "loss_mask": [...]}`: already tokenized (`loss_mask` optional), as in the
    `distilled.jsonl` a training run leaves behind.
The drafter must learn the target's distribution, not a dataset's, hence the self-distillation.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel


@dataclass
class TrainingSequence:
    """Token ids and which of them count as training targets (prompt tokens do not)."""

    input_ids: list[int]
    loss_mask: list[int]

    def as_tensors(self) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor(self.input_ids), "loss_mask": torch.tensor(self.loss_mask)}


def read_examples(source: str | Path | Iterable[dict]) -> list[dict]:
    """Records from a JSONL file or an iterable of dicts; each must have `turns` or `text`."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"training data {path} does not exist")
        with path.open() as f:
            examples = []
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        examples.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}, line {number}: not valid JSON ({err})") from None
    else:
        examples = [dict(example) for example in source]
    for number, example in enumerate(examples, 1):
        if not (example.get("turns") or example.get("text") or example.get("input_ids")):
            raise ValueError(f"training record {number} has no non-empty 'turns', 'text' or 'input_ids'")
    if not examples:
        raise ValueError(f"the training data {source if isinstance(source, (str, Path)) else ''} is empty")
    return examples


def encode_prompt(tokenizer, turn: str) -> list[int]:
    """A user turn as the target sees it in a conversation: through its chat template when it has one."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": turn}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(turn)["input_ids"]


def encode_examples(examples: list[dict], tokenizer, context: int) -> tuple[list[list[int]], list[TrainingSequence]]:
    """Split records into tokenized prompts (to be answered) and finished sequences (used as-is).

    Raises before any generation if a prompt does not fit the target's context.
    """
    prompts, texts = [], []
    for number, example in enumerate(examples, 1):
        if example.get("input_ids"):
            ids = [int(i) for i in example["input_ids"]]
            mask = [int(m) for m in example.get("loss_mask", [1] * len(ids))]
            if len(mask) != len(ids):
                raise ValueError(f"training record {number}: loss_mask has {len(mask)} entries for {len(ids)} tokens")
            texts.append(TrainingSequence(ids, mask))
        elif tokenizer is None:
            raise ValueError("the training data needs a tokenizer (none was given and the target folder has none)")
        elif example.get("turns"):
            ids = encode_prompt(tokenizer, example["turns"][0])
            if len(ids) >= context:
                name = example.get("question_id", number)
                raise ValueError(
                    f"prompt {name} is {len(ids)} tokens long, which does not fit the target's context of "
                    f"{context} tokens (max_position_embeddings)"
                )
            prompts.append(ids)
        else:
            ids = tokenizer(example["text"])["input_ids"]
            texts.append(TrainingSequence(ids, [1] * len(ids)))
    return prompts, texts


def _eos_ids(target: PreTrainedModel) -> set[int]:
    eos = target.generation_config.eos_token_id
    return set([eos] if isinstance(eos, int) else (eos or []))


@torch.no_grad()
def self_distill(
    target: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int = 256,
    batch_size: int = 8,
    temperature: float = 0.0,
    pad_token_id: int = 0,
) -> list[TrainingSequence]:
    """The target answers every prompt (batched, left-padded; greedy unless `temperature > 0`).

    Each answer ends at its first eos (kept, so the drafter learns to propose it); the loss covers
    the answer only.
    """
    device = target.device
    eos = _eos_ids(target)
    sequences = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="self-distillation", unit="batch"):
        batch = prompts[start : start + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        sample = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                              pad_token_id=pad_token_id, **sample)
        for prompt, answer in zip(batch, out[:, width:].tolist()):
            ends = [i for i, token in enumerate(answer) if token in eos]
            answer = answer[: ends[0] + 1] if ends else answer
            sequences.append(TrainingSequence(prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return sequences


def fit_length(sequences: list[TrainingSequence], max_length: int) -> list[TrainingSequence]:
    """Cut sequences to `max_length`; drop those left with nothing to predict (the first two tokens never are)."""
    cut = [TrainingSequence(s.input_ids[:max_length], s.loss_mask[:max_length]) for s in sequences]
    return [s for s in cut if any(s.loss_mask[2:])]


def save_sequences(sequences: list[TrainingSequence], path: Path) -> None:
    with path.open("w") as f:
        for s in sequences:
            f.write(json.dumps({"input_ids": s.input_ids, "loss_mask": s.loss_mask}) + "\n")


def load_sequences(path: Path) -> list[TrainingSequence]:
    with path.open() as f:
        return [TrainingSequence(**json.loads(line)) for line in f if line.strip()]


class SequenceDataset(torch.utils.data.Dataset):
    def __init__(self, sequences: list[TrainingSequence]):
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.sequences[index].as_tensors()


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad every field to the longest item (zeros); `attention_mask` marks the real tokens.

    Right padding keeps positions 0..n-1 for every sequence, and causal attention keeps the pad
    entries out of the real ones.
    """
    width = max(item["input_ids"].shape[0] for item in items)
    batch = {
        key: torch.stack([
            torch.nn.functional.pad(item[key], (0, 0) * (item[key].dim() - 1) + (0, width - item[key].shape[0]))
            for item in items
        ])
        for key in items[0]
    }
    lengths = torch.tensor([item["input_ids"].shape[0] for item in items])
    batch["attention_mask"] = (torch.arange(width)[None] < lengths[:, None]).long()
    return batch


class EpochShuffle(torch.utils.data.Sampler):
    """A shuffle that depends only on (seed, epoch), so a resumed run sees exactly the same batches."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        return iter(torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())
