"""Applying a tuning (hf_eagle31.tuning.apply): the chosen shapes land in the drafter's generation config, survive
save_pretrained / from_pretrained, and read back as the settings decoding follows. Costs are given by hand, so
nothing here is timed."""

import json

import pytest
from tiny_models import PROMPTS, make_drafter, make_target
from transformers import GenerationConfig

from hf_eagle31 import Eagle3DraftModel
from hf_eagle31.configuration import SPECULATION_DEFAULTS, TunedShape
from hf_eagle31.tuning import TuningReport, apply, apply_choice, settings_of, tune_batch_sizes, tune_sampling

CHAIN = {"tree_top_k": 1, "tree_depth": 3, "tree_total_tokens": 3, "tau": 2.2, "speedup": 1.5}
TREE = {"tree_top_k": 4, "tree_depth": 5, "tree_total_tokens": 9, "tau": 2.9, "speedup": 1.7}
SAMPLED = {"tree_top_k": 1, "tree_depth": 2, "tree_total_tokens": 2, "tau": 1.8, "speedup": 1.3, "temperature": 1.0}
# batch 2: chain -> 2.2 x 0.010 / (0.014 + 0.002) = 1.375; tree -> 2.9 x 0.010 / (0.020 + 0.005) = 1.16
BATCH_COSTS = {"verify_seconds": {"2": {"1": 0.009, "4": 0.014, "10": 0.020}},
               "draft_seconds": {"2": {"1": {"3": 0.002, "5": 0.004}, "4": {"5": 0.005}}},
               "plain_seconds": {"2": 0.010}}


@pytest.fixture(scope="module")
def pair():
    target = make_target()
    return target, make_drafter(target)


@pytest.fixture
def drafter(pair):
    drafter = pair[1]
    drafter.generation_config = GenerationConfig(**{**SPECULATION_DEFAULTS, "dynamic_speculation": True})
    return drafter


def saved_report(choice: dict) -> dict:
    """A report as tuning.json holds it (string keys), from hand-made costs."""
    report = {"candidates": [CHAIN, TREE], "choice": choice, "best_chain": CHAIN, "best_tree": TREE,
              "cpu_backend": False, "batch_costs": BATCH_COSTS, "sampling": {"shape": SAMPLED}}
    return json.loads(json.dumps(report))


def test_apply_choice_stores_the_reports_shapes_in_the_generation_config(drafter):
    apply_choice(drafter, saved_report(TREE))
    config = drafter.generation_config
    assert config.num_assistant_tokens == 3  # the best chain's length
    assert (config.tree_top_k, config.tree_depth, config.tree_total_tokens) == (4, 5, 9)  # the best tree
    assert config.max_speculation_depth == 5 and config.speculation_mode == "tree"
    assert config.dynamic_speculation is False and config.cpu_backend is False
    assert config.batch_shapes == {"2": {"tree_top_k": 1, "tree_depth": 3, "tree_total_tokens": 3,
                                         "speedup": pytest.approx(2.2 * 0.010 / 0.016)}}
    assert config.sampling_shape == SAMPLED
    apply_choice(drafter, saved_report(CHAIN))
    assert drafter.generation_config.speculation_mode == "chain"  # the choice decides the mode


def test_apply_choice_takes_a_report_object(drafter):
    drafter.generation_config.update(cpu_backend=True, sampling_shape=SAMPLED)
    report = TuningReport({1: 0.01, 4: 0.012}, {1: {3: 0.002}}, 0.01, [CHAIN])  # chains only, on the default path
    apply_choice(drafter, report)
    config = drafter.generation_config
    assert config.speculation_mode == "chain" and config.num_assistant_tokens == 3
    assert config.max_speculation_depth == 3 and config.tree_depth == SPECULATION_DEFAULTS["tree_depth"]
    assert config.cpu_backend is False  # the path it was measured on
    assert config.batch_shapes is None and config.sampling_shape is None  # not tuned here: the drafter's own shapes


def test_apply_choice_keeps_what_an_older_report_did_not_measure(drafter):
    drafter.generation_config.update(cpu_backend=True, draft_mode="static")
    report = saved_report(CHAIN)
    del report["cpu_backend"]  # saved before tuning chose the verify path
    apply_choice(drafter, report)
    assert drafter.generation_config.cpu_backend is True and drafter.generation_config.draft_mode == "static"


def test_apply_choice_stores_the_drafting_mode_timed_faster(drafter):
    apply_choice(drafter, saved_report({**TREE, "draft_mode": "narrowed"}))
    assert drafter.generation_config.draft_mode == "narrowed"


