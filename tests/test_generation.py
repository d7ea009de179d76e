"""EAGLE decoding through `target.generate(assistant_model=drafter)` is lossless: greedy output equals
plain `generate` token for token, in chain and tree mode, with every decoding control honoured."""

import copy
import logging
import subprocess
import sys

import pytest
import torch
from tiny_models import PROMPTS, VOCAB, make_drafter, make_target, make_tokenizer, trained_pair
from transformers import DynamicCache, GenerationConfig, StaticCache
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

import hf_eagle31  # noqa: F401  (routes generate(assistant_model=<EAGLE drafter>))
from hf_eagle31.acceptance import stopper
from hf_eagle31.training.capacity import add_decoder_layers

MODES = ["chain", "tree"]


def prompt_variants():
    """Memorised prompts (long accepted paths), their prefixes and extensions (rejections), one token."""
    first = PROMPTS[0:1]
    return [first, PROMPTS[3:4], first[:, :1], first[:, :3], torch.cat([PROMPTS[1:2], PROMPTS[4:5]], dim=1)]


def plain(target, prompt, **kwargs):
    return target.generate(prompt, do_sample=False, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle3.1"])
@pytest.mark.parametrize("mode", MODES)
def test_greedy_equals_plain_generate(arch, eagle31, mode):
    target, drafter = trained_pair(arch, eagle31, speculation_mode=mode, collapse_fallback=False)
    deepest = 0
    for prompt in prompt_variants():
        for max_new_tokens in (1, 7, 48):
            expected = plain(target, prompt, max_new_tokens=max_new_tokens)
            out = target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, assistant_model=drafter)
            assert torch.equal(out, expected), (prompt.tolist(), max_new_tokens)
            deepest = max(deepest, sum(a > 0 for a in drafter.speculation_stats.accepted))
    assert deepest >= 2, "the sweep never accepted a multi-token path: it tested nothing"


@pytest.mark.parametrize("mode", MODES)
def test_a_drafter_with_stacked_decoder_layers_is_lossless(mode):
    """A second decoder layer keeps a second drafter cache layer, trimmed like the first after each step."""
    target, fitted = trained_pair("llama", True, speculation_mode=mode, collapse_fallback=False)
    drafter = copy.deepcopy(fitted)
    add_decoder_layers(drafter, 2)
    with torch.no_grad():  # away from the identity, not so far that nothing is accepted
        drafter.layers["1"].self_attn.o_proj.weight.normal_(std=0.02)
        drafter.layers["1"].mlp.down_proj.weight.normal_(std=0.02)
    deepest = 0
    for prompt in prompt_variants():
        expected = plain(target, prompt, max_new_tokens=32)
        out = target.generate(prompt, do_sample=False, max_new_tokens=32, assistant_model=drafter)
        assert torch.equal(out, expected), prompt.tolist()
        deepest = max(deepest, sum(a > 0 for a in drafter.speculation_stats.accepted))
    assert deepest >= 2, "the sweep never accepted a multi-token path: it tested nothing"


@pytest.mark.parametrize("mode", MODES)
def test_a_bf16_drafter_beside_an_fp32_target_changes_nothing_in_the_output(mode):
    target, drafter = trained_pair("llama", True, speculation_mode=mode, collapse_fallback=False)
    drafter = copy.deepcopy(drafter).to(torch.bfloat16)
    accepted = 0
    for prompt in prompt_variants():
        expected = plain(target, prompt, max_new_tokens=32)
        out = target.generate(prompt, do_sample=False, max_new_tokens=32, assistant_model=drafter)
        assert torch.equal(out, expected), prompt.tolist()
        accepted += sum(drafter.speculation_stats.accepted)
    assert accepted > 0, "the bf16 drafter never had a draft accepted: it tested nothing"


@pytest.mark.parametrize("fast", [True, False])
def test_drafting_dtype_is_bf16_only_where_the_device_computes_it_fast(monkeypatch, fast):
    monkeypatch.setattr(hf_eagle31.generation, "fast_bf16", lambda device: fast)
    target = make_target("llama")
    assert hf_eagle31.drafting_dtype(target) == (torch.bfloat16 if fast else torch.float32)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", MODES)
