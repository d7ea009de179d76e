"""Self-distillation: the target writes every answer of every conversation, turn by turn, in resumable chunks.

EAGLE-3 regenerates the assistant turns of its training chats with the target, so that the
drafter learns the target's distribution rather than the dataset's. Each user turn is rendered
with everything before it (earlier answers being the target's own) through the chat template,
as a chat application would send it, and answered; a conversation ends at its last user turn, at
`max_turns`, when an answer is cut at `max_new_tokens`, or when the next answer would not fit in
`max_length`. Work is split into chunks of conversations, each written whole to its own file, so
an interrupted run resumes at the first missing chunk and `token_budget` (answer tokens) bounds
the cost up front.

`answers="given"` builds the same sequences from the records' own answers instead (EAGLE-1's
fixed data): nothing is generated, so a token costs the feature pass alone, about a third of what
self-distillation costs on a CPU, at the price of text the target would not have written.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm
from transformers import PreTrainedModel

from hf_eagle31.packaged import model_name
from hf_eagle31.training.data import (
    Conversation,
    TrainingSequence,
    answer_prompts,
    eos_ids,
    load_sequences,
    render,
    save_sequences,
)

MANIFEST = "distill.json"
CHUNK_LOG = "chunks.log"  # one JSON report per chunk written (not *.jsonl: the folder is readable as training data)
MIN_ANSWER_TOKENS = 16  # a turn is asked only if this many answer tokens (or max_new_tokens) still fit


@dataclass(frozen=True)
class DistillSettings:
    max_length: int = 2048  # tokens per conversation, prompts and answers together
    max_new_tokens: int = 256  # per answer
    max_turns: int | None = None  # user turns answered per conversation (None: all)
    batch_size: int = 32  # prompts per generate call
    temperature: float = 0.0  # 0: greedy answers

    def validate(self) -> None:
        if self.max_length < MIN_ANSWER_TOKENS + 1 or self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError(f"distillation needs max_length > {MIN_ANSWER_TOKENS}, max_new_tokens >= 1 and "
                             f"batch_size >= 1 (got {self.max_length}, {self.max_new_tokens}, {self.batch_size})")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"max_turns must be at least 1 (or None for all turns), got {self.max_turns}")
        if self.temperature < 0:
            raise ValueError(f"temperature cannot be negative, got {self.temperature}")


@dataclass
class DistillReport:
    conversations: int = 0
    turns: int = 0  # user turns answered
    answer_tokens: int = 0
    prompt_tokens: int = 0  # tokens of the final sequences that are not training targets
    too_long: int = 0  # conversations whose first turn alone did not fit in max_length (dropped)
    turns_left_out: int = 0  # later user turns not asked (too long, cut answer, or max_turns)
    seconds: float = 0.0

    def add(self, other: "DistillReport") -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)


@dataclass
class _Dialogue:
    """One conversation being answered: its messages so far and its token sequence with the loss mask."""

    conversation: Conversation
    messages: list[dict] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    open: bool = True


def _pad_id(target: PreTrainedModel, tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        eos = sorted(eos_ids(target))
        pad = eos[0] if eos else 0
    return pad


def given(tokenizer, dialogues: list[_Dialogue], turn: int, answer_limits: list[int], end: int) -> list[list[int]]:
    """Each record's own answer to `turn` as the target would emit it (its text, then `end`), cut to its limit."""
    answers = []
    for dialogue, answer_limit in zip(dialogues, answer_limits):
        ids = tokenizer(dialogue.conversation.answers[turn], add_special_tokens=False)["input_ids"] + [end]
        answers.append(ids[:answer_limit])
    return answers


ANSWERS = ("target", "given")


def check_answers(answers: str) -> None:
    if answers not in ANSWERS:
        raise ValueError(f"answers must be 'target' (the target writes them, self-distillation) or 'given' (the "
                         f"records' own), got {answers!r}")


