"""Predicting a shape's speed from measured costs and calibrated acceptance (hf_eagle31.tuning.predict): pure
functions, checked against values worked out by hand or by brute force."""

import itertools
import json

import pytest

from hf_eagle31.tuning import (
    CALL_TOKENS,
    TuningReport,
    batch_shapes,
    drafted_levels,
    mean_draft_seconds,
    non_decreasing,
    projected_tau,
    rank_candidates,
    sampling_tuning,
    tree_draft_seconds,
)


def test_projected_tau_rescores_accepted_paths_for_smaller_drafts():
    ranks = [[0, 1, 5, 2], [3], [], [0, 9, 1]]
    # full tree: accepted 4, 1, 0, 3 -> emitted 5, 2, 1, 4
    assert projected_tau(ranks, total_tokens=100, depth=10) == pytest.approx((5 + 2 + 1 + 4) / 4)
    # only the 4 best nodes: 2 (rank 5 cut), 1, 0, 1 (rank 9 cut) -> emitted 3, 2, 1, 2
    assert projected_tau(ranks, total_tokens=4, depth=10) == pytest.approx((3 + 2 + 1 + 2) / 4)
    # two levels deep: 2, 1, 0, 2 -> emitted 3, 2, 1, 3
    assert projected_tau(ranks, total_tokens=100, depth=2) == pytest.approx((3 + 2 + 1 + 3) / 4)


def test_sampling_tuning_predicts_from_the_saved_costs_by_hand():
    report = {"verify_seconds": {"1": 1.0, "2": 1.2, "3": 1.5}, "plain_seconds": 1.0,
              "draft_seconds": {"1": {"1": 0.1, "2": 0.2}, "3": {"1": 0.3, "2": 0.5}}}
    # sampled: the chain's second draft never passes; greedy would have accepted it
    ranks = {1: [[0], [0], []], 3: [[0, 1], [1], [0]]}
    chosen = sampling_tuning(report, ranks, 1.0)["shape"]
    # chain 1: tau 5/3, 1.0 / 1.3 -> 1.28; tree (3, 1, 2): tau 2, 1.0 / 1.8 -> 1.11; (3, 2, 2): tau 7/3 / 2.0 -> 1.17
    assert (chosen["tree_top_k"], chosen["tree_depth"], chosen["tree_total_tokens"]) == (1, 1, 1)
    assert chosen["speedup"] == pytest.approx(5 / 3 / 1.3) and chosen["temperature"] == 1.0


def test_candidates_follow_the_speedup_formula():
    verify = {1: 1.0, 2: 1.2, 3: 1.5}
    drafts = {1: {1: 0.1, 2: 0.2}, 3: {1: 0.3, 2: 0.5}}
    ranks = {1: [[0, 1], [0], []], 3: [[0, 1], [1], [0]]}
    candidates = rank_candidates(verify, drafts, ranks, plain_seconds=1.25)  # packed verification: t(1) < plain
    shapes = {(c["tree_top_k"], c["tree_depth"], c["tree_total_tokens"]) for c in candidates}
    assert shapes == {(1, 1, 1), (1, 2, 2), (3, 1, 1), (3, 1, 2), (3, 2, 2)}  # a chain keeps depth == tokens
    chain = next(c for c in candidates if (c["tree_top_k"], c["tree_depth"]) == (1, 2))
    assert chain["tau"] == pytest.approx((3 + 2 + 1) / 3) and chain["speedup"] == pytest.approx(chain["tau"] * 1.25 / (1.5 + 0.2))


def test_a_shapes_draft_cost_is_the_mean_of_the_levels_its_steps_would_draft():
    """Calibrated frontier ranks say how deep each step's smaller tree drafts: a level runs while its best node
    ranks among the tree's nodes, so a tree of 3 drafts 1, 3 and 2 forwards at these steps, a tree of 8 2, 3 and 3."""
    verify = {1: 1.0, 4: 1.2, 9: 1.5}
    drafts = {3: {1: 0.1, 2: 0.2, 3: 0.3}, 8: {1: 0.1, 2: 0.4, 3: 0.8}}
    ranks, frontier = {8: [[0], [0, 1], []]}, {8: [[5, 8], [0, 1], [1, 7]]}
    candidates = rank_candidates(verify, drafts, ranks, plain_seconds=1.0, frontier_by_top_k=frontier)
    small = next(c for c in candidates if (c["tree_depth"], c["tree_total_tokens"]) == (3, 3))
    assert small["speedup"] == pytest.approx(small["tau"] / (1.2 + (0.1 + 0.3 + 0.2) / 3))
    wide = next(c for c in candidates if (c["tree_depth"], c["tree_total_tokens"]) == (3, 8))
    assert wide["speedup"] == pytest.approx(wide["tau"] / (1.5 + (0.4 + 0.8 + 0.8) / 3))
    full = rank_candidates(verify, drafts, ranks, plain_seconds=1.0)  # no frontier ranks: every step a full tree
    assert next(c for c in full if (c["tree_depth"], c["tree_total_tokens"]) == (3, 3))["speedup"] == pytest.approx(
        small["tau"] / (1.2 + 0.3))


