"""Batched EAGLE decoding: every row of `generate(batch, assistant_model=drafter)` equals the same row of
plain batched `generate`, with left-padded ragged prompts, rows that stop early, and sampling that
follows the target's distribution in every row."""

import copy

import pytest
import torch
from test_sampling import ALPHA, SAMPLES, TEMPERATURE, TOP_K, exact_joint, goodness_of_fit, sample_counts
from tiny_models import PROMPTS, make_drafter, make_target, make_tokenizer, trained_pair
from transformers import GenerationConfig, TextStreamer
from transformers.generation.streamers import BaseStreamer

import hf_eagle31  # noqa: F401
from hf_eagle31.configuration import SPECULATION_DEFAULTS
from hf_eagle31.bench.batching import left_padded as pad_left
from hf_eagle31.verification import UnsupportedTargetError

MODES = ["chain", "tree"]
PAD = 0


def left_padded(prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """What a tokenizer with `padding_side="left"` returns for these prompts."""
    return pad_left(prompts, PAD, "cpu")


# memorised prompts (long accepted paths), prefixes and extensions (rejections), one token
RAGGED = [PROMPTS[0].tolist(), PROMPTS[1, :3].tolist(), PROMPTS[2].tolist() + PROMPTS[4, :2].tolist(),
          PROMPTS[3, :1].tolist(), PROMPTS[5].tolist(), PROMPTS[4].tolist(), PROMPTS[1].tolist(), [7]]


def plain(target, batch, **kwargs):
    return target.generate(**batch, do_sample=False, pad_token_id=PAD, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", [2, 3, 8])
def test_every_row_equals_plain_batched_greedy(arch, mode, size):
    target, drafter = trained_pair(arch, True, speculation_mode=mode, collapse_fallback=False)
    batch = left_padded(RAGGED[:size])
    for max_new_tokens in (1, 6, 40):
        expected = plain(target, batch, max_new_tokens=max_new_tokens)
        out = plain(target, batch, max_new_tokens=max_new_tokens, assistant_model=drafter)
        assert torch.equal(out, expected), (size, max_new_tokens)
    per_row = drafter.speculation_stats.per_row
    assert len(per_row) == size and max(row.tau for row in per_row) > 2, "no row accepted a multi-token path"


@pytest.mark.parametrize("mode", MODES)
def test_rows_that_hit_eos_stop_and_are_padded_like_plain_generate(mode):
    """eos falls in the middle of some rows (at different steps), never in others."""
    target, drafter = trained_pair("llama", True, speculation_mode=mode, collapse_fallback=False)
    batch = left_padded(RAGGED[:6])
    continuation = plain(target, batch, max_new_tokens=30)[:, batch["input_ids"].shape[1]:]
    eos = int(continuation[0, 9])  # row 0 emits it after 9 tokens; other rows at other steps or never
    expected = plain(target, batch, max_new_tokens=30, eos_token_id=eos)
    rows_stopped = int((expected[:, -1] == PAD).sum())
    assert 0 < rows_stopped < 6, "eos must stop some rows but not all"
    out = plain(target, batch, max_new_tokens=30, eos_token_id=eos, assistant_model=drafter)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("mode", MODES)
def test_logits_processors_apply_per_row(mode):
    target, drafter = trained_pair("llama", True, speculation_mode=mode, collapse_fallback=False)
    batch = left_padded(RAGGED[:4])
    controls = dict(max_new_tokens=25, repetition_penalty=1.3, min_new_tokens=12, eos_token_id=int(PROMPTS[0, 2]))
    assert torch.equal(plain(target, batch, assistant_model=drafter, **controls), plain(target, batch, **controls))


@pytest.mark.parametrize("mode", MODES)
def test_dynamic_speculation_and_fallback_never_change_the_rows(mode):
    target, drafter = trained_pair("llama", True, speculation_mode=mode, dynamic_speculation=True)
    batch = left_padded(RAGGED[:5])
    assert torch.equal(plain(target, batch, max_new_tokens=40, assistant_model=drafter),
                       plain(target, batch, max_new_tokens=40))


@pytest.mark.parametrize("mode", MODES)
def test_statistics_account_for_every_row(mode):
    target, drafter = trained_pair("llama", True, speculation_mode=mode, collapse_fallback=False)
    batch = left_padded(RAGGED[:3])
    plain(target, batch, max_new_tokens=20, assistant_model=drafter)
    stats = drafter.speculation_stats
    assert [row.speculative_tokens for row in stats.per_row] == [20 - 1] * 3  # the prefill emits the first
    assert stats.speculative_tokens == sum(row.speculative_tokens for row in stats.per_row)
    assert stats.as_dict()["per_row_tau"] == [row.tau for row in stats.per_row]


class Recorder(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_with_a_streamer_is_refused_by_name(mode):
    """transformers' own streamers refuse a batch when the prompt arrives; a streamer that takes it gets our error."""
    target, drafter = trained_pair("llama", True, speculation_mode=mode)
    batch = left_padded(RAGGED[:2])
    with pytest.raises(ValueError, match="streamers take one sequence"):
        plain(target, batch, max_new_tokens=5, assistant_model=drafter, streamer=Recorder())
    with pytest.raises(ValueError, match="only supports batch size 1"):
        plain(target, batch, max_new_tokens=5, assistant_model=drafter, streamer=TextStreamer(make_tokenizer()))


def test_a_sliding_window_target_is_refused_for_batches_by_name():
    target = make_target("mistral")
    target.config.sliding_window = 8
    with pytest.raises(UnsupportedTargetError, match="sliding-window"):
        plain(target, left_padded(RAGGED[:2]), max_new_tokens=5, assistant_model=make_drafter(target))


def test_the_shape_tuned_for_the_batch_size_is_used_and_plain_decoding_where_none_pays():
    target, drafter = trained_pair("llama", True, speculation_mode="tree", tree_top_k=4, tree_depth=6,
                                   tree_total_tokens=30, collapse_fallback=False)
    batch = left_padded(RAGGED[:4])
    expected = plain(target, batch, max_new_tokens=30)
    chain_of_2 = {"tree_top_k": 1, "tree_depth": 2, "tree_total_tokens": 2, "speedup": 1.5}
    drafter.generation_config.batch_shapes = {"2": chain_of_2, "8": {**chain_of_2, "speedup": 0.9}}
    assert torch.equal(plain(target, batch, max_new_tokens=30, assistant_model=drafter), expected)
    stats = drafter.speculation_stats
    assert stats.mode == "chain" and len(stats.reached) == 2 and stats.speculative_forwards > 0  # batch 4 -> "2"
    wide = left_padded(RAGGED[:8])
    assert torch.equal(plain(target, wide, max_new_tokens=30, assistant_model=drafter),
                       plain(target, wide, max_new_tokens=30))
    assert drafter.speculation_stats.speculative_forwards == 0 and drafter.speculation_stats.fallbacks == 1


def test_the_shape_tuned_for_sampling_is_used_when_one_row_samples():
    target, drafter = trained_pair("llama", True, speculation_mode="tree", tree_top_k=4, tree_depth=6,
                                   tree_total_tokens=30, collapse_fallback=False)
    drafter.generation_config.sampling_shape = {"tree_top_k": 1, "tree_depth": 2, "tree_total_tokens": 2,
                                                "speedup": 1.5, "temperature": 1.0}
    torch.manual_seed(0)
    target.generate(PROMPTS[0:1], max_new_tokens=30, do_sample=True, assistant_model=drafter)
    stats = drafter.speculation_stats
    assert stats.mode == "chain" and len(stats.reached) == 2 and stats.speculative_forwards > 0
    target.generate(PROMPTS[0:1], max_new_tokens=30, do_sample=False, assistant_model=drafter)  # greedy: the tree
    assert drafter.speculation_stats.mode == "tree" and len(drafter.speculation_stats.reached) > 2
    drafter.generation_config.sampling_shape = {"tree_top_k": 1, "tree_depth": 0, "tree_total_tokens": 2}
    with pytest.raises(ValueError, match="sampling_shape holds"):
        target.generate(PROMPTS[0:1], max_new_tokens=5, do_sample=True, assistant_model=drafter)


def test_batch_shapes_pick_the_fastest_shape_from_measured_batch_costs():
    from hf_eagle31.tuning import batch_shapes

    candidates = [{"tree_top_k": 1, "tree_depth": 2, "tree_total_tokens": 2, "tau": 2.0},
                  {"tree_top_k": 1, "tree_depth": 6, "tree_total_tokens": 6, "tau": 2.8},
                  {"tree_top_k": 1, "tree_depth": 12, "tree_total_tokens": 12, "tau": 9.0}]  # never measured batched
    costs = {"verify_seconds": {"2": {"1": 0.010, "3": 0.014, "7": 0.020}, "8": {"1": 0.020, "3": 0.040, "7": 0.080}},
             "draft_seconds": {"2": {"1": {"2": 0.001, "6": 0.004}}, "8": {"1": {"2": 0.002, "6": 0.008}}}}
    shapes = batch_shapes({"candidates": candidates, "batch_costs": costs})
    # batch 2: chain 2 -> 2 x 0.010 / 0.015 = 1.33; chain 6 -> 2.8 x 0.010 / 0.024 = 1.17
    assert shapes["2"]["tree_depth"] == 2 and shapes["2"]["speedup"] == pytest.approx(2 * 0.010 / 0.015)
    # batch 8: chain 2 -> 2 x 0.020 / 0.042 = 0.95: nothing pays, so batched decoding decodes plainly there
    assert shapes["8"]["tree_depth"] == 2 and shapes["8"]["speedup"] == pytest.approx(2 * 0.020 / 0.042)


def test_tuning_measures_batched_costs_and_stores_a_shape_per_batch_size():
    from hf_eagle31.tuning import tune_drafter

    target, drafter = trained_pair("llama", True)
    report = tune_drafter(target, drafter, [PROMPTS[0:1]], max_new_tokens=12, top_ks=(1, 2), max_depth=3,
                          max_tokens=6, batch_sizes=(2, 4))
    shapes = drafter.generation_config.batch_shapes
    assert set(shapes) == {"2", "4"} and set(report.batch_costs["verify_seconds"][4]) >= {1, 4}
    for shape in shapes.values():
        assert shape["tree_depth"] <= 3 and shape["speedup"] > 0


@pytest.fixture(scope="module", params=MODES)
def batched_samples(request):
    """3-token continuations of two ragged rows, sampled together, from many seeds."""
    target, drafter = trained_pair("llama", True, speculation_mode=request.param, collapse_fallback=False)
    prompts = [PROMPTS[0].tolist(), PROMPTS[1, :4].tolist()]
    batch = left_padded(prompts)
    counts, accepted = sample_counts(target, drafter, batch, TEMPERATURE, TOP_K, pad_token_id=PAD)
    return target, accepted, [torch.tensor([p]) for p in prompts], counts


@pytest.mark.slow
def test_batched_sampling_matches_the_target_distribution_in_every_row(batched_samples):
    target, accepted, prompts, counts = batched_samples
    assert accepted > SAMPLES // 4, "draft tokens were rarely accepted: the acceptance path went untested"
    for prompt, row_counts in zip(prompts, counts):
        p_value = goodness_of_fit(row_counts, exact_joint(target, prompt, TEMPERATURE, TOP_K))
        assert p_value > ALPHA, f"row {prompt.tolist()} does not follow the target distribution (p = {p_value:.2e})"
        wrong = goodness_of_fit(row_counts, exact_joint(target, prompt, TEMPERATURE * 1.25, TOP_K))
        assert wrong < ALPHA, "negative control: the test must reject a slightly different distribution"


@pytest.fixture(scope="module")
def bf16_pair():
    target, drafter = trained_pair("llama", True)
    return copy.deepcopy(target).to(torch.bfloat16), copy.deepcopy(drafter).to(torch.bfloat16)


@pytest.mark.parametrize("mode", MODES)
def test_exact_mode_batches_equal_plain_batched_greedy_in_bf16(bf16_pair, mode):
    """Plain batched decoding multiplies one token of every row (finished rows included) in one matmul, and in bf16
    a block of tokens rounds otherwise: "exact" verification reproduces that shape position by position."""
    target, drafter = bf16_pair
    drafter.generation_config = GenerationConfig(**{**SPECULATION_DEFAULTS, "speculation_mode": mode,
                                                    "verify_mode": "exact", "collapse_fallback": False})
    batch = left_padded(RAGGED[:4])
    continuation = plain(target, batch, max_new_tokens=40)[:, batch["input_ids"].shape[1]:]
    eos = int(continuation[1, 7])  # some rows leave the batch early, others do not
    expected = plain(target, batch, max_new_tokens=40, eos_token_id=eos)
    out = plain(target, batch, max_new_tokens=40, eos_token_id=eos, assistant_model=drafter)
    assert torch.equal(out, expected)
    assert drafter.speculation_stats.accepted[1] > 0, "no path of two drafts was accepted"
