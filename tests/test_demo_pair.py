"""The shipped demo pair (examples/demo_pair/): loads offline, fits the weight budget, decodes losslessly.

Skipped when the weights are not there (examples/reproduce/demo_pair/train_target.py and train_drafters.py build them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_eagle31

PAIR = Path(__file__).resolve().parent.parent / "examples" / "demo_pair"
TARGET, SMALL_LM, EAGLE3, EAGLE31 = (PAIR / name for name in ("target", "small_lm", "eagle3", "eagle31"))
FOLDERS = (TARGET, SMALL_LM, EAGLE3, EAGLE31)
MAX_TOTAL_BYTES = 60_000_000  # SPEC: all demo weights <= 60 MB
NEW_TOKENS = 12

pytestmark = pytest.mark.skipif(
    not all((d / "model.safetensors").exists() for d in FOLDERS), reason="demo pair weights not built"
)


def load(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def pair():
    return AutoTokenizer.from_pretrained(TARGET), load(TARGET), load(SMALL_LM)


@pytest.fixture(scope="module")
def prompt_ids(pair):
    tokenizer = pair[0]
    first = json.loads((PAIR / "heldout_prompts.jsonl").read_text().splitlines()[0])["text"]
    return tokenizer(first, return_tensors="pt")


def test_weights_are_bf16_safetensors_within_budget():
    total = sum((folder / "model.safetensors").stat().st_size for folder in FOLDERS)
    assert total <= MAX_TOTAL_BYTES, f"demo weights take {total} bytes > {MAX_TOTAL_BYTES}"
    for folder in FOLDERS:
        assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16", folder.name


def test_small_lm_shares_the_target_tokenizer(pair):
    tokenizer = pair[0]
    assert AutoTokenizer.from_pretrained(SMALL_LM).get_vocab() == tokenizer.get_vocab()
    assert tokenizer("x")["input_ids"][0] == tokenizer.bos_token_id


@torch.no_grad()
def test_greedy_generation_matches_full_forward_argmax(pair, prompt_ids):
    """Cached greedy decoding must pick, at every step, the argmax of an uncached forward."""
    _, target, _ = pair
    out = target.generate(**prompt_ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert out.shape[1] == prompt_ids["input_ids"].shape[1] + NEW_TOKENS
    start = prompt_ids["input_ids"].shape[1]
    logits = target(out[:, :-1]).logits[0, start - 1 :]
    assert torch.equal(logits.argmax(-1), out[0, start:])


@torch.no_grad()
def test_small_lm_as_assistant_keeps_greedy_output(pair, prompt_ids):
    _, target, small_lm = pair
    alone = target.generate(**prompt_ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assisted = target.generate(**prompt_ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=small_lm)
    assert torch.equal(alone, assisted)


@pytest.mark.parametrize("folder", [EAGLE3, EAGLE31], ids=["eagle3", "eagle31"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
@torch.no_grad()
def test_shipped_drafters_decode_losslessly_and_accept(pair, prompt_ids, folder, mode):
    """The shipped drafters match the shipped target: identical greedy text, and they do accept tokens."""
    _, target, _ = pair
    drafter = hf_eagle31.Eagle3DraftModel.from_pretrained(folder, dtype=torch.float32).eval()
    drafter.generation_config.update(speculation_mode=mode, collapse_fallback=False)
    alone = target.generate(**prompt_ids, max_new_tokens=4 * NEW_TOKENS, do_sample=False)
    eagle = target.generate(**prompt_ids, max_new_tokens=4 * NEW_TOKENS, do_sample=False, assistant_model=drafter)
    assert torch.equal(alone, eagle)
    assert drafter.speculation_stats.tau > 1.2  # a drafter that learned nothing gives ~1