def test_a_calls_packing_is_spread_over_its_steps_in_the_predicted_speedup():
    verify, drafts, ranks = {1: 1.0, 3: 1.5}, {1: {2: 0.2}}, {1: [[0, 1], [0], []]}
    chain = rank_candidates(verify, drafts, ranks, plain_seconds=1.25, call_seconds=12.8)[0]
    tau = (3 + 2 + 1) / 3  # a call of CALL_TOKENS tokens takes CALL_TOKENS / tau steps, and packs once
    assert chain["speedup"] == pytest.approx(tau * 1.25 / (1.5 + 0.2 + 12.8 * tau / CALL_TOKENS))


def test_projected_tau_of_every_small_step_against_counting_its_accepted_drafts():
    """Every step of up to 3 accepted drafts with ranks below 5, at every size and depth: a step emits one token
    more than the drafts it accepted before the first one a tree of `total_tokens` nodes, `depth` deep, drops."""
    steps = [list(ranks) for length in range(4) for ranks in itertools.product(range(5), repeat=length)]
    for total_tokens, depth in itertools.product(range(1, 6), range(1, 5)):
        for ranks in steps:
            kept = [rank < total_tokens for rank in ranks[:depth]] + [False]
            assert projected_tau([ranks], total_tokens, depth) == kept.index(False) + 1, (ranks, total_tokens, depth)
    assert projected_tau([[0, 1], [2], [0, 0, 4]], 3, 2) == (3 + 2 + 3) / 3  # two levels, the 3 best nodes
    assert projected_tau([], 3, 2) == 0.0  # no calibrated step: no tokens predicted


def test_projected_tau_never_grows_as_the_tree_shrinks():
    ranks = [[0, 3, 1, 7], [2, 0], [], [5], [0, 1, 2, 3, 4, 5]]
    for depth in range(1, 7):
        taus = [projected_tau(ranks, total, depth) for total in range(1, 9)]
        assert taus == sorted(taus) and taus[0] == (2 + 1 + 1 + 1 + 2) / 5  # one node: only rank-0 first drafts
    assert projected_tau(ranks, 8, 1) == (2 + 2 + 1 + 2 + 2) / 5


def test_non_decreasing_raises_each_cost_to_the_highest_at_a_smaller_size():
    assert non_decreasing({4: 1.1, 1: 1.0, 3: 1.2, 2: 0.9, 6: 1.5}) == {1: 1.0, 2: 1.0, 3: 1.2, 4: 1.2, 6: 1.5}
    assert list(non_decreasing({3: 2.0, 1: 1.0})) == [1, 3]  # by size, whatever order the costs came in
    assert non_decreasing({1: 0.5, 2: 0.5}) == {1: 0.5, 2: 0.5} and non_decreasing({}) == {}


def test_rank_candidates_offers_every_covered_shape_and_the_fastest_by_hand():
    verify = {1: 1.0, 2: 1.1, 3: 1.3, 5: 2.0}
    drafts = {1: {1: 0.1, 2: 0.2, 3: 0.3}, 2: {1: 0.2, 2: 0.3}}  # width 2 timed 2 deep only
    ranks = {1: [[0, 0, 0], [0], [0, 0]], 2: [[1, 0], [1, 1], [0, 3]]}
    candidates = rank_candidates(verify, drafts, ranks, plain_seconds=1.0)
    by_shape = {(c["tree_top_k"], c["tree_depth"], c["tree_total_tokens"]): c for c in candidates}
    # chains: depth == nodes; trees at top_k 2: nodes >= depth, width min(2, nodes) timed at that depth
    assert set(by_shape) == {(1, 1, 1), (1, 2, 2), (2, 1, 1), (2, 1, 2), (2, 2, 2), (2, 1, 4), (2, 2, 4)}
    # chain 2: emitted 3, 2, 3 -> tau 8/3 over 1.3 + 0.2;  chain 1: tau 2 over 1.1 + 0.1
    assert by_shape[1, 2, 2]["tau"] == pytest.approx(8 / 3)
    assert by_shape[1, 2, 2]["speedup"] == pytest.approx(8 / 3 / 1.5)
    assert by_shape[1, 1, 1]["speedup"] == pytest.approx(2 / 1.2)
    # tree (2, 2, 4): ranks 1,0 | 1,1 | 0,3 all among the 4 best -> accepted 2, 2, 2 -> tau 3 over 2.0 + 0.3
    assert by_shape[2, 2, 4]["speedup"] == pytest.approx(3 / 2.3)
    # tree (2, 2, 2): rank 3 cut -> accepted 2, 2, 1 -> tau 8/3 over 1.3 + 0.3
    assert by_shape[2, 2, 2]["speedup"] == pytest.approx(8 / 3 / 1.6)
    # tree (2, 1, 1): only rank 0 kept -> accepted 0, 0, 1 -> tau 4/3 over 1.1 + 0.1
    assert by_shape[2, 1, 1]["speedup"] == pytest.approx(4 / 3 / 1.2)
    fastest = max(candidates, key=lambda c: c["speedup"])
    assert (fastest["tree_top_k"], fastest["tree_depth"], fastest["tree_total_tokens"]) == (1, 2, 2)