def test_exact_verification_equals_plain_generate_bit_for_bit_in_bf16(arch, mode):
    """bf16 rounds coarsely enough that batched kernels flip near-tied argmaxes; "exact" must not."""
    target, drafter = trained_pair(arch, True, speculation_mode=mode, collapse_fallback=False, verify_mode="exact")
    target, drafter = target.to(torch.bfloat16), drafter.to(torch.bfloat16)
    try:
        taus = []
        for prompt in prompt_variants():
            expected = plain(target, prompt, max_new_tokens=40)
            out = target.generate(prompt, do_sample=False, max_new_tokens=40, assistant_model=drafter)
            assert torch.equal(out, expected), prompt.tolist()
            taus.append(drafter.speculation_stats.tau)
        assert max(taus) > 1.5
    finally:
        target.float(), drafter.float()


class OneTokenKernel(torch.nn.Linear):
    """Multiplies one token its own way and several through `F.linear` on another weight, as bitsandbytes'
    4-bit layers do on CUDA (a fused 4-bit kernel for one token, the dequantized weight for several); the
    difference is exaggerated (a 4-bit rounding of the weight) so that a missed split shows in the output."""

    def forward(self, x):
        if x.numel() == x.shape[-1]:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        scale = self.weight.abs().amax(-1, keepdim=True) / 7
        return torch.nn.functional.linear(x, torch.round(self.weight / scale) * scale, self.bias)


@pytest.mark.parametrize("mode", MODES)
def test_exact_verification_runs_a_layer_with_its_own_forward_one_token_at_a_time(mode):
    target, drafter = trained_pair("llama", True, speculation_mode=mode, collapse_fallback=False, verify_mode="exact")
    layers = [m for m in target.model.layers.modules() if type(m) is torch.nn.Linear]
    for layer in layers:
        layer.__class__ = OneTokenKernel
    taus = []
    try:
        for prompt in prompt_variants():
            expected = plain(target, prompt, max_new_tokens=40)
            out = target.generate(prompt, do_sample=False, max_new_tokens=40, assistant_model=drafter)
            assert torch.equal(out, expected), prompt.tolist()
            taus.append(drafter.speculation_stats.tau)
        assert max(taus) > 1.0  # drafts were accepted (the prefill's 4-bit rounding moves the target off its data)
    finally:
        for layer in layers:
            layer.__class__ = torch.nn.Linear
    assert all("forward" not in vars(layer) for layer in layers)  # the per-position forwards went with the call


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "controls",
    [
        {"repetition_penalty": 1.4},
        {"no_repeat_ngram_size": 2},
        {"min_new_tokens": 30, "eos_token_id": None},  # eos filled in below
        {"bad_words_ids": [[5], [7, 9]]},
        {"sequence_bias": {(11,): 4.0}},
    ],
    ids=["repetition_penalty", "no_repeat_ngram", "min_new_tokens", "bad_words", "sequence_bias"],
)
def test_logits_processors_are_honoured(mode, controls):
    target, drafter = trained_pair("llama", True, speculation_mode=mode)
    prompt = PROMPTS[3:4]
    controls = dict(controls)
    if "eos_token_id" in controls:  # an eos the plain output hits early, so min_new_tokens matters
        controls["eos_token_id"] = int(plain(target, prompt, max_new_tokens=5)[0, -2])
    expected = plain(target, prompt, max_new_tokens=40, **controls)
    out = target.generate(prompt, do_sample=False, max_new_tokens=40, assistant_model=drafter, **controls)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("mode", MODES)
def test_eos_stops_where_plain_generate_stops(mode):
    target, drafter = trained_pair("llama", True, speculation_mode=mode)
    prompt = PROMPTS[0:1]
    reference = plain(target, prompt, max_new_tokens=40)
    eos = int(reference[0, prompt.shape[1] + 20])  # a token deep inside a memorised (accepted) run
    expected = plain(target, prompt, max_new_tokens=40, eos_token_id=eos)
    out = target.generate(prompt, do_sample=False, max_new_tokens=40, eos_token_id=eos, assistant_model=drafter)
    assert expected.shape[1] < reference.shape[1] and torch.equal(out, expected)


