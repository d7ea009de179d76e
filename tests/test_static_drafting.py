"""Static drafting (`draft_mode="static"`): every level of a shape drafts on the same tensors and the kept tree is
selected on the device, so the host waits for nothing between the catch-up and the verify forward. The kept tree is
the narrowed draft's, and decoding with it is exact: greedy output equals plain `generate`, sampling follows the
target's distribution."""

import dataclasses
import warnings

import pytest
import torch
from syncs import SyncCounter
from test_batched import RAGGED, left_padded
from test_drafting import context, reference_tree, tree_paths
from test_sampling import ALPHA, TEMPERATURE, TOP_K, exact_joint, goodness_of_fit, sample_counts
from tiny_models import PROMPTS, make_drafter, make_target, trained_pair
from torch.utils._python_dispatch import TorchDispatchMode

import hf_eagle31  # noqa: F401
from hf_eagle31.drafting import DrafterState, DraftTree, draft_tree
from hf_eagle31.tuning import drafted_levels

FIELDS = ("tokens", "parents", "depths", "ranks")


def drafted(drafter, rows, static: bool, **shape) -> tuple[list[DraftTree], int]:
    """Each row's tree from its context (`rows`: `context(...)` per row), and the drafter forwards it took."""
    state, calls = DrafterState(drafter, len(rows)), []
    for b, (features, tokens, _) in enumerate(rows):
        state.push(features, tokens, b)
    roots = torch.cat([root[0] for _, _, root in rows])
    hook = drafter.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        return draft_tree(state, roots, static=static, **shape), len(calls)
    finally:
        hook.remove()


def walked_ancestors(parents: list[int]) -> torch.Tensor:
    """The ancestor mask the obvious way: from each node, follow its parents up to the root."""
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node in range(len(parents)):
        walk = node
        while walk >= 0:
            mask[node, walk] = True
            walk = parents[walk]
    return mask


@pytest.mark.parametrize("top_k, total, depth, batch", [(3, 12, 4, 1), (6, 4, 4, 1), (3, 2, 6, 1), (1, 5, 5, 1),
                                                       (4, 9, 5, 3), (1, 3, 4, 2)])
def test_a_static_draft_keeps_the_narrowed_drafts_tree(top_k, total, depth, batch):
    """Same tree (nodes, parents, depths, score ranks, the levels tuning reads off it), the reference's; ancestors
    built on the device equal those read from the parents. A random drafter is unsure, so the narrowed draft stops
    early where the static one drafts every level."""
    target = make_target("llama")
    drafter = make_drafter(target, eagle31=True, draft_vocab_size=200)
    drafter.d2t[:] = 56
    rows = [context(target, drafter, PROMPTS[i : i + 1, : 6 - i]) for i in range(batch)]  # ragged catch-ups
    shape = dict(depth=depth, top_k=top_k, total_tokens=total)
    narrowed, narrowed_forwards = drafted(drafter, rows, False, **shape)
    static, static_forwards = drafted(drafter, rows, True, **shape)
    assert static_forwards == depth  # the catch-up, then every level
    for b, (one, other) in enumerate(zip(narrowed, static)):
        for name in FIELDS:
            assert torch.equal(getattr(one, name), getattr(other, name)), (b, name)
        levels = one.frontier_ranks.shape[0]  # where the narrowed draft stopped, the static one records on
        assert torch.equal(one.frontier_ranks, other.frontier_ranks[:levels])
        assert drafted_levels(one.frontier_ranks.tolist(), total, depth) == \
            drafted_levels(other.frontier_ranks.tolist(), total, depth)
        assert torch.equal(other.ancestor_mask(), walked_ancestors(other.parents.tolist()))
        features, tokens, _ = rows[b]
        expected = {tuple(t + 56 for t in path) for path in reference_tree(drafter, features, tokens, depth, top_k,
                                                                          total)}
        assert tree_paths(other, drafter) == expected
    if (top_k, total, depth) == (3, 2, 6):
        assert narrowed_forwards < static_forwards  # the narrowed draft stopped early: the comparison meant something


