"""Drafting, verification building blocks and runtime control, each against a plain reference."""

import logging

import pytest
import torch
from tiny_models import PROMPTS, make_drafter, make_target, trained_pair
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_eagle31.control import CollapseMonitor, DepthController
from hf_eagle31.drafting import DrafterState, DraftTree, draft_tree
from hf_eagle31.features import capture_request, select_features
from hf_eagle31.kernels.tree_attention import tree_attention_reference
from hf_eagle31.cache import compact_cache
from hf_eagle31.exact import decode_equivalent_attention
from hf_eagle31.verify_plan import VerifyPlan


def context(target, drafter, prompt):
    with torch.no_grad():
        out = target(prompt, output_hidden_states=capture_request(drafter.config.target_layer_ids))
    features = select_features(out.hidden_states, drafter.config.target_layer_ids)
    root = out.logits[:, -1].argmax(-1, keepdim=True)
    return features, torch.cat([prompt[:, 1:], root], dim=1), root


@torch.no_grad()
def path_log_probs(drafter, features, tokens, path):
    """Draft log-probabilities after `path`, by running the drafter on the whole path from scratch."""
    out = drafter(tokens, features)
    hidden, logits = out.hidden_states[:, -1:], out.logits[:, -1:]
    cache = DynamicCache()
    drafter(tokens, features, cache=cache)
    for token in path:
        out = drafter(torch.tensor([[token]]), hidden, cache=cache)
        hidden, logits = out.hidden_states, out.logits
    return torch.log_softmax(logits[0, -1].float(), -1)


def reference_tree(drafter, features, tokens, depth, top_k, total):
    """EAGLE-2 tree selection written the slow, obvious way: one drafter run per expanded node."""
    pool = {}  # path (draft ids) -> score
    frontier = [((), 0.0)]
    for _ in range(depth):
        candidates = {}
        for path, score in frontier:
            log_probs = path_log_probs(drafter, features, tokens, [int(drafter.draft_to_target(torch.tensor(t))) for t in path])
            values, ids = log_probs.topk(top_k)
            for value, draft_id in zip(values.tolist(), ids.tolist()):
                candidates[path + (draft_id,)] = score + value
        pool.update(candidates)
        frontier = sorted(candidates.items(), key=lambda kv: -kv[1])[:top_k]
    return {path for path, _ in sorted(pool.items(), key=lambda kv: -kv[1])[:total]}


def tree_paths(tree: DraftTree, drafter) -> set[tuple[int, ...]]:
    paths, parents = set(), tree.parents.tolist()
    for node in range(1, len(tree)):
        path, walk = [], node
        while walk > 0:
            path.append(int(tree.tokens[walk]))
            walk = parents[walk]
        paths.add(tuple(reversed(path)))
    return paths


@pytest.mark.parametrize("eagle31, top_k, total", [(False, 3, 12), (True, 3, 12), (True, 6, 4)])
def test_batched_tree_drafting_matches_the_one_node_at_a_time_reference(eagle31, top_k, total):
    """A top_k above the tree's size keeps the reference's tree while drafting only `total` wide."""
    target = make_target("llama")
    drafter = make_drafter(target, eagle31=eagle31, draft_vocab_size=200)
    drafter.d2t[:] = 56  # draft id i is target id i + 56: exercises the vocabulary map
    features, tokens, root = context(target, drafter, PROMPTS[0:1])
    state = DrafterState(drafter)
    state.push(features, tokens)
    widths = []
    hook = drafter.register_forward_pre_hook(lambda _, args: widths.append(args[0].shape[1]))
    (tree,) = draft_tree(state, root[0], depth=4, top_k=top_k, total_tokens=total)
    hook.remove()
    assert len(tree) == total + 1 and tree.depth <= 4
    assert max(widths[1:]) <= min(top_k, total)  # after the catch-up forward, one forward per level
    reference = reference_tree(drafter, features, tokens, depth=4, top_k=top_k, total=total)
    expected = {tuple(t + 56 for t in path) for path in reference}
    assert tree_paths(tree, drafter) == expected
    assert all(p < n for n, p in enumerate(tree.parents.tolist()) if n > 0)  # parents precede children