class EveryFifthLength(StoppingCriteria):
    """A criterion of the caller's own, which the stop test calls as transformers would."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] % 5 == 0, dtype=torch.bool)


@pytest.mark.parametrize("criteria", [
    [MaxLengthCriteria(12)],
    [MaxLengthCriteria(12, max_position_embeddings=9), EosTokenCriteria([3, 7])],
    [EosTokenCriteria(5), EveryFifthLength()],
    [MaxLengthCriteria(14), MaxLengthCriteria(11), EosTokenCriteria(torch.tensor([[2], [8]]))],
    [],
])
def test_the_stop_test_answers_as_transformers_stopping_criteria_do(criteria):
    """`stopper` answers transformers' max-length and EOS criteria from the sequence's length and its last token and
    calls any other: each answer must be `bool(criteria(sequence, scores).any())`, below, at and past each length."""
    criteria, generator = StoppingCriteriaList(criteria), torch.Generator().manual_seed(0)
    stops = stopper(criteria)
    for length in range(1, 17):
        for _ in range(4):
            sequence, scores = torch.randint(0, 10, (1, length), generator=generator), torch.randn(1, 10)
            assert stops(sequence, int(sequence[0, -1]), scores) == bool(criteria(sequence, scores).any())


@pytest.mark.parametrize("mode", MODES)
def test_stop_strings_stop_where_plain_generate_stops(mode):
    target, drafter = trained_pair("llama", True, speculation_mode=mode)
    tokenizer = make_tokenizer()
    prompt = PROMPTS[0:1]
    reference = plain(target, prompt, max_new_tokens=40)
    words = tokenizer.convert_ids_to_tokens(reference[0, prompt.shape[1] + 18 : prompt.shape[1] + 20].tolist())
    stop = words[0][1:] + words[1][:1]  # spans a token boundary, deep inside an accepted run
    expected = plain(target, prompt, max_new_tokens=40, stop_strings=stop, tokenizer=tokenizer)
    out = target.generate(
        prompt, do_sample=False, max_new_tokens=40, stop_strings=stop, tokenizer=tokenizer, assistant_model=drafter
    )
    assert expected.shape[1] < reference.shape[1] and torch.equal(out, expected)


@pytest.mark.parametrize("mode", MODES)
def test_streamer_receives_exactly_the_output(mode):
    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens, self.ended = [], False

        def put(self, value):
            self.tokens += value.flatten().tolist()

        def end(self):
            self.ended = True

    target, drafter = trained_pair("llama", True, speculation_mode=mode)
    streamer = Collect()
    out = target.generate(PROMPTS[0:1], do_sample=False, max_new_tokens=30, assistant_model=drafter, streamer=streamer)
    assert streamer.ended and streamer.tokens == out[0].tolist()


@pytest.mark.parametrize("mode", MODES)
def test_text_iterator_streamer(mode):
    from threading import Thread

    from transformers import TextIteratorStreamer

    target, drafter = trained_pair("llama", True, speculation_mode=mode)
    tokenizer = make_tokenizer()
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)  # a stalled producer: queue.Empty
    kwargs = dict(inputs=PROMPTS[0:1], do_sample=False, max_new_tokens=20, assistant_model=drafter, streamer=streamer)
    errors = []

    def produce():  # a generate that raises ends the stream, and its error fails the test, instead of a wait forever
        try:
            target.generate(**kwargs)
        except BaseException as error:
            errors.append(error)
            streamer.end()

    thread = Thread(target=produce, daemon=True)
    thread.start()
    text = "".join(streamer)
    thread.join(timeout=60)
    if errors:
        raise errors[0]
    expected = plain(target, PROMPTS[0:1], max_new_tokens=20)
    assert text.split() == tokenizer.decode(expected[0, PROMPTS.shape[1] :]).split()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kwargs, message", [
    ({"output_hidden_states": True, "return_dict_in_generate": True}, "hidden states"),
    ({"output_attentions": True, "return_dict_in_generate": True}, "attentions"),
    ({"use_cache": False}, "use_cache=False"),
    ({"cache_implementation": "offloaded"}, "DynamicCache or a StaticCache"),
    ({"inputs_embeds": torch.zeros(1, 6, 64)}, "pass input_ids, not inputs_embeds"),
])
def test_what_eagle_cannot_do_is_refused_by_name(mode, kwargs, message):
    target, drafter = trained_pair("llama", True, speculation_mode=mode)
    with pytest.raises(ValueError, match=message):
        target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=5, assistant_model=drafter, **kwargs)
    assert target.config._attn_implementation != "eagle_tree"


@pytest.mark.parametrize("verify_mode", ["batched", "exact"])
@pytest.mark.parametrize("mode", MODES)
def test_static_cache_equals_plain_greedy_without_reallocation(mode, verify_mode):
    """cache_implementation="static", and a user's StaticCache: rejected drafts are rolled back by position and
    accepted nodes copied into place, in the cache's own tensors; a tree near the end of the cache is cut to fit."""
    target, drafter = trained_pair("llama", True, speculation_mode=mode, verify_mode=verify_mode,
                                   collapse_fallback=False)
    expected = plain(target, PROMPTS[:1], max_new_tokens=40)
    out = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=40, assistant_model=drafter,
                          cache_implementation="static", return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected) and isinstance(out.past_key_values, StaticCache)
    assert drafter.speculation_stats.accepted[1] > 0, "no path of two drafts was accepted"
    text = target.config
    cache = StaticCache(config=text, max_cache_len=expected.shape[1])
    cache.early_initialization(1, text.num_key_value_heads, text.hidden_size // text.num_attention_heads,
                               target.dtype, target.device)
    storage = [layer.keys.data_ptr() for layer in cache.layers]
    got = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=40, assistant_model=drafter,
                          past_key_values=cache)
    assert torch.equal(got, expected)
    assert [layer.keys.data_ptr() for layer in cache.layers] == storage


