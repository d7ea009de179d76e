"""Training data: conversations answered by the target itself (self-distillation), or sequences used as given.

Records, mixed freely, come from a JSONL file, a JSON list (ShareGPT's file; read incrementally,
so a copy cut off mid-record yields every complete record before the cut, with a warning), a
folder of distilled `*.jsonl` chunks, or any iterable of dicts (a `datasets.Dataset` iterates as
dicts, so it needs no special case):
  * ShareGPT `{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}, ...]}` and chat
    `{"messages": [{"role": ..., "content": ...}, ...]}`: the user turns are asked in order and the
    target writes every answer (the record's own answers are kept aside for `answers="given"`);
  * EAGLE's question.jsonl `{"question_id", "category", "turns": [...]}`: every turn asked in order;
  * `{"text": ...}`: a finished text, used as-is (every token is a training target);
  * `{"input_ids": [...], "loss_mask": [...]}`: already tokenized (`loss_mask` optional), as in the
    distilled chunks a training run leaves behind.
The drafter must learn the target's distribution, not a dataset's, hence the self-distillation
(`hf_eagle31.training.distill`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}


@dataclass
class TrainingSequence:
    """Token ids and which of them count as training targets (prompt tokens do not)."""

    input_ids: list[int]
    loss_mask: list[int]

    def as_tensors(self) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor(self.input_ids), "loss_mask": torch.tensor(self.loss_mask)}


@dataclass
class Conversation:
    """What the target is asked: user turns in order, after an optional system prompt; `answers` are the
    record's own replies to them (in order, as far as the record has them)."""

    user_turns: list[str]
    system: str | None = None
    name: str = ""
    answers: list[str] = field(default_factory=list)


# --- reading records -------------------------------------------------------------------------------


def _json_list(text: str, path: Path) -> Iterator[dict]:
    """The elements of a JSON list, one at a time; a list cut off mid-record ends with a warning."""
    decoder = json.JSONDecoder()
    at = text.index("[") + 1
    count = 0
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            warnings.warn(f"{path} is cut off after {count} complete records; the incomplete last one is skipped",
                          stacklevel=2)
            return
        count += 1
        yield record


def read_jsonl(path: Path) -> Iterator[dict]:
    """The records of a JSONL file; a line that is not JSON is named by file and number."""
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}, line {number}: not valid JSON ({err})") from None


def read_records(source: str | Path | Iterable[dict]) -> Iterator[dict]:
    """Raw records from a JSONL file, a JSON list file, a folder of JSONL chunks, or an iterable of dicts."""
    if not isinstance(source, (str, Path)):
        yield from source
        return
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise FileNotFoundError(f"training data folder {path} holds no .jsonl files")
        for file in files:
            yield from read_jsonl(file)
    elif not path.is_file():
        raise FileNotFoundError(f"training data {path} does not exist")
    else:
        text = path.read_text()
        if text.lstrip().startswith("["):
            yield from _json_list(text, path)
        else:
            yield from read_jsonl(path)


def _conversation(turns: list, number: int, name: str) -> Conversation:
    """ShareGPT / chat turns: user turns in order, and the first answer after each of them."""
    users, answers, system = [], [], None
    for turn in turns:
        if not isinstance(turn, dict):
            raise ValueError(f"training record {number}: a turn is {type(turn).__name__}, not an object")
        role = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if role not in ROLES or not isinstance(text, str):
            raise ValueError(f"training record {number}: a turn with role {role!r} and no text; expected "
                             f"'from'/'role' in {sorted(ROLES)} and a 'value'/'content' string")
        if ROLES[role] == "user" and text.strip():
            users.append(text)
        elif ROLES[role] == "assistant" and len(answers) < len(users):
            answers.extend([""] * (len(users) - 1 - len(answers)) + [text])  # an unanswered turn gets ""
        elif ROLES[role] == "system" and not users:
            system = text
    return Conversation(users, system, name, answers)


def parse_record(record, number: int) -> Conversation | TrainingSequence | str | None:
    """One record as a conversation to answer, a finished sequence, a text, or None (nothing to use)."""
    if not isinstance(record, dict):
        raise ValueError(f"training record {number} is a JSON {type(record).__name__}, not an object; expected one "
                         "of 'conversations', 'messages', 'turns', 'text' or 'input_ids' per record")
    name = str(record.get("question_id", record.get("id", number)))
    if record.get("input_ids"):
        ids = [int(i) for i in record["input_ids"]]
        mask = [int(m) for m in record.get("loss_mask", [1] * len(ids))]
        if len(mask) != len(ids):
            raise ValueError(f"training record {number}: loss_mask has {len(mask)} entries for {len(ids)} tokens")
        return TrainingSequence(ids, mask)
    if "conversations" in record or "messages" in record:
        conversation = _conversation(record.get("conversations") or record.get("messages") or [], number, name)
        return conversation if conversation.user_turns else None
    if record.get("turns"):
        return Conversation([str(t) for t in record["turns"]], record.get("system"), name)
    if record.get("text"):
        return str(record["text"])
    raise ValueError(f"training record {number} has no non-empty 'conversations', 'messages', 'turns', 'text' or "
                     "'input_ids'")


@dataclass
class Examples:
    conversations: list[Conversation]
    sequences: list[TrainingSequence]
    texts: list[str]
    skipped: int  # records with no user turn (a ShareGPT record holding only answers)