@pytest.fixture
def cuda_rotary(monkeypatch):
    """The drafter's rotary embedding as CUDA computes it: a CPU reads the largest position back to size a table of
    cos/sin rows (`rotary_at`), which a CUDA drafter never does."""
    from hf_eagle31.modeling import Eagle3DraftModel

    monkeypatch.setattr(Eagle3DraftModel, "rotary_at", lambda self, like, positions: self.rotary_emb(like, positions))


@pytest.mark.parametrize("batch", [1, 2])
def test_a_static_draft_waits_for_the_device_nowhere(cuda_rotary, batch):
    """No value read back, no data-dependent shape, no blocking copy from the catch-up to the tree's last field;
    the narrowed draft reads each level's width back (the counter can fail)."""
    target = make_target("llama")
    drafter = make_drafter(target, eagle31=True, draft_vocab_size=200)
    rows = [context(target, drafter, PROMPTS[i : i + 1, : 6 - i]) for i in range(batch)]  # ragged for a batch
    counts = {}
    for static in (False, True):
        state = DrafterState(drafter, batch)
        for b, (features, tokens, _) in enumerate(rows):
            state.push(features, tokens, b)
        roots = torch.cat([root[0] for _, _, root in rows])
        with SyncCounter() as syncs:
            draft_tree(state, roots, depth=5, top_k=4, total_tokens=12, static=static)
        counts[static] = syncs.calls
    assert counts[True] == []
    assert counts[False]  # the narrowed draft reads a width back once its pool is full: the counter can fail


@pytest.mark.parametrize("draft_mode", ["static", "narrowed"])
def test_a_static_step_reads_nothing_back_until_its_verify_forward(cuda_rotary, monkeypatch, draft_mode):
    """From a step's first drafting op to its verify forward's call, alone and in a ragged batch with holes, the host
    never waits for the device: the verify forward is queued behind the draft. (The walk then reads the logits.)"""
    from hf_eagle31.decoding import EagleLoop

    windows, draft, verify = [], EagleLoop.draft, EagleLoop.verify

    def counted_draft(self):
        self.syncs = SyncCounter().__enter__()
        return draft(self)

    def counted_verify(self, trees):
        prepared = self.prepared
        forward = prepared.verify

        def first(*args, **kwargs):
            if self.syncs is not None:
                self.syncs.__exit__(None, None, None)
                windows.append(self.syncs.calls)
                self.syncs = None
            return forward(*args, **kwargs)

        self.prepared = dataclasses.replace(prepared, verify=first)  # a frozen plan: this loop's copy
        try:
            return verify(self, trees)
        finally:
            self.prepared = prepared

    monkeypatch.setattr(EagleLoop, "draft", counted_draft)
    monkeypatch.setattr(EagleLoop, "verify", counted_verify)
    target, drafter = trained_pair("llama", True, speculation_mode="tree", draft_mode=draft_mode, cpu_backend=False,
                                   collapse_fallback=False, dynamic_speculation=False)
    target.generate(PROMPTS[0:1], do_sample=False, max_new_tokens=24, assistant_model=drafter)
    target.generate(**left_padded(RAGGED[:4]), do_sample=False, pad_token_id=0, max_new_tokens=16,
                    assistant_model=drafter)
    assert len(windows) > 8
    if draft_mode == "static":
        assert all(calls == [] for calls in windows), [calls for calls in windows if calls][:3]
    else:
        assert sum(map(len, windows)) > len(windows)  # narrowing reads widths back: the counter can fail


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("verify_mode", ["batched", "exact"])
def test_static_drafting_equals_plain_greedy(mode, verify_mode):
    target, drafter = trained_pair("llama", True, speculation_mode=mode, verify_mode=verify_mode, draft_mode="static",
                                   collapse_fallback=False)
    deepest = 0
    for prompt in (PROMPTS[0:1], PROMPTS[3:4], PROMPTS[0:1, :3], torch.cat([PROMPTS[1:2], PROMPTS[4:5]], dim=1)):
        for max_new_tokens in (1, 7, 40):
            expected = target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens)
            out = target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, assistant_model=drafter)
            assert torch.equal(out, expected), (prompt.tolist(), max_new_tokens)
            deepest = max(deepest, sum(a > 0 for a in drafter.speculation_stats.accepted))
    assert deepest >= 2, "no multi-token path was accepted: the sweep tested nothing"


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_static_drafting_equals_plain_greedy_on_a_static_cache_and_for_a_ragged_batch(mode):
    target, drafter = trained_pair("llama", True, speculation_mode=mode, draft_mode="static", collapse_fallback=False)
    expected = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=40)
    got = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=40, assistant_model=drafter,
                          cache_implementation="static")
    assert torch.equal(got, expected)
    batch = left_padded(RAGGED)
    expected = target.generate(**batch, do_sample=False, pad_token_id=0, max_new_tokens=24)
    got = target.generate(**batch, do_sample=False, pad_token_id=0, max_new_tokens=24, assistant_model=drafter)
    assert torch.equal(got, expected)