def test_compile_config_compiles_one_verify_graph_and_equals_plain_greedy():
    """transformers' compile path (static cache, `compile_config`): every verify block is padded to one size, so the
    compiled target forward is traced once per call, dynamic speculation and plain steps included."""
    from transformers import CompileConfig

    target, drafter = trained_pair("llama", True, collapse_fallback=False, tree_depth=3, tree_top_k=2,
                                   tree_total_tokens=5)
    expected = plain(target, PROMPTS[:1], max_new_tokens=30)
    compiled = copy.deepcopy(target)  # the compiled call is kept on the model
    config = CompileConfig(mode="default")
    config._compile_all_devices = True  # transformers compiles decoding on GPUs only, unless told
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps the counts of graphs compiled before (the lean forward's)
    out = compiled.generate(PROMPTS[:1], do_sample=False, max_new_tokens=30, assistant_model=drafter,
                            cache_implementation="static", compile_config=config)
    assert torch.equal(out, expected)
    assert drafter.speculation_stats.accepted[1] > 0, "no path of two drafts was accepted"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_static_cache_is_refused_for_batches_by_name():
    target, drafter = trained_pair("llama", True)
    with pytest.raises(ValueError, match="static cache takes one prompt"):
        target.generate(PROMPTS[:2], do_sample=False, max_new_tokens=5, assistant_model=drafter,
                        cache_implementation="static")


def test_continuous_batching_refuses_a_drafter_it_would_ignore():
    """transformers' generate_batch takes any keyword and would decode without the drafter, silently."""
    target, drafter = trained_pair("llama", True)
    with pytest.raises(NotImplementedError, match="EAGLE drafters are not supported by continuous batching"):
        target.generate_batch([PROMPTS[0].tolist()], assistant_model=drafter, max_new_tokens=5)
    with pytest.raises(NotImplementedError, match="assistant_model is not supported"):  # the paged cache, in generate
        target.generate(PROMPTS[:1], max_new_tokens=5, assistant_model=drafter, cache_implementation="paged")


def test_speculation_settings_in_from_pretrained_override_the_saved_ones(tmp_path):
    """issue 29, point 6: transformers users pass settings to from_pretrained; this project's names were a TypeError."""
    from hf_eagle31 import Eagle3DraftModel

    target, drafter = trained_pair("llama", True, tree_top_k=4, tree_total_tokens=20)
    drafter.save_pretrained(tmp_path)
    loaded = Eagle3DraftModel.from_pretrained(tmp_path, tree_depth=3, speculation_mode="chain", verify_mode="exact")
    settings = loaded.generation_config
    assert (settings.tree_depth, settings.speculation_mode, settings.verify_mode) == (3, "chain", "exact")
    assert (settings.tree_top_k, settings.tree_total_tokens) == (4, 20)  # the saved ones, untouched
    for bad, message in [({"tree_depth": 0}, "tree_depth must be an integer from 1"),
                         ({"speculation_mode": "fast"}, "speculation_mode must be one of"),
                         ({"collapse_fallback": "no"}, "collapse_fallback must be True or False"),
                         ({"depth": 7, "tree_depth": 3}, "not both")]:
        with pytest.raises(ValueError, match=message):
            Eagle3DraftModel.from_pretrained(tmp_path, **bad)


def test_a_speculation_setting_given_to_generate_says_where_it_belongs():
    """transformers would reject it as an unused model keyword (or, for num_assistant_tokens, ignore it)."""
    target, drafter = trained_pair("llama", True)
    for name, value in [("tree_depth", 3), ("num_assistant_tokens", 2)]:
        with pytest.raises(ValueError, match=rf"set drafter.generation_config.{name} = {value}"):
            target.generate(PROMPTS[:1], max_new_tokens=5, assistant_model=drafter, **{name: value})
    with pytest.raises(ValueError, match="set drafter.generation_config.verify_mode = 'exact'"):  # ignored before
        target.generate(PROMPTS[:1], generation_config=GenerationConfig(max_new_tokens=5, verify_mode="exact"),
                        assistant_model=drafter)
    drafter.generation_config.tree_depth = 3  # the documented way: every later call reads it
    drafter.generation_config.dynamic_speculation = False  # else the depth adapts from 3 up to max_speculation_depth
    expected = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=12)
    assert torch.equal(target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=12, assistant_model=drafter),
                       expected)
    assert len(drafter.speculation_stats.as_dict()["acceptance_per_depth"]) == 3