def test_levels_whose_nodes_the_tree_cannot_keep_are_not_drafted():
    """A random drafter is unsure (each draft near 1/200): a tree of 2 tokens keeps the root's best children,
    so deeper nodes score below both and expanding them would draft nothing kept. The tree stops early and is
    still the reference's, drafted 3 wide at every one of the 6 levels."""
    target = make_target("llama")
    drafter = make_drafter(target, eagle31=True, draft_vocab_size=200)
    features, tokens, root = context(target, drafter, PROMPTS[0:1])
    state = DrafterState(drafter)
    state.push(features, tokens)
    widths = []
    hook = drafter.register_forward_pre_hook(lambda _, args: widths.append(args[0].shape[1]))
    (tree,) = draft_tree(state, root[0], depth=6, top_k=3, total_tokens=2)
    hook.remove()
    assert len(widths) < 6  # the catch-up and fewer levels than asked
    assert tree_paths(tree, drafter) == reference_tree(drafter, features, tokens, depth=6, top_k=3, total=2)


@pytest.mark.parametrize("prompt", range(3))
def test_a_large_trees_frontier_ranks_say_how_deep_each_smaller_tree_drafts(prompt):
    """What tuning reads off one calibration tree (`drafted_levels`) is what drafting the smaller tree does."""
    from hf_eagle31.tuning import drafted_levels

    target, drafter = trained_pair("llama", True)
    features, tokens, root = context(target, drafter, PROMPTS[prompt : prompt + 1])

    def forwards(total: int) -> tuple[int, DraftTree]:
        state, calls = DrafterState(drafter), []
        state.push(features, tokens)
        hook = drafter.register_forward_pre_hook(lambda *_: calls.append(1))
        try:
            (tree,) = draft_tree(state, root[0], depth=6, top_k=4, total_tokens=total)
        finally:
            hook.remove()
        return len(calls), tree

    _, large = forwards(40)
    predicted = {total: drafted_levels(large.frontier_ranks.tolist(), total, 6) for total in (1, 2, 3, 5, 8, 40)}
    assert {total: forwards(total)[0] for total in predicted} == predicted
    assert len(set(predicted.values())) > 1  # some smaller tree stopped early


def test_a_tree_of_top_k_1_is_the_greedy_chain_drafted_step_by_step():
    target = make_target("qwen2")
    drafter = make_drafter(target, eagle31=True)
    features, tokens, root = context(target, drafter, PROMPTS[1:2])
    state = DrafterState(drafter)
    state.push(features, tokens)
    (chain,) = draft_tree(state, root[0], depth=4, top_k=1, total_tokens=4)
    assert chain.parents.tolist() == [-1, 0, 1, 2, 3] and chain.ranks.tolist() == [-1, 0, 1, 2, 3]
    path = []
    for step in range(4):
        expected = drafter.draft_to_target(path_log_probs(drafter, features, tokens, path).argmax())
        assert int(chain.tokens[step + 1]) == int(expected)
        path.append(int(expected))


def test_a_sampled_chain_keeps_the_distribution_each_draft_was_drawn_from():
    """With a temperature a chain is drawn from the drafter (speculative sampling's proposal q), and each node
    keeps q in the target's vocabulary, which verification accepts against."""
    target = make_target("qwen2")
    drafter = make_drafter(target, eagle31=True)
    features, tokens, root = context(target, drafter, PROMPTS[1:2])
    state = DrafterState(drafter)
    state.push(features, tokens)
    torch.manual_seed(0)
    (chain,) = draft_tree(state, root[0], depth=4, top_k=1, total_tokens=4, temperature=0.7)
    assert chain.parents.tolist() == [-1, 0, 1, 2, 3] and chain.proposal(4) is None
    path = []
    for step in range(4):
        log_q = torch.log_softmax(path_log_probs(drafter, features, tokens, path) / 0.7, -1)
        q = drafter.expand_to_target_vocab(log_q).exp()
        token, proposal = chain.proposal(step)
        assert token == int(chain.tokens[step + 1]) and q[token] > 0
        torch.testing.assert_close(proposal, q, atol=1e-5, rtol=1e-4)
        path.append(token)