def test_rank_candidates_skips_a_shape_whose_width_was_never_timed():
    candidates = rank_candidates({1: 1.0, 2: 1.1, 4: 1.3}, {1: {1: 0.1}}, {3: [[0], [1]]}, plain_seconds=1.0)
    # top_k 3 drafts min(3, nodes) wide: only a one-node tree drafts at the one width timed
    assert [(c["tree_top_k"], c["tree_depth"], c["tree_total_tokens"]) for c in candidates] == [(3, 1, 1)]
    assert candidates[0]["speedup"] == pytest.approx(1.5 / 1.2)


def test_tree_draft_seconds_takes_the_width_drafted_or_the_nearest_wider_one_timed():
    drafts = {1: {1: 0.1, 2: 0.2}, 4: {1: 0.3, 2: 0.5}, 10: {1: 0.9}}
    assert tree_draft_seconds(drafts, top_k=1, nodes=5, depth=2) == 0.2  # a chain drafts one wide
    assert tree_draft_seconds(drafts, top_k=3, nodes=8, depth=2) == 0.5  # 3 wide, not timed: 4 wide, an upper bound
    assert tree_draft_seconds(drafts, top_k=10, nodes=2, depth=1) == 0.3  # 10 of 2 nodes drafts 2 wide
    assert tree_draft_seconds(drafts, top_k=4, nodes=8, depth=1) == 0.3
    assert tree_draft_seconds(drafts, top_k=10, nodes=20, depth=2) is None  # 10 wide never timed 2 deep
    assert tree_draft_seconds(drafts, top_k=1, nodes=3, depth=3) is None


def test_drafted_levels_stops_where_a_levels_best_node_falls_out_of_the_tree():
    # the catch-up, then one more level per frontier rank among the `nodes` best, up to `depth` levels
    assert drafted_levels([5, 8], nodes=3, depth=3) == 1
    assert drafted_levels([0, 1], nodes=3, depth=3) == 3
    assert drafted_levels([1, 7], nodes=3, depth=3) == 2
    assert drafted_levels([1, 7], nodes=8, depth=3) == 3
    assert drafted_levels([0, 0, 0, 0], nodes=2, depth=2) == 2  # never deeper than `depth`
    assert drafted_levels([], nodes=2, depth=4) == 1  # a one-level calibration tree recorded no frontier
    assert drafted_levels([0, 3, 0], nodes=3, depth=4) == 2  # a level cut ends the tree, later ranks unread


def test_mean_draft_seconds_over_the_levels_each_step_drafts():
    drafts = {2: {1: 0.1, 2: 0.3, 3: 0.6}}
    frontier = [[0, 0], [0, 5], [4, 0], [1, 1]]  # at 3 nodes, 3 levels: 3, 2, 1 and 3 forwards
    assert mean_draft_seconds(drafts, 2, 3, 3, frontier) == pytest.approx((0.6 + 0.3 + 0.1 + 0.6) / 4)
    assert mean_draft_seconds(drafts, 2, 3, 3) == 0.6  # no frontier ranks (an older report): a full tree each step
    assert mean_draft_seconds(drafts, 2, 3, 3, []) == 0.6
    assert mean_draft_seconds({2: {1: 0.1, 3: 0.6}}, 2, 3, 3, frontier) is None  # 2 levels never timed
    assert mean_draft_seconds({2: {1: 0.1, 3: 0.6}}, 2, 3, 3, [[0, 0], [7, 7]]) == pytest.approx((0.6 + 0.1) / 2)