@pytest.mark.parametrize("setting, value", [("speculation_mode", "CHAIN"), ("speculation_mode", "banana"),
                                            ("speculation_mode", None), ("verify_mode", "fast"),
                                            ("tree_top_k", 0), ("tree_top_k", 10**6), ("tree_depth", -1),
                                            ("num_assistant_tokens", 2.5), ("tree_total_tokens", 0),
                                            ("verify_chunk_depth", 0), ("collapse_fallback", "no")])
def test_bad_speculation_settings_are_named(setting, value):
    target, drafter = trained_pair("llama", True, **{"speculation_mode": "chain" if setting == "num_assistant_tokens" else "tree",
                                                     setting: value})
    with pytest.raises(ValueError, match=setting):
        target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=5, assistant_model=drafter)


def test_interrupting_an_exact_verify_forward_leaves_nothing_switched_on():
    from hf_eagle31.exact import RowByRowLinear

    target, drafter = trained_pair("llama", True, speculation_mode="tree", verify_mode="exact")
    calls = []

    def interrupt(*args):
        calls.append(1)
        if len(calls) == 3:  # inside the first verify forward, after the row-by-row mode went on
            raise KeyboardInterrupt

    handle = target.model.layers[0].register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=20, assistant_model=drafter)
    finally:
        handle.remove()
    assert "_eagle_row_by_row" not in target.__dict__
    assert not any(isinstance(mode, RowByRowLinear) for mode in torch.overrides._get_current_function_mode_stack())
    assert torch.equal(target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=20, assistant_model=drafter),
                       plain(target, PROMPTS[:1], max_new_tokens=20))


