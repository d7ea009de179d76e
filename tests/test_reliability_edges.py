"""The edges of transformers where EAGLE once gave another output than plain `generate`, or a raw error.

Each case either equals plain greedy `generate` (the reference, computed without the drafter) or
is refused before decoding with an error that names the problem.
"""

import functools

import pytest
import torch
from test_architectures import MLA, MOE, PROMPT, fitted_drafter, tiny_target
from tiny_models import PROMPTS, trained_pair

import hf_eagle31  # noqa: F401  (routes generate(assistant_model=<EAGLE drafter>))
from hf_eagle31.bench.batching import left_padded

MODES = ["chain", "tree"]


def plain(target, **kwargs):
    return target.generate(do_sample=False, **kwargs)


def with_drafter(target, drafter, mode, **kwargs):
    drafter.generation_config.speculation_mode = mode
    return plain(target, assistant_model=drafter, **kwargs)


def ragged(prompt: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two rows, left-padded: the prompt, and its first five tokens."""
    return left_padded([prompt[0].tolist(), prompt[0, :5].tolist()], 0, "cpu")


LONGROPE = {"sliding_window": None, "max_position_embeddings": 256, "original_max_position_embeddings": 32,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                                "long_factor": [4.0] * 4, "original_max_position_embeddings": 32}}
DYNAMIC = {"max_position_embeddings": 32, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0,
                                                              "factor": 2.0}}
# name -> (model_type, its tiny config beyond test_architectures.SHAPE)
TARGETS = {"phi3-longrope": ("phi3", LONGROPE), "llama-dynamic": ("llama", DYNAMIC),
           **{name: (name, {"max_position_embeddings": 40}) for name in ("gpt2", "opt", "gpt_bigcode", "biogpt")},
           "deepseek_v2": ("deepseek_v2", {**MLA, **MOE}), "minicpm3": ("minicpm3", MLA)}


@functools.lru_cache(maxsize=None)
def edge_pair(name: str) -> tuple:
    """A tiny target and a drafter briefly fitted to its greedy continuation of `PROMPT`."""
    target = tiny_target(*TARGETS[name])
    return target, fitted_drafter(target, plain(target, input_ids=PROMPT, max_new_tokens=20), [1, 2, 3], steps=30)


# --- rotary tables that change with the length: refused where a call crosses the change ---------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, error", [
    ("phi3-longrope", "cannot cross Phi3ForCausalLM's longrope switch at original_max_position_embeddings=32"),
    ("llama-dynamic", "cannot run past max_position_embeddings=32 with dynamic rope scaling"),
])
def test_length_dependent_rope_is_refused_across_its_switch_and_equal_before(name, error, mode):
    target, drafter = edge_pair(name)
    with pytest.raises(ValueError, match=error):
        with_drafter(target, drafter, mode, input_ids=PROMPT, max_new_tokens=40)
    before = dict(input_ids=PROMPT, max_new_tokens=10)  # 24 tokens: the table never changes
    assert torch.equal(with_drafter(target, drafter, mode, **before), plain(target, **before))


# --- learned positions: drafts never reach past the last position plain decoding computes --------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model_type", ["gpt2", "opt", "gpt_bigcode", "biogpt"])
def test_learned_positions_up_to_their_limit_equal_plain_greedy(model_type, mode):
    target, drafter = edge_pair(model_type)
    drafter.generation_config.update(num_assistant_tokens=8, tree_depth=8, dynamic_speculation=False)  # deep drafts
    for inputs in ({"input_ids": PROMPT}, ragged(PROMPT)):
        kwargs = dict(inputs, max_new_tokens=40 - PROMPT.shape[1], pad_token_id=0)  # up to position 39
        assert torch.equal(with_drafter(target, drafter, mode, **kwargs), plain(target, **kwargs))


# --- batches ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model_type", ["deepseek_v2", "minicpm3"])
def test_mla_targets_in_a_batch_equal_plain_greedy(model_type, mode):
    """Multi-head latent attention caches keys and values of different head sizes."""
    target, drafter = edge_pair(model_type)
    kwargs = dict(ragged(PROMPT), max_new_tokens=20, pad_token_id=0)
    assert torch.equal(with_drafter(target, drafter, mode, **kwargs), plain(target, **kwargs))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setting", [{"encoder_repetition_penalty": 1.3}, {"encoder_no_repeat_ngram_size": 2}],
                         ids=["encoder-repetition-penalty", "encoder-no-repeat-ngram"])
def test_processors_holding_every_prompt_apply_per_row(setting, mode):
    target, drafter = trained_pair("llama", True, collapse_fallback=False)
    kwargs = dict(ragged(PROMPTS[0:1]), max_new_tokens=12, pad_token_id=0, **setting)
    assert torch.equal(with_drafter(target, drafter, mode, **kwargs), plain(target, **kwargs))


@pytest.mark.parametrize("mode", MODES)
def test_classifier_free_guidance_is_refused_for_batches(mode):
    target, drafter = trained_pair("llama", True, collapse_fallback=False)
    with pytest.raises(ValueError, match=r"classifier-free guidance \(guidance_scale\) only with one prompt"):
        with_drafter(target, drafter, mode, **ragged(PROMPTS[0:1]), max_new_tokens=10, pad_token_id=0,
                     guidance_scale=1.5)


@pytest.mark.parametrize("mode", MODES)
def test_classifier_free_guidance_with_one_prompt_equals_plain(mode):
    target, drafter = trained_pair("llama", True, collapse_fallback=False)
    kwargs = dict(input_ids=PROMPTS[0:1], max_new_tokens=10, guidance_scale=1.5)
    assert torch.equal(with_drafter(target, drafter, mode, **kwargs), plain(target, **kwargs))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [1, 2])
def test_right_padded_prompts_are_refused_by_name(mode, rows):
    target, drafter = trained_pair("llama", True, collapse_fallback=False)
    ids = PROMPTS[:2].clone()
    mask = torch.ones_like(ids)
    ids[1, 3:], mask[1, 3:] = 0, 0
    with pytest.raises(ValueError, match=r"needs left-padded prompts \(tokenizer.padding_side = 'left'\); these are "
                                         "right-padded"):
        with_drafter(target, drafter, mode, input_ids=ids[-rows:], attention_mask=mask[-rows:], max_new_tokens=10,
                     pad_token_id=0)