def test_a_tree_capped_to_one_token_is_still_drafted_greedily_when_sampling():
    """Capping a tree's width at its size (one token near max_length) keeps it a top-k tree: only a shape of
    top_k 1 is drawn from the drafter."""
    target = make_target("qwen2")
    drafter = make_drafter(target, eagle31=True)
    features, tokens, root = context(target, drafter, PROMPTS[1:2])
    state = DrafterState(drafter)
    state.push(features, tokens)
    (tree,) = draft_tree(state, root[0], depth=2, top_k=3, total_tokens=1, temperature=0.7)
    assert tree.proposals is None
    expected = drafter.draft_to_target(path_log_probs(drafter, features, tokens, []).argmax())
    assert tree.tokens.tolist()[1:] == [int(expected)]


def test_drafter_state_drops_draft_entries_and_keeps_real_ones():
    target = make_target("llama")
    drafter = make_drafter(target)
    features, tokens, _ = context(target, drafter, PROMPTS[2:3])
    state = DrafterState(drafter)
    state.push(features[:, :4], tokens[:, :4])
    draft_tree(state, tokens[0, 3:4], depth=3, top_k=2, total_tokens=6)
    state.push(features[:, 4:], tokens[:, 4:])
    hidden, logits = state.catch_up()
    fresh = drafter(tokens, features)
    assert state.length == int(state.key_mask.sum()) == tokens.shape[1]  # the draft's entries are hidden
    torch.testing.assert_close(logits[0, -1], fresh.logits[0, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_a_batch_of_ragged_rows_drafts_what_each_row_drafts_alone(mode):
    """Rows queue different numbers of features per step (holes in the batched cache) and still draft as alone."""
    target = make_target("llama")
    drafter = make_drafter(target, eagle31=True)
    rows = [context(target, drafter, PROMPTS[i : i + 1, : 6 - i]) for i in range(3)]  # prompts of 6, 5, 4 tokens
    firsts = [2, 4, 1]  # each row's features arrive in two steps, split here

    def draft(state, roots):
        shape = dict(depth=3, top_k=3, total_tokens=8) if mode == "tree" else dict(depth=4, top_k=1, total_tokens=4)
        return [tree.tokens for tree in draft_tree(state, roots, **shape)]

    batch, roots = DrafterState(drafter, 3), torch.cat([root[0] for _, _, root in rows])
    for step in (slice(None, 2), slice(2, None)):  # 1st step: the first part of every row; 2nd: the rest
        for row, ((features, tokens, _), first) in enumerate(zip(rows, firsts)):
            part = slice(None, first) if step.stop else slice(first, None)
            batch.push(features[:, part], tokens[:, part], row)
        together = draft(batch, roots)
    assert not bool(batch.key_mask.all()), "the rows never left a hole: the test exercised nothing"
    for row, ((features, tokens, root), first) in enumerate(zip(rows, firsts)):
        alone = DrafterState(drafter)
        alone.push(features[:, :first], tokens[:, :first])
        draft(alone, root[0])
        alone.push(features[:, first:], tokens[:, first:])
        assert torch.equal(draft(alone, root[0])[0], together[row]), row


def test_ancestor_mask_matches_a_hand_built_one():
    #      0
    #    1   2
    #  3  4   5
    #  6
    tree = DraftTree(torch.arange(7), torch.tensor([-1, 0, 0, 1, 1, 2, 3]), torch.tensor([0, 1, 1, 2, 2, 2, 3]))
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for node, ancestors in {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5], 6: [0, 1, 3, 6]}.items():
        expected[node, ancestors] = True
    assert torch.equal(tree.ancestor_mask(), expected)


def test_compact_cache_keeps_the_accepted_entries_in_order():
    cache = DynamicCache()
    keys = torch.arange(2 * 10 * 3, dtype=torch.float).view(1, 2, 10, 3)
    cache.update(keys, -keys, 0)
    compact_cache(cache, 4, [torch.tensor([0, 2, 5])])
    kept = [0, 1, 2, 3, 4, 6, 9]
    assert torch.equal(cache.layers[0].keys, keys[:, :, kept]) and torch.equal(cache.layers[0].values, -keys[:, :, kept])


def test_compact_cache_with_rows_of_different_lengths_marks_the_holes():
    cache = DynamicCache()
    keys = torch.arange(2 * 2 * 9 * 3, dtype=torch.float).view(2, 2, 9, 3)
    cache.update(keys, -keys, 0)
    real = compact_cache(cache, 4, [torch.tensor([0, 1, 2]), torch.tensor([0, 3])])  # a prefix beside a tree path
    assert torch.equal(real, torch.tensor([[True, True, True], [True, True, False]]))
    assert torch.equal(cache.layers[0].keys[0], keys[0, :, :7]) and torch.equal(cache.layers[0].keys[1, :, :6],
                                                                                keys[1, :, [0, 1, 2, 3, 4, 7]])
    chain = DynamicCache()
    chain.update(keys, -keys, 0)
    compact_cache(chain, 4, [torch.tensor([0, 1]), torch.tensor([0])])  # in place already: only cut
    assert torch.equal(chain.layers[0].keys, keys[:, :, :6]) and torch.equal(chain.layers[0].values, -keys[:, :, :6])


class _Attention:
    is_causal, num_key_value_groups, training = True, 2, False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_equivalent_attention_equals_one_token_decoding_bit_for_bit(dtype):
    torch.manual_seed(0)
    prefix, n = 20, 6
    key = torch.randn(1, 2, prefix + n, 16, dtype=dtype)
    value, query = torch.randn_like(key), torch.randn(1, 4, n, 16, dtype=dtype)
    tree = DraftTree(torch.arange(n), torch.tensor([-1, 0, 0, 1, 2, 4]), torch.tensor([0, 1, 1, 2, 2, 3]))
    mask = tree.ancestor_mask()
    out, _ = decode_equivalent_attention(_Attention(), query, key, value, VerifyPlan(mask[None], "exact"), None, 0.25, 0.0)
    for node in range(n):
        seen = list(range(prefix)) + [prefix + j for j in mask[node].nonzero().flatten().tolist()]
        decode_query = query[:, :, node : node + 1].transpose(1, 2).contiguous().transpose(1, 2)  # as q_proj lays it out
        single, _ = sdpa_attention_forward(_Attention(), decode_query, key[:, :, seen], value[:, :, seen], None, scaling=0.25)
        assert torch.equal(out[:, node], single[:, 0])
    reference = tree_attention_reference(query.float(), key.float(), value.float(), mask, 0.25).transpose(1, 2)
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)