def read_examples(source: str | Path | Iterable[dict]) -> Examples:
    """Every record of `source`, sorted by kind; raises on an empty source or a malformed record."""
    examples = Examples([], [], [], 0)
    for number, record in enumerate(read_records(source), 1):
        item = parse_record(record, number)
        if item is None:
            examples.skipped += 1
        elif isinstance(item, Conversation):
            examples.conversations.append(item)
        elif isinstance(item, TrainingSequence):
            examples.sequences.append(item)
        else:
            examples.texts.append(item)
    if not (examples.conversations or examples.sequences or examples.texts):
        raise ValueError(f"the training data {source if isinstance(source, (str, Path)) else ''} is empty")
    return examples


# --- prompts and answers ---------------------------------------------------------------------------


def render(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation up to a user turn, as the target sees it when it is to answer: the chat template
    when the tokenizer has one, else the turns and answers joined by blank lines."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer("\n\n".join(m["content"] for m in messages if m["role"] != "system"))["input_ids"]


def encode_prompt(tokenizer, turn: str) -> list[int]:
    """One user turn as the first message of a conversation."""
    return render(tokenizer, [{"role": "user", "content": turn}])


def eos_ids(target: PreTrainedModel) -> set[int]:
    eos = target.generation_config.eos_token_id
    return set([eos] if isinstance(eos, int) else (eos or []))


@torch.no_grad()
def answer_prompts(
    target: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int | list[int],
    batch_size: int = 8,
    temperature: float = 0.0,
    pad_token_id: int = 0,
    progress: tqdm | None = None,
) -> list[list[int]]:
    """The target's answer to every prompt (batched, left-padded; greedy unless `temperature > 0`).

    Prompts are batched by length (less padding); answers come back in the prompts' order, each
    cut at its first eos (kept, so the drafter learns to propose it) or at its own token limit.
    """
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    eos = eos_ids(target)
    answers: list[list[int]] = [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    sample = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.tensor([[pad_token_id] * (width - len(prompts[i])) + prompts[i] for i in rows], device=target.device)
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in rows], device=target.device)
        # a static cache is written in place; the default one is re-concatenated at every step, which on a CPU
        # costs more than the model itself for a batch of long prompts
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(limits[i] for i in rows),
                              pad_token_id=pad_token_id, cache_implementation="static", **sample)
        for row, answer in zip(rows, out[:, width:].tolist()):
            answer = answer[: limits[row]]
            ends = [i for i, token in enumerate(answer) if token in eos]
            answers[row] = answer[: ends[0] + 1] if ends else answer
            if progress is not None:
                progress.update(len(answers[row]))
    return answers


def self_distill(
    target: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int = 256,
    batch_size: int = 8,
    temperature: float = 0.0,
    pad_token_id: int = 0,
) -> list[TrainingSequence]:
    """Tokenized prompts answered by the target, as training sequences (the loss covers the answer only)."""
    answers = answer_prompts(target, prompts, max_new_tokens, batch_size, temperature, pad_token_id)
    return [TrainingSequence(p + a, [0] * len(p) + [1] * len(a)) for p, a in zip(prompts, answers)]


def fit_length(sequences: list[TrainingSequence], max_length: int) -> list[TrainingSequence]:
    """Cut sequences to `max_length`; drop those left with nothing to predict (the first two tokens never are)."""
    cut = [TrainingSequence(s.input_ids[:max_length], s.loss_mask[:max_length]) for s in sequences]
    return [s for s in cut if any(s.loss_mask[2:])]


def save_sequences(sequences: list[TrainingSequence], path: Path) -> None:
    """Write atomically: a chunk file exists whole or not at all, which is what resuming relies on."""
    scratch = path.with_name(path.name + ".tmp")
    with scratch.open("w") as f:
        for s in sequences:
            f.write(json.dumps({"input_ids": s.input_ids, "loss_mask": s.loss_mask}) + "\n")
    scratch.replace(path)


def load_sequences(path: Path) -> list[TrainingSequence]:
    return [item for number, record in enumerate(read_records(path), 1)
            if isinstance(item := parse_record(record, number), TrainingSequence)]


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
    """A shuffle that depends only on (seed, epoch), so a resumed run sees exactly the same batches.

    Given the sequences' `lengths` and the `batch_size`, each run of 16 batches is sorted by length
    before it is cut into batches, whose order is then shuffled: a batch pads to its longest
    sequence, and random batches of chat data, of very mixed lengths, waste much of a step on padding.
    """

    GROUP = 16  # batches sorted together

    def __init__(self, size: int, seed: int, lengths: list[int] | None = None, batch_size: int = 1):
        self.size, self.seed, self.epoch = size, seed, 0
        self.lengths, self.batch_size = lengths, batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=generator).tolist()
        if self.lengths is None:
            return iter(order)
        span = self.GROUP * self.batch_size
        grouped = [i for start in range(0, self.size, span)
                   for i in sorted(order[start : start + span], key=lambda i: -self.lengths[i])]
        batches = [grouped[start : start + self.batch_size] for start in range(0, self.size, self.batch_size)]
        return iter(i for b in torch.randperm(len(batches), generator=generator).tolist() for i in batches[b])