def test_static_drafting_samples_the_targets_distribution():
    """A tree drafted static, sampled: the chi-square test of test_sampling on the same prompt."""
    target, drafter = trained_pair("llama", True, speculation_mode="tree", draft_mode="static", collapse_fallback=False)
    prompt = PROMPTS[0:1]
    (counts,), accepted = sample_counts(target, drafter, {"input_ids": prompt}, TEMPERATURE, TOP_K)
    assert accepted > 100, "draft tokens were rarely accepted: the acceptance path went untested"
    assert goodness_of_fit(counts, exact_joint(target, prompt, TEMPERATURE, TOP_K)) > ALPHA
    assert goodness_of_fit(counts, exact_joint(target, prompt, TEMPERATURE * 1.25, TOP_K)) < ALPHA  # it can fail


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


def _refresh(recorded, fresh) -> None:
    """Write a replayed op's result into the tensor the capture produced (later ops read that one); a result that
    aliases its inputs (a view, an in-place op) is already up to date."""
    if isinstance(recorded, torch.Tensor):
        if recorded.untyped_storage().data_ptr() != fresh.untyped_storage().data_ptr():
            recorded.copy_(fresh)
    elif isinstance(recorded, (tuple, list)):
        for one, other in zip(recorded, fresh):
            _refresh(one, other)


class CpuGraphs:
    """A CUDA graph's contract on a CPU, for `DrafterState.replay`: a capture records the ops a draft ran; a replay
    runs those ops again on the very tensors they read and wrote, after copying the inputs into the captured ones.
    A draft that read a Python value from the state, or a state buffer that was replaced instead of updated in
    place, replays stale here as it would on CUDA."""

    def __init__(self):
        self.graphs, self.captures, self.replays = {}, 0, 0

    def __call__(self, draft, key, inputs):
        if key not in self.graphs:
            static = tuple(value.clone() for value in inputs)
            with Recorder() as recorder:
                outputs = draft(*static)
            self.graphs[key], self.captures = (recorder.ops, static, outputs), self.captures + 1
        ops, static, outputs = self.graphs[key]
        for buffer, value in zip(static, inputs):
            buffer.copy_(value)
        for func, args, kwargs, out in ops:
            _refresh(out, func(*args, **kwargs))
        self.replays += 1
        return tuple(None if out is None else out.clone() for out in outputs)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_a_replayed_static_draft_equals_plain_greedy(monkeypatch, mode):
    """Decoding with every static draft replayed as captured (`CpuGraphs`), alone, in a ragged batch whose rows
    leave (the buffers are replaced: captured anew) and with the depth moving (one capture per shape)."""
    from hf_eagle31.backends import DefaultBackend
    from hf_eagle31.backends.cpu import CpuBackend

    replays = []
    for backend in (DefaultBackend, CpuBackend):
        monkeypatch.setattr(backend, "draft_replay", lambda self, drafter: replays.append(CpuGraphs()) or replays[-1])
    target, drafter = trained_pair("llama", True, speculation_mode=mode, draft_mode="static", collapse_fallback=False)
    for prompt in (PROMPTS[0:1], PROMPTS[3:4], torch.cat([PROMPTS[1:2], PROMPTS[4:5]], dim=1)):
        expected = target.generate(prompt, do_sample=False, max_new_tokens=40)
        assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=40, assistant_model=drafter),
                           expected)
    batch = left_padded(RAGGED)
    expected = target.generate(**batch, do_sample=False, pad_token_id=0, max_new_tokens=24)
    got = target.generate(**batch, do_sample=False, pad_token_id=0, max_new_tokens=24, assistant_model=drafter)
    assert torch.equal(got, expected)
    assert sum(r.replays for r in replays) > 2 * sum(r.captures for r in replays) > 0