def test_depth_controller_is_bounded_deterministic_and_responsive():
    def run(history):
        controller = DepthController(min_depth=1, max_depth=8, depth=4)
        return [controller.update(proposed, accepted) for proposed, accepted in history]

    good = [(4, 4)] * 10
    bad = [(4, 0)] * 10
    assert run(good)[-1] == 8 and run(bad)[-1] == 1
    mixed = [(4, 4), (4, 0), (5, 3), (6, 1)] * 5
    lengths = run(mixed)
    assert lengths == run(mixed) and all(1 <= length <= 8 for length in lengths)


def test_collapse_monitor_backs_off_exponentially_and_recovers():
    monitor = CollapseMonitor(check_every=2, window=2, initial_backoff=4, max_backoff=16)
    plain_runs = []
    for _ in range(4):  # useless speculation: one token per step, slower than a plain step
        for _ in range(2):
            monitor.record_speculative(emitted=1, seconds=2.0, verify_seconds=1.0)
        assert not monitor.should_speculate()
        runs = 0
        while not monitor.should_speculate():
            monitor.record_plain(1.0)
            runs += 1
        plain_runs.append(runs)
    assert plain_runs == [4, 8, 16, 16] and monitor.fallbacks == 4
    for _ in range(2):  # now speculation pays: 3 tokens in 1.5 plain-step times
        monitor.record_speculative(emitted=3, seconds=1.5, verify_seconds=1.0)
    assert monitor.should_speculate() and monitor.backoff == 8