def test_sampling_when_the_first_draft_token_is_eos():
    """Drafts that begin with the eos token: the walk stops on it, so no sample ever follows an eos."""
    target, drafter = trained_pair("llama", True, speculation_mode="chain", collapse_fallback=False)
    first = int(drafter.draft_to_target(torch.tensor(0)))  # make every draft's first token the eos
    with torch.no_grad():
        drafter.lm_head.weight[0] += 1000.0
    try:
        for seed in range(3):
            torch.manual_seed(seed)
            out = target.generate(PROMPTS[:1], do_sample=True, max_new_tokens=10, assistant_model=drafter,
                                  eos_token_id=first, pad_token_id=0)[0, PROMPTS.shape[1] :].tolist()
            assert first not in out[:-1] and drafter.speculation_stats.speculative_forwards > 0
    finally:
        with torch.no_grad():
            drafter.lm_head.weight[0] -= 1000.0


@pytest.mark.parametrize("mode", MODES)
def test_dynamic_speculation_never_changes_the_output(mode):
    outputs = []
    for dynamic in (False, True):
        target, drafter = trained_pair("llama", True, speculation_mode=mode, dynamic_speculation=dynamic)
        outputs.append(target.generate(PROMPTS[3:4], do_sample=False, max_new_tokens=48, assistant_model=drafter))
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(outputs[0], plain(target, PROMPTS[3:4], max_new_tokens=48))


@pytest.mark.parametrize("mode", MODES)
def test_statistics_account_for_every_token(mode):
    target, drafter = trained_pair("llama", True, speculation_mode=mode)
    prompt = PROMPTS[0:1]
    out = target.generate(prompt, do_sample=False, max_new_tokens=48, assistant_model=drafter)
    stats = drafter.speculation_stats
    new_tokens = out.shape[1] - prompt.shape[1]
    assert stats.mode == mode
    assert 1 + stats.speculative_tokens + stats.plain_steps == new_tokens  # +1: the prefill's token
    assert stats.tau == pytest.approx(stats.speculative_tokens / stats.speculative_forwards)
    assert stats.tau > 1.5 and stats.acceptance_per_depth[0] > 0.5
    assert all(0.0 <= a <= 1.0 for a in stats.acceptance_per_depth)
    assert stats.draft_seconds > 0 and stats.verify_seconds > 0


@pytest.mark.parametrize("mode", MODES)
def test_mismatched_drafter_falls_back_with_bounded_waste(mode, caplog):
    target = make_target("llama", seed=0)
    stranger = make_target("llama", seed=7)  # same shapes, different weights
    drafter = make_drafter(stranger, eagle31=True)
    drafter.generation_config.speculation_mode = mode
    prompt = PROMPTS[0:1]
    with caplog.at_level(logging.WARNING, logger="hf_eagle31"):
        out = target.generate(prompt, do_sample=False, max_new_tokens=200, assistant_model=drafter)
    assert torch.equal(out, plain(target, prompt, max_new_tokens=200))
    stats = drafter.speculation_stats
    # probing windows of 4 speculative steps between 8, 16, 32, 64, 128 plain steps; a lucky window
    # (a random tree does hit now and then) halves the backoff, so allow a few more windows
    assert stats.fallbacks >= 1 and stats.speculative_forwards <= 4 * 10
    assert stats.plain_steps >= 150
    assert sum("slower than plain decoding" in r.message for r in caplog.records) == 1