def test_a_stored_choice_survives_save_and_load_and_reads_back_as_settings(drafter, tmp_path):
    apply_choice(drafter, saved_report(TREE))
    drafter.save_pretrained(tmp_path)
    loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    settings = settings_of(loaded)
    assert settings == settings_of(drafter)
    assert (settings.speculation_mode, settings.tree_top_k, settings.tree_depth, settings.tree_total_tokens) == \
        ("tree", 4, 5, 9)
    assert settings.num_assistant_tokens == 3 and not settings.dynamic_speculation
    chain = TunedShape(1, 3, 3, pytest.approx(1.375))
    assert settings.batch_shapes == {2: chain} and settings.tuned_shape(8, do_sample=False) == chain
    assert settings.tuned_shape(1, do_sample=True) == TunedShape(1, 2, 2, 1.3)
    assert settings.tuned_shape(1, do_sample=False) is None  # one greedy row: the tree above


def test_a_damaged_choice_is_refused_where_it_is_stored(drafter):
    report = saved_report(TREE)
    report["sampling"]["shape"] = {**SAMPLED, "tree_depth": 0}
    with pytest.raises(ValueError, match="sampling_shape holds"):
        apply_choice(drafter, report)


def test_tune_batch_sizes_adds_the_batched_costs_and_stores_their_shapes(pair, drafter, monkeypatch):
    target, _ = pair
    calls = []
    monkeypatch.setattr(apply, "batch_costs", lambda *args, **kwargs: calls.append((args, kwargs)) or BATCH_COSTS)
    report = saved_report(TREE)
    del report["batch_costs"]
    tuned = tune_batch_sizes(target, drafter, report, batch_sizes=(2,))
    (args, kwargs), = calls
    assert args[2:] == ([1, 4], apply.BATCH_MAX_DEPTH, (2,))  # the families calibrated
    assert kwargs == {"cpu_backend": False}
    assert tuned["batch_costs"] == BATCH_COSTS and tuned["choice"] == report["choice"] and "batch_costs" not in report
    assert drafter.generation_config.batch_shapes["2"]["tree_depth"] == 3


def test_tune_sampling_calibrates_the_saved_families_at_their_largest_shapes(pair, drafter, monkeypatch):
    target, _ = pair
    calls = []
    ranks, frontier = {1: [[0], [0, 0]], 4: [[1], [0]]}, {1: [[0], [0]], 4: [[0], [2]]}

    def calibrate_families(*args, **kwargs):
        calls.append(args)
        return ranks, frontier

    monkeypatch.setattr(apply, "calibrate_families", calibrate_families)
    report = {**saved_report(TREE), "verify_seconds": {"1": 1.0, "2": 1.1, "3": 1.2, "4": 1.4},
              "draft_seconds": {"1": {"1": 0.1, "2": 0.2}, "4": {"1": 0.2, "2": 0.3}}, "plain_seconds": 1.0}
    tuned = tune_sampling(target, drafter, report, [PROMPTS[0:1]], max_new_tokens=8, temperature=0.5)
    (args,) = calls
    assert args[3:] == (8, [1, 4], 2, 3, 0.5)  # families, depth and tree size from the saved costs
    # chain 2: tau (2 + 3) / 2 over 1.2 + 0.2 -> 1.786, the fastest (chain 1: 2 / 1.2; trees slower)
    assert drafter.generation_config.sampling_shape == tuned["sampling"]["shape"]
    assert tuned["sampling"]["shape"] == {"tree_top_k": 1, "tree_depth": 2, "tree_total_tokens": 2, "tau": 2.5,
                                          "speedup": pytest.approx(2.5 / 1.4), "temperature": 0.5}
    assert tuned["choice"] == report["choice"]  # the greedy choice kept


def test_retune_folder_writes_the_new_shapes_and_report_into_the_folder(pair, tmp_path, monkeypatch):
    target, drafter = pair
    drafter.generation_config = GenerationConfig(**SPECULATION_DEFAULTS)
    drafter.save_pretrained(tmp_path)
    (tmp_path / "tuning.json").write_text(json.dumps(saved_report(TREE)))

    def sampled(target, drafter, report, prompts):  # the calibration's outcome, by hand
        drafter.generation_config.sampling_shape = {**SAMPLED, "tree_depth": 4, "tree_total_tokens": 4}
        return {**report, "sampling": {"shape": drafter.generation_config.sampling_shape}}

    monkeypatch.setattr(apply, "tune_sampling", sampled)
    report = apply.retune_folder(target, tmp_path, [PROMPTS[0:1]], sampling_only=True)
    assert json.loads((tmp_path / "tuning.json").read_text()) == report
    assert report["sampling"]["shape"]["tree_depth"] == 4 and report["choice"] == TREE
    assert settings_of(Eagle3DraftModel.from_pretrained(tmp_path)).sampling_shape == TunedShape(1, 4, 4, 1.3)