def _end_id(target: PreTrainedModel, tokenizer) -> int:
    """The token that ends the target's answers: the tokenizer's eos if the target stops on it."""
    eos = eos_ids(target)
    if tokenizer.eos_token_id in eos or not eos:
        return tokenizer.eos_token_id
    return sorted(eos)[0]


def distill_conversations(
    target: PreTrainedModel, tokenizer, conversations: list[Conversation], settings: DistillSettings,
    progress: tqdm | None = None, answers: str = "target",
) -> tuple[list[TrainingSequence], DistillReport]:
    """Answer every conversation turn by turn (one batched pass per turn index); one sequence each.

    With `answers="given"` the records' own answers are used and a conversation ends at its first
    user turn without one."""
    check_answers(answers)
    own = answers == "given"
    started = time.perf_counter()
    eos = eos_ids(target)
    report = DistillReport(conversations=len(conversations))
    dialogues = [_Dialogue(c, [{"role": "system", "content": c.system}] if c.system else []) for c in conversations]
    turns = max((len(c.user_turns) for c in conversations), default=0)
    limit = turns if settings.max_turns is None else min(turns, settings.max_turns)
    for turn in range(limit):
        asked, prompts, answer_limits = [], [], []
        for dialogue in dialogues:
            if not dialogue.open or turn >= len(dialogue.conversation.user_turns):
                continue
            if own and not (turn < len(dialogue.conversation.answers) and dialogue.conversation.answers[turn].strip()):
                dialogue.open = False
                continue
            messages = dialogue.messages + [{"role": "user", "content": dialogue.conversation.user_turns[turn]}]
            prompt = render(tokenizer, messages)
            answer_limit = min(settings.max_new_tokens, settings.max_length - len(prompt))
            if answer_limit < min(MIN_ANSWER_TOKENS, settings.max_new_tokens):
                dialogue.open = False
                report.too_long += turn == 0
                continue
            dialogue.messages = messages
            asked.append(dialogue)
            prompts.append(prompt)
            answer_limits.append(answer_limit)
        if not asked:
            break
        if own:
            replies = given(tokenizer, asked, turn, answer_limits, _end_id(target, tokenizer))
            if progress is not None:
                progress.update(sum(map(len, replies)))
        else:
            replies = answer_prompts(target, prompts, answer_limits, settings.batch_size, settings.temperature,
                                     _pad_id(target, tokenizer), progress)
        for dialogue, prompt, answer, answer_limit in zip(asked, prompts, replies, answer_limits):
            # earlier answers stay training targets when the re-rendered prompt extends the sequence token
            # for token (a tokenizer may merge differently across a turn boundary; then they become context)
            kept = dialogue.mask if prompt[: len(dialogue.ids)] == dialogue.ids else []
            dialogue.mask = kept + [0] * (len(prompt) - len(kept)) + [1] * len(answer)
            dialogue.ids = prompt + answer
            finished = bool(answer) and answer[-1] in eos
            text = (dialogue.conversation.answers[turn] if own
                    else tokenizer.decode(answer[:-1] if finished else answer, skip_special_tokens=True))
            dialogue.messages = dialogue.messages + [{"role": "assistant", "content": text}]
            dialogue.open = finished and len(answer) < answer_limit
            report.turns += 1
    sequences = []
    for dialogue in dialogues:
        asked = sum(1 for m in dialogue.messages if m["role"] == "user")
        report.turns_left_out += len(dialogue.conversation.user_turns) - asked if dialogue.ids else 0
        if dialogue.ids:
            sequences.append(TrainingSequence(dialogue.ids, dialogue.mask))
            report.answer_tokens += sum(dialogue.mask)
            report.prompt_tokens += len(dialogue.mask) - sum(dialogue.mask)
    report.seconds = time.perf_counter() - started
    return sequences, report


def fingerprint(conversations: list[Conversation], with_answers: bool = False) -> str:
    digest = hashlib.sha256()
    for c in conversations:
        digest.update(json.dumps([c.system, c.user_turns] + ([c.answers] if with_answers else [])).encode())
    return digest.hexdigest()