def test_tree_cache_is_compacted_to_the_accepted_path():
    target, drafter = trained_pair("llama", True, speculation_mode="tree")
    prompt = PROMPTS[0:1]
    out = target.generate(
        prompt, do_sample=False, max_new_tokens=40, assistant_model=drafter, return_dict_in_generate=True
    )
    fresh = DynamicCache(config=target.config)
    with torch.no_grad():
        target(out.sequences[:, :-1], past_key_values=fresh)
    cache = out.past_key_values
    assert cache.get_seq_length() == out.sequences.shape[1] - 1
    for kept, reference in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(kept.keys, reference.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(kept.values, reference.values, atol=1e-5, rtol=1e-4)


def test_micro_batched_verification_is_lossless_and_chunks():
    outputs, forwards_per_step = [], []
    for chunk in (None, 2):
        target, drafter = trained_pair("llama", True, verify_chunk_depth=chunk, collapse_fallback=False)
        outputs.append(target.generate(PROMPTS[0:1], do_sample=False, max_new_tokens=48, assistant_model=drafter))
        stats = drafter.speculation_stats
        forwards_per_step.append(stats.speculative_forwards / stats.reached[0])  # every step reaches depth 1
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(outputs[0], plain(target, PROMPTS[0:1], max_new_tokens=48))
    assert forwards_per_step[0] == 1.0 and forwards_per_step[1] > 1.0


@pytest.mark.slow
def test_long_generation_keeps_the_cache_valid():
    target = make_target("llama", seed=3)
    target.config.max_position_embeddings = 8192
    drafter = make_drafter(target, eagle31=True)
    prompt = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(5))
    kwargs = dict(do_sample=False, max_new_tokens=4200, min_new_tokens=4200)
    expected = target.generate(prompt, **kwargs)
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert out.shape[1] == prompt.shape[1] + 4200 and torch.equal(out, expected)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(vocab_size=VOCAB + 8), "vocabulary"),
        (dict(target_hidden_size=32), "features of width"),
        (dict(target_layer_ids=[2, 3, 9], num_target_layers=None), "out of range"),
    ],
)
def test_mismatched_pairs_get_clear_errors(change, message):
    target = make_target("llama")
    drafter = make_drafter(target, eagle31=True, **change) if "vocab" not in str(change) else None
    if drafter is None:  # a drafter built for a bigger vocabulary cannot share this target's embedding
        from tiny_models import drafter_config

        drafter = hf_eagle31.Eagle3DraftModel(drafter_config(target, **change)).eval()
    with pytest.raises(ValueError, match=message):
        target.generate(PROMPTS[0:1], do_sample=False, max_new_tokens=5, assistant_model=drafter)


def test_a_call_fits_the_drafter_and_reads_its_settings_once(monkeypatch):
    """The routing plans a call once: the pair is checked and fitted (`prepare_drafter`), the settings read and
    checked (`SpeculationSettings.of`) and a "kernel" verify mode's Triton asked for, each once a call."""
    from hf_eagle31 import generation
    from hf_eagle31.configuration import SpeculationSettings

    target, drafter = trained_pair("llama", True)
    drafter = copy.deepcopy(drafter)  # the shared pair's settings stay as they are
    drafter.set_target_embedding(target.get_input_embeddings())
    monkeypatch.setattr(generation, "_KERNEL_WARNED", set())
    calls = []
    fit, read = generation.prepare_drafter, SpeculationSettings.of.__func__
    monkeypatch.setattr(generation, "prepare_drafter", lambda *args: calls.append("fit") or fit(*args))
    monkeypatch.setattr(SpeculationSettings, "of", classmethod(lambda cls, config: calls.append("read") or
                                                               read(cls, config)))
    monkeypatch.setattr(generation, "require_triton", lambda: calls.append("triton"))
    drafter.generation_config.verify_mode = "kernel"  # verifies as "batched" on a CPU, and says so
    with pytest.warns(UserWarning, match="kernel"):
        out = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=8, assistant_model=drafter)
    assert sorted(calls) == ["fit", "read", "triton"]
    assert torch.equal(out, plain(target, PROMPTS[:1], max_new_tokens=8))


