"""`custom_generate=hf_eagle31.fast_decoding`, option by option against plain `generate`: what it does, it does as
plain `generate` does; what it cannot do (beam search and the other multi-candidate modes, a drafter beside it) is
refused by name. transformers hands a `custom_generate` function every call, whatever its generation config asks."""

import re
import threading

import pytest
import torch
from tiny_models import PROMPTS, make_drafter, make_target, make_tokenizer
from transformers import TextIteratorStreamer

import hf_eagle31

FAST = {"custom_generate": hf_eagle31.fast_decoding}


@pytest.fixture(scope="module")
def target():
    return make_target(seed=12)


@pytest.mark.parametrize("options, named", [
    ({"num_beams": 2}, "beam search (num_beams > 1)"),
    ({"num_beams": 3, "num_return_sequences": 2}, "beam search (num_beams > 1)"),
    ({"num_beams": 2, "do_sample": True}, "beam sample"),
    ({"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0}, "group beam search (num_beam_groups > 1)"),
    ({"penalty_alpha": 0.6, "top_k": 4}, "contrastive search (penalty_alpha with top_k > 1)"),
    ({"dola_layers": "low"}, "dola generation (dola_layers)"),
    ({"prompt_lookup_num_tokens": 3}, "assisted generation (prompt_lookup_num_tokens"),
    ({"force_words_ids": [[5]], "num_beams": 2}, "constrained beam search"),
])
def test_modes_other_than_one_token_a_step_are_refused_by_name(target, options, named):
    """(Before: num_beams=2 gave two identical greedy rows; num_beams=3, num_return_sequences=2 gave 3 rows.)"""
    with pytest.raises(ValueError, match="fast_decoding decodes one token a step .* asks for " + re.escape(named)):
        target.generate(PROMPTS[:1], max_new_tokens=4, **options, **FAST)


def test_a_drafter_beside_it_is_refused(target):
    with pytest.raises(ValueError, match="fast_decoding decodes without a drafter"):
        target.generate(PROMPTS[:1], max_new_tokens=4, assistant_model=make_drafter(target), **FAST)


@pytest.mark.parametrize("options", [
    {"stop_strings": ["ab", "x"], "tokenizer": "tiny"},
    {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2},
    {"min_new_tokens": 12, "eos_token_id": [2, 40, 77]},
    {"bad_words_ids": [[40], [77, 78]], "max_length": 20},
    {"return_dict_in_generate": True, "output_scores": True, "output_logits": True},
    {"prefix_allowed_tokens_fn": lambda batch, ids: list(range(3, 40))},
    {"forced_eos_token_id": 2, "exponential_decay_length_penalty": (4, 1.5)},
])
def test_what_plain_generate_honours_it_honours(target, options):
    options = {**options, "tokenizer": make_tokenizer()} if options.get("tokenizer") else options
    kwargs = {"do_sample": False, "max_new_tokens": 16, **options}
    prompts = PROMPTS[:1] if options.get("output_scores") else PROMPTS[:2]  # per-step scores: one row (as EAGLE)
    plain, fast = target.generate(prompts, **kwargs), target.generate(prompts, **kwargs, **FAST)
    if options.get("return_dict_in_generate"):
        assert torch.equal(fast.sequences, plain.sequences)
        assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(fast.scores, plain.scores, strict=True))
        assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(fast.logits, plain.logits, strict=True))
    else:
        assert torch.equal(fast, plain)


def test_sampling_several_sequences_per_prompt_gives_them_all(target):
    out = target.generate(PROMPTS[:2], do_sample=True, num_return_sequences=3, max_new_tokens=8, **FAST)
    assert out.shape == (6, PROMPTS.shape[1] + 8)


def test_a_streamer_receives_the_text_and_its_end():
    """(Before: transformers passes no streamer to a `custom_generate` function, so the consumer waited forever.)"""
    target, tokenizer = make_target(seed=13), make_tokenizer()
    expected = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=12)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    thread = threading.Thread(target=target.generate, args=(PROMPTS[:1],),
                              kwargs={"do_sample": False, "max_new_tokens": 12, "streamer": streamer, **FAST})
    thread.start()
    text = "".join(streamer)
    thread.join(timeout=60)
    assert text == tokenizer.decode(expected[0, PROMPTS.shape[1]:])