@pytest.mark.parametrize("faster", ["static", "narrowed"])
def test_tuning_times_both_drafting_modes_where_drafts_replay_and_keeps_the_faster(monkeypatch, faster):
    """Where the backend replays static drafts (CUDA graphs; `CpuGraphs` here), tuning times each draft both ways,
    prices a static draft at every level, and stores the mode of the fastest candidate; decoding follows it."""
    from hf_eagle31.backends import DefaultBackend
    from hf_eagle31.backends.cpu import CpuBackend
    from hf_eagle31.tuning import apply_choice, measure

    replays = []
    for backend in (DefaultBackend, CpuBackend):
        monkeypatch.setattr(backend, "draft_replay", lambda self, drafter: replays.append(CpuGraphs()) or replays[-1])
    measured = measure.draft_cost

    def draft_cost(*args, static=False, **kwargs):  # the real drafts, one mode made 20x slower
        return measured(*args, static=static, **kwargs) * (20.0 if static == (faster == "narrowed") else 1.0)

    monkeypatch.setattr(measure, "draft_cost", draft_cost)
    monkeypatch.setattr(measure, "packing_cost", lambda *_: 0.0)
    target, drafter = trained_pair("llama", True, collapse_fallback=False)
    report = measure.choose_tree_shape(target, drafter, {3: [[0, 1], [0], [0, 1, 2]] * 3}, max_depth=3, max_tokens=4,
                                       context=32)
    assert {candidate["draft_mode"] for candidate in report.candidates} == {faster}  # the chosen path's
    assert {key.split(", ")[1] for key in report.paths} == {"static", "narrowed"}
    apply_choice(drafter, report)
    assert drafter.generation_config.draft_mode == faster
    replays.clear()
    expected = target.generate(PROMPTS[0:1], do_sample=False, max_new_tokens=8)
    assert torch.equal(target.generate(PROMPTS[0:1], do_sample=False, max_new_tokens=8, assistant_model=drafter),
                       expected)
    assert (sum(replay.replays for replay in replays) > 0) is (faster == "static")


def test_a_draft_cuda_cannot_capture_is_drafted_eagerly_after_one_warning(monkeypatch):
    from hf_eagle31.backends.graphs import GraphReplay

    def refuse(self, draft, inputs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(GraphReplay, "capture", refuse)
    replay = GraphReplay()
    with pytest.warns(UserWarning, match="could not be captured as a CUDA graph .operation not permitted"):
        (out,) = replay(lambda x: (x + 1,), (0, 3), (torch.zeros(2),))
    assert out.tolist() == [1.0, 1.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert replay(lambda x: (x + 2,), (0, 4), (torch.zeros(2),))[0].tolist() == [2.0, 2.0]