def test_collapse_monitor_judges_a_long_window_with_a_margin():
    """A hard stretch inside a paying run, or a window a little slower than plain decoding, is no collapse."""
    monitor = CollapseMonitor()  # checks every 4 steps over the last 16; plain steps cost 1.0 s
    monitor.record_plain(1.0)
    for _ in range(12):  # 3 tokens per 1.5 s: twice the plain rate
        monitor.record_speculative(emitted=3, seconds=1.5, verify_seconds=1.0)
    for _ in range(4):  # a stretch where nothing is accepted, judged with the 12 steps before it
        monitor.record_speculative(emitted=1, seconds=1.5, verify_seconds=1.0)
    assert monitor.should_speculate() and monitor.fallbacks == 0
    slightly_slower = CollapseMonitor()
    slightly_slower.record_plain(1.0)
    for _ in range(4):  # 0.95 of the plain rate: within the margin
        slightly_slower.record_speculative(emitted=1.9, seconds=2.0, verify_seconds=1.0)
    assert slightly_slower.should_speculate()
    for _ in range(4):  # then 0.8: over the 8 steps, 0.875 of the plain rate, clearly slower
        slightly_slower.record_speculative(emitted=1.6, seconds=2.0, verify_seconds=1.0)
    assert not slightly_slower.should_speculate() and slightly_slower.fallbacks == 1
    assert len(slightly_slower.recent) == 0  # the probe after the fallback is judged on its own


def test_collapse_monitor_blames_the_drafter_only_where_no_losing_check_accepted_anything(caplog):
    """A drafter accepted well but verified at too high a cost (a CPU without AVX-512) loses its checks; a probe of a
    few steps that then meets a hard stretch accepts nothing. The warning names the verify cost, not the drafter."""
    monitor = CollapseMonitor(check_every=2, window=2, initial_backoff=1)
    monitor.record_plain(1.0)
    with caplog.at_level(logging.WARNING, logger="hf_eagle31"):
        for emitted in (3, 3, 1):  # 3 tokens in 4 plain steps' time, twice; then a probe that accepts nothing
            for _ in range(2):
                monitor.record_speculative(emitted=emitted, seconds=4.0, verify_seconds=3.5)
            while not monitor.should_speculate():
                monitor.record_plain(1.0)
    [warning] = [r.message for r in caplog.records]
    assert "3 checks in a row" in warning and "2.3 tokens a step" in warning and "verify cost" in warning
    assert "Nothing was accepted" not in warning


def test_tree_mode_uses_the_draft_vocabulary_map():
    target, drafter = trained_pair("llama", True)
    assert torch.equal(drafter.d2t, torch.zeros_like(drafter.d2t))  # identity map: trivially consistent
    assert drafter.draft_to_target(torch.tensor([5])).item() == 5


def test_collapse_monitor_warns_once_and_only_when_losing_persists(caplog):
    def window(monitor, emitted):  # one judged window; plain steps cost 1.0 s, a speculative one 2.0 s
        for _ in range(2):
            monitor.record_speculative(emitted=emitted, seconds=2.0, verify_seconds=1.0)
        while not monitor.should_speculate():
            monitor.record_plain(1.0)

    monitor = CollapseMonitor(check_every=2, window=2, initial_backoff=1)
    with caplog.at_level(logging.WARNING, logger="hf_eagle31"):
        for emitted in (1, 1, 4, 1, 1):  # two losses, a win, two losses: a hard stretch, not a bad drafter
            window(monitor, emitted)
        assert monitor.fallbacks == 4 and not caplog.records
        for emitted in (1,) * 5:  # the third loss in a row warns; later ones do not
            window(monitor, emitted)
    assert sum("slower than plain decoding 3 checks in a row" in r.message for r in caplog.records) == 1
