"""The held-out questions both engines answer: the first user turn of the first N held-out ShareGPT
conversations (`examples/smollm2/heldout_conversations.jsonl`, never trained on), through the target's chat
template with its default system prompt, as token ids (both engines get the same ids)."""

import json
from pathlib import Path

HELDOUT = Path(__file__).parents[1] / "smollm2" / "heldout_conversations.jsonl"


def question_ids(target: str, count: int = 8) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    lines = HELDOUT.read_text().splitlines()[:count]
    chats = [[{"role": "user", "content": json.loads(line)["turns"][0]}] for line in lines]
    return [list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
                 ["input_ids"]) for chat in chats]