def test_plain_and_transformers_assisted_generation_unchanged_by_import():
    """Run plain and small-LM assisted generation with and without `import hf_eagle31` in fresh processes."""
    script = """
import sys, torch
sys.path.insert(0, "tests")
if sys.argv[1] == "1":
    import hf_eagle31
from tiny_models import make_target, PROMPTS
target, assistant = make_target("llama", seed=0), make_target("llama", seed=4)
torch.manual_seed(0)
outs = [target.generate(PROMPTS[0:1], do_sample=False, max_new_tokens=20),
        target.generate(PROMPTS[0:1], do_sample=False, max_new_tokens=20, assistant_model=assistant),
        target.generate(PROMPTS[0:1], do_sample=True, max_new_tokens=20, assistant_model=assistant),
        target.generate(PROMPTS[0:1], do_sample=False, max_new_tokens=20, prompt_lookup_num_tokens=3)]
print([o.tolist() for o in outs])
"""
    results = [
        subprocess.run([sys.executable, "-c", script, flag], capture_output=True, text=True, check=True).stdout
        for flag in ("0", "1")
    ]
    assert results[0] == results[1] and results[0].strip()


def test_each_call_records_its_own_statistics_even_when_threads_share_a_drafter():
    """Two threads, one drafter: each call's statistics are its own, returned with the output and held as
    `drafter.speculation_stats` for the calling thread (before, the later call overwrote the earlier's)."""
    import threading

    target, drafter = trained_pair("llama", eagle31=True)
    calls = {"short": (PROMPTS[0:1], 6), "long": (PROMPTS[3:4], 40)}
    results, barrier = {}, threading.Barrier(2)

    def call(name):
        prompt, new = calls[name]
        barrier.wait()
        out = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=new,
                              return_dict_in_generate=True)
        results[name] = (out, drafter.speculation_stats, prompt.shape[1])

    threads = [threading.Thread(target=call, args=(name,)) for name in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, (out, held, prompt_length) in results.items():
        assert out.speculation_stats is held
        emitted = out.sequences.shape[1] - prompt_length - 1  # the first token comes from the prefill
        assert held.speculative_tokens + held.plain_steps == emitted
    assert results["short"][1] is not results["long"][1]
    assert drafter.speculation_stats is None or drafter.speculation_stats not in (results["short"][1],
                                                                                 results["long"][1])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fast_decoding_is_plain_decoding_on_the_fastest_forward(arch, monkeypatch):
    """`custom_generate=hf_eagle31.fast_decoding`: one token a step through the backend EAGLE verifies on (the lean
    forward for these), the output plain `generate`'s, for one prompt and a left-padded batch."""
    from hf_eagle31.backends.cpu import lean
    from hf_eagle31.backends.cpu.products import can_pack

    target = make_target(arch, seed=4)
    forward, lean_calls = lean.llama_verify_forward, []
    monkeypatch.setattr(lean, "llama_verify_forward", lambda *args: lean_calls.append(1) or forward(*args))
    for prompts, mask in ((PROMPTS[:1], None), (PROMPTS[1:4], torch.ones(3, PROMPTS.shape[1], dtype=torch.long))):
        if mask is not None:
            mask[1, :3] = 0
        expected = target.generate(prompts, attention_mask=mask, do_sample=False, max_new_tokens=20)
        out = target.generate(prompts, attention_mask=mask, do_sample=False, max_new_tokens=20,
                              custom_generate=hf_eagle31.fast_decoding)
        assert torch.equal(out, expected)
    assert bool(lean_calls) is can_pack(target)


def test_kernel_mode_where_the_kernel_cannot_run_says_so_once(monkeypatch):
    """verify_mode="kernel" runs the Triton kernel on CUDA only: elsewhere the call verifies as "batched" and says
    so, once a process for each reason, instead of silently becoming another mode."""
    import warnings

    pytest.importorskip("triton")
    from hf_eagle31 import generation

    monkeypatch.setattr(generation, "_KERNEL_WARNED", set())
    target, drafter = trained_pair("llama", True)
    drafter = copy.deepcopy(drafter)
    drafter.set_target_embedding(target.get_input_embeddings())
    drafter.generation_config.verify_mode = "kernel"
    with pytest.warns(UserWarning, match='verify_mode="kernel": the target is not on CUDA, so this call verifies as'):
        out = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=12, assistant_model=drafter)
    assert torch.equal(out, plain(target, PROMPTS[:1], max_new_tokens=12))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=12, assistant_model=drafter)
