"""Measuring costs and acceptance (hf_eagle31.tuning.measure) on a tiny pair: what is timed, how often, and what
is left out of the time. Speed itself is the benchmarks' business, not a test's."""

import pytest
import torch
from tiny_models import make_drafter, make_target
from transformers import GenerationConfig

from hf_eagle31.backends import backend_for
from hf_eagle31.configuration import SPECULATION_DEFAULTS
from hf_eagle31.tuning import measure


@pytest.fixture(scope="module")
def pair():
    target = make_target()
    return target, make_drafter(target)


@pytest.fixture
def drafter(pair):
    drafter = pair[1]
    drafter.generation_config = GenerationConfig(**SPECULATION_DEFAULTS)
    return drafter


class FakeClock:
    """`time.perf_counter` advanced only by the calls a test makes."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> None:
        self.now += seconds


def test_best_of_keeps_the_fastest_call_and_leaves_the_untimed_one_out(monkeypatch):
    clock, durations, order = FakeClock(), iter([0.3, 0.1, 0.25, 0.2]), []
    monkeypatch.setattr(measure.time, "perf_counter", clock)
    fastest = measure.best_of(lambda: order.append("fn") or clock.wait(next(durations)), repeats=4,
                              before=lambda: order.append("before") or clock.wait(5.0))
    assert fastest == pytest.approx(0.1)  # the 5 s before each call never counts
    assert order == ["before", "fn"] * 4
    assert measure.best_of(lambda: clock.wait(0.7), repeats=1) == pytest.approx(0.7)


def test_the_representative_tree_spreads_its_nodes_over_the_levels():
    tree = measure._bushy_tree(5, 2, "cpu")
    assert tree.parents.tolist() == [-1, 0, 0, 2, 2] and tree.depths.tolist() == [0, 1, 1, 2, 2]
    chain = measure._bushy_tree(3, 6, "cpu")  # deeper than its nodes allow: a chain
    assert chain.parents.tolist() == [-1, 0, 1] and chain.depths.tolist() == [0, 1, 2]
    assert measure._bushy_tree(4, 1, "cpu").depths.tolist() == [0, 1, 1, 1]


def test_the_verify_cost_curve_gives_one_time_per_size_and_leaves_the_target_as_it_was(pair):
    target, drafter = pair
    forward, hooks = target.forward, dict(target._forward_hooks)
    curve = measure.verify_cost_curve(target, [1, 3, 8], drafter.config.target_layer_ids, context=16, repeats=2)
    assert list(curve) == [1, 3, 8] and all(isinstance(t, float) and t > 0 for t in curve.values())
    assert target.forward == forward and dict(target._forward_hooks) == hooks


def test_a_target_step_is_one_uncached_forward_of_one_token(pair):
    target, _ = pair
    seen = []
    hook = target.register_forward_pre_hook(lambda _, args, kwargs: seen.append((args, kwargs)), with_kwargs=True)
    try:
        measure.target_step(target)()
    finally:
        hook.remove()
    (args, kwargs), = seen
    assert args[0].shape == (1, 1) and kwargs["use_cache"] is False


def test_draft_cost_times_each_tree_after_one_untimed_call_of_before(drafter):
    before = []
    seconds = measure.draft_cost(drafter, depth=3, top_k=2, context=16, repeats=3, before=lambda: before.append(1))
    assert len(before) == 3 and isinstance(seconds, float) and seconds > 0  # the warm-up tree runs without it
    batched = measure.draft_cost(drafter, depth=2, top_k=2, context=16, repeats=1, batch_size=3)
    assert batched > 0


def test_exact_verification_is_timed_on_the_plain_weights_only(pair, drafter):
    target, _ = pair
    drafter.generation_config.verify_mode = "exact"
    assert measure.verify_paths(target, measure.settings_of(drafter)) == (False,)
    drafter.generation_config.verify_mode = SPECULATION_DEFAULTS["verify_mode"]
    packs = backend_for(target, True).name != "default"
    assert measure.verify_paths(target, measure.settings_of(drafter)) == ((True, False) if packs else (False,))


def test_speculation_settings_hold_for_the_block_and_are_restored_after_an_error(drafter):
    config = drafter.generation_config
    depth = config.tree_depth
    with pytest.raises(RuntimeError, match="inside"):
        with measure.speculation_settings(drafter, tree_depth=depth + 3, batch_shapes=None, collapse_fallback=False):
            assert (config.tree_depth, config.collapse_fallback) == (depth + 3, False)
            raise RuntimeError("inside")
    assert config.tree_depth == depth and config.collapse_fallback == SPECULATION_DEFAULTS["collapse_fallback"]


def test_batch_costs_cover_every_batch_block_and_depth(pair, drafter, monkeypatch):
    target, _ = pair
    monkeypatch.setattr(measure, "BATCH_BLOCK_SIZES", (1, 3))  # the default blocks: a slower test, not another one
    costs = measure.batch_costs(target, drafter, [1, 2], max_depth=2, batch_sizes=(2,), context=16, repeats=1,
                                cpu_backend=False)
    assert set(costs) == {"verify_seconds", "draft_seconds", "plain_seconds"}
    assert list(costs["verify_seconds"][2]) == [1, 3] and costs["plain_seconds"][2] > 0
    assert {k: list(depths) for k, depths in costs["draft_seconds"][2].items()} == {1: [1, 2], 2: [1, 2]}
    assert all(t > 0 for depths in costs["draft_seconds"][2].values() for t in depths.values())