def test_a_report_picks_its_fastest_chain_tree_and_shape_and_its_cost_ratio():
    candidates = [{"tree_top_k": 1, "tree_depth": 2, "tree_total_tokens": 2, "tau": 2.0, "speedup": 1.4},
                  {"tree_top_k": 1, "tree_depth": 4, "tree_total_tokens": 4, "tau": 2.5, "speedup": 1.2},
                  {"tree_top_k": 3, "tree_depth": 3, "tree_total_tokens": 6, "tau": 3.0, "speedup": 1.6},
                  {"tree_top_k": 3, "tree_depth": 2, "tree_total_tokens": 4, "tau": 2.6, "speedup": 1.5}]
    report = TuningReport({1: 0.02, 3: 0.025, 7: 0.04}, {1: {1: 0.01}}, 0.02, candidates)
    assert report.best(chain=True) == candidates[0] and report.best(chain=False) == candidates[2]
    assert report.choice == candidates[2]
    saved = report.as_dict()
    assert saved["verify_cost_ratio"] == pytest.approx({1: 1.0, 3: 1.25, 7: 2.0})
    assert (saved["choice"], saved["best_chain"], saved["best_tree"]) == (candidates[2], candidates[0], candidates[2])
    assert TuningReport({1: 0.02}, {}, 0.02, candidates[:2]).best(chain=False) == {}  # chains only: no tree


def test_sampling_tuning_spreads_the_saved_packing_over_a_call():
    report = {"verify_seconds": {"1": 1.0, "3": 1.5}, "plain_seconds": 1.25, "pack_seconds": 12.8,
              "draft_seconds": {"1": {"1": 0.1, "2": 0.2}}}
    ranks, frontier = {1: [[0, 0], [0], []]}, {1: [[0], [0], [0]]}
    tuned = sampling_tuning(report, ranks, 0.7, frontier)
    # chain 2: tau 2, 1.25 x 2 / (1.5 + 0.2 + 12.8 x 2 / CALL_TOKENS); chain 1 has no verify cost of 2 tokens
    assert [(c["tree_depth"], c["tree_total_tokens"]) for c in tuned["candidates"]] == [(2, 2)]
    assert tuned["shape"]["speedup"] == pytest.approx(2 * 1.25 / (1.7 + 12.8 * 2 / CALL_TOKENS))
    assert tuned["shape"]["temperature"] == 0.7 and tuned["calibration_frontier_ranks"] == frontier


def test_batch_shapes_price_a_batch_against_its_own_plain_step():
    candidates = [{"tree_top_k": 1, "tree_depth": 2, "tree_total_tokens": 2, "tau": 2.0},
                  {"tree_top_k": 2, "tree_depth": 2, "tree_total_tokens": 3, "tau": 2.4}]
    costs = {"verify_seconds": {2: {1: 0.010, 3: 0.012, 4: 0.015}, 4: {1: 0.020, 3: 0.030, 4: 0.036}},
             "draft_seconds": {2: {1: {2: 0.002}, 2: {2: 0.003}}, 4: {1: {2: 0.004}, 2: {2: 0.006}}},
             "plain_seconds": {2: 0.011, 4: 0.024}}
    report = json.loads(json.dumps({"candidates": candidates, "batch_costs": costs}))  # as saved: string keys
    shapes = batch_shapes(report)
    # batch 2: chain 2 -> 2 x 0.011 / 0.014 = 1.571; tree 3 -> 2.4 x 0.011 / 0.018 = 1.467
    assert shapes["2"] == {"tree_top_k": 1, "tree_depth": 2, "tree_total_tokens": 2,
                           "speedup": pytest.approx(2 * 0.011 / 0.014)}
    # batch 4: chain 2 -> 2 x 0.024 / 0.034 = 1.412; tree 3 -> 2.4 x 0.024 / 0.042 = 1.371
    assert shapes["4"]["tree_top_k"] == 1 and shapes["4"]["speedup"] == pytest.approx(2 * 0.024 / 0.034)
    costs["verify_seconds"] = {2: {1: 0.010, 4: 0.015}, 4: {1: 0.020, 4: 0.036}}  # 3 tokens not timed batched
    shapes = batch_shapes(json.loads(json.dumps({"candidates": candidates, "batch_costs": costs})))
    assert shapes["2"]["tree_top_k"] == 2 and shapes["2"]["speedup"] == pytest.approx(2.4 * 0.011 / 0.018)
    assert shapes["4"]["tree_top_k"] == 2 and shapes["4"]["speedup"] == pytest.approx(2.4 * 0.024 / 0.042)