def distill_to_folder(
    target: PreTrainedModel,
    tokenizer,
    conversations: list[Conversation],
    folder: str | Path,
    settings: DistillSettings,
    token_budget: int | None = None,
    chunk_size: int = 256,
    process_index: int = 0,
    num_processes: int = 1,
    answers: str = "target",
) -> tuple[list[TrainingSequence], DistillReport]:
    """Distil `conversations` in chunks into `folder`, resuming at the first missing chunk.

    Chunk `i` holds conversations `[i * chunk_size, (i + 1) * chunk_size)`; with several processes,
    process `p` writes the chunks `i` with `i % num_processes == p`. Distillation stops once the
    chunks written hold `token_budget` answer tokens. Returns all sequences written so far and
    the report of every chunk (`chunks.log`).
    """
    settings.validate()
    check_answers(answers)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {"settings": asdict(settings), "conversations": fingerprint(conversations, answers == "given"),
                "chunk_size": chunk_size, "answers": answers,
                "target": model_name(target), "dtype": str(target.dtype).removeprefix("torch.")}
    saved = folder / MANIFEST
    if saved.exists():
        # older manifests: the target answered, in float32
        previous = {"answers": "target", "dtype": "float32"} | json.loads(saved.read_text())
        changed = [key for key in ("settings", "conversations", "chunk_size", "answers", "dtype")
                   if previous.get(key) != manifest[key]]
        if changed:
            raise ValueError(f"{folder} holds distilled chunks made with other {' and '.join(changed)}; resume with "
                             "the same data and settings, or choose another folder")
    elif process_index == 0:
        saved.write_text(json.dumps(manifest, indent=2) + "\n")
    chunks = range(0, len(conversations), chunk_size)
    done = lambda: sum(sum(s.loss_mask) for f in folder.glob("chunk_*.jsonl") for s in load_sequences(f))  # noqa: E731
    progress = tqdm(total=token_budget, initial=done(), desc="self-distillation", unit="tok")
    for index, start in enumerate(chunks):
        path = folder / f"chunk_{index:05d}.jsonl"
        if index % num_processes != process_index or path.exists():
            continue
        if token_budget is not None and progress.n >= token_budget:
            break
        sequences, report = distill_conversations(target, tokenizer, conversations[start : start + chunk_size],
                                                  settings, progress, answers)
        save_sequences(sequences, path)
        with (folder / CHUNK_LOG).open("a") as log:
            log.write(json.dumps({"chunk": index, **asdict(report)}) + "\n")
    progress.close()
    return load_distilled(folder)


def load_distilled(folder: str | Path) -> tuple[list[TrainingSequence], DistillReport]:
    """Every chunk's sequences, in chunk order, and the summed report."""
    folder = Path(folder)
    sequences = [s for path in sorted(folder.glob("chunk_*.jsonl")) for s in load_sequences(path)]
    report = DistillReport()
    log = folder / CHUNK_LOG
    if log.exists():
        written = {p.stem for p in folder.glob("chunk_*.jsonl")}
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            if f"chunk_{entry.pop('chunk'):05d}" in written:
                report.add(DistillReport(**entry))
    return sequences, report


# --- keeping benchmark prompts out of training data --------------------------------------------------


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def exclude_overlaps(conversations: list[Conversation], held_out: list[str], n: int = 8) -> list[Conversation]:
    """Drop every conversation with a user turn that shares an `n`-word run with a held-out text (or holds a
    whole held-out text shorter than that), so benchmark prompts never reach training."""
    shingles, short = set(), set()
    for text in held_out:
        words = _words(text)
        if len(words) < n:
            short.add(" ".join(words))
        shingles.update(tuple(words[i : i + n]) for i in range(len(words) - n + 1))

    def overlaps(turn: str) -> bool:
        words = _words(turn)
        if any(tuple(words[i : i + n]) in shingles for i in range(len(words) - n + 1)):
            return True
        joined = f" {' '.join(words)} "
        return any(f" {s} " in joined for s in short if s)

    return [c for c in conversations if not any(overlaps(turn) for turn in c.user_turns)]
