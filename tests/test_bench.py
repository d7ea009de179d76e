"""The benchmark runner and the hardware-aware tuning, on a tiny pair."""

import json
import time
from pathlib import Path

import pytest
import torch
from tiny_models import PROMPTS, make_target, trained_pair

from hf_eagle31.backends.cpu import lean as llama_verify
from hf_eagle31.backends.cpu.products import can_pack
from hf_eagle31.bench.report import write_results
from hf_eagle31.bench.runner import Method, run_all
from hf_eagle31.tuning import apply_choice, choose_tree_shape, projected_tau, verify_cost_curve


def test_projected_tau_predicts_what_a_smaller_tree_actually_does():
    target, drafter = trained_pair("llama", True, dynamic_speculation=False, collapse_fallback=False,
                                   tree_depth=5, tree_total_tokens=40)
    target.generate(PROMPTS[0:1], do_sample=False, max_new_tokens=40, assistant_model=drafter)
    predicted = projected_tau(drafter.speculation_stats.accepted_ranks, total_tokens=40, depth=5)
    assert predicted == pytest.approx(drafter.speculation_stats.tau)


def test_a_sampled_calibration_records_the_ranks_the_walk_accepted():
    """Sampling, the walk accepts the target's own sample where a child carries it: the ranks calibration
    records re-score the run it came from exactly, as greedy ones do."""
    from hf_eagle31.tuning import calibrate

    target, drafter = trained_pair("llama", True)
    ranks, frontier = calibrate(target, drafter, [PROMPTS[0:1]], 40, top_k=4, depth=5, total_tokens=40,
                                temperature=1.0)
    stats = drafter.speculation_stats
    assert ranks == stats.accepted_ranks and len(ranks) < 40  # some steps accepted drafts
    assert frontier == stats.frontier_ranks and len(frontier) == len(ranks)
    assert projected_tau(ranks, total_tokens=40, depth=5) == pytest.approx(stats.tau)
    greedy, _ = calibrate(target, drafter, [PROMPTS[0:1]], 40, top_k=4, depth=5, total_tokens=40)
    assert greedy != ranks


def test_tree_shape_choice_and_verify_curve():
    target, drafter = trained_pair("llama", True)
    curve = verify_cost_curve(target, [1, 4, 16], drafter.config.target_layer_ids, context=32, repeats=2)
    assert set(curve) == {1, 4, 16} and all(t > 0 for t in curve.values())
    ranks = {1: [[0, 1], [0], [0, 1, 2]] * 3, 4: [[0, 1, 2], [0, 1], [0, 3, 4, 5]] * 3}
    report = choose_tree_shape(target, drafter, ranks, max_depth=3, max_tokens=8, context=32)
    best = max(report.candidates, key=lambda c: c["speedup"])
    assert report.choice == best and 1 <= best["tree_depth"] <= 3 and best["tree_total_tokens"] <= 8
    chains = [c for c in report.candidates if c["tree_top_k"] == 1]
    assert {c["tree_depth"] for c in chains} == {1, 2, 3} and all(c["tree_total_tokens"] == c["tree_depth"] for c in chains)
    assert report.best(chain=True) == max(chains, key=lambda c: c["speedup"])
    assert report.as_dict()["verify_cost_ratio"][1] == 1.0
    apply_choice(drafter, report)
    settings = drafter.generation_config
    assert settings.num_assistant_tokens == report.best(chain=True)["tree_depth"]
    assert settings.tree_top_k == 4 and settings.tree_total_tokens == report.best(chain=False)["tree_total_tokens"]
    assert settings.speculation_mode == ("chain" if report.choice["tree_top_k"] == 1 else "tree")


def test_benchmark_runs_every_method_on_the_same_prompts(tmp_path, monkeypatch):
    target, drafter = trained_pair("llama", True)
    lean_forwards = []  # the bench times the verify forward decoding runs (on a CPU the lean one), counting it
    lean_forward = llama_verify.llama_verify_forward

    def counted_lean_forward(model, *args):
        lean_forwards.append(bool(model.lm_head._forward_pre_hooks))  # while the bench counts forwards
        return lean_forward(model, *args)

    monkeypatch.setattr(llama_verify, "llama_verify_forward", counted_lean_forward)
    prompts = [PROMPTS[i : i + 1] for i in range(2)]
    methods = [
        Method("target alone"),
        Method("prompt lookup", {"prompt_lookup_num_tokens": 3}),
        Method("EAGLE 3.1 chain", {"assistant_model": drafter}, {"speculation_mode": "chain"}),
        Method("EAGLE 3.1 tree", {"assistant_model": drafter}, {"speculation_mode": "tree"}),
    ]
    results = run_all(target, prompts, methods, max_new_tokens=24, progress=False)
    assert [r.name for r in results] == [m.name for m in methods]
    assert results[0].speedup == 1.0 and results[0].tau(len(prompts)) == pytest.approx(1.0)
    assert all(r.identical_to_target and r.identical_prompts == len(prompts) for r in results[1:])
    assert results[0].identical_prompts is None and all(r.new_tokens == 2 * 24 for r in results)
    assert results[0].step_seconds is None and 0 < results[3].step_seconds < results[3].seconds  # the loop's part
    assert results[3].tau(len(prompts)) > 1.5 and results[3].acceptance_per_depth[0] > 0.5
    # every drafted step is a target forward, the lean verify forward's (backends/cpu/lean.py) included
    assert all(r.target_forwards >= r.reached[0] + len(prompts) for r in results[2:])
    assert any(lean_forwards) or not can_pack(target)
    payload = write_results(tmp_path, results, len(prompts), {"date": "today"}, {})
    assert json.loads((tmp_path / "results.json").read_text())["methods"][3]["name"] == "EAGLE 3.1 tree"
    assert "| EAGLE 3.1 tree |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "speed.png").stat().st_size > 0 and payload["methods"][0]["speedup"] == 1.0


def test_headline_ratios_and_deep_acceptance_by_hand():
    from hf_eagle31.bench.report import headline, markdown_table, roofline_text
    from hf_eagle31.bench.roofline import Roofline
    from hf_eagle31.bench.runner import MethodResult, combine

    def result(name, tokens, seconds, forwards, reached=(), accepted=()):
        return MethodResult(name, tokens, seconds, forwards, None, True, list(reached), list(accepted),
                            first_token_seconds=0.5)  # the two prompts' first tokens

    results = [
        result("target alone", 102, 10.0, 102),
        result("target alone, fast decoding", 102, 8.0, 102),
        result("assisted (small LM)", 102, 8.0, 60),
        result("prompt lookup", 102, 5.0, 70),
        result("EAGLE-3 tree", 102, 4.0, 42, reached=[40, 30, 20, 10, 6, 2], accepted=[30, 20, 10, 6, 2, 0]),
        result("EAGLE 3.1 tree", 102, 2.0, 22, reached=[20, 18, 16, 14, 12, 10], accepted=[18, 16, 14, 12, 10, 8]),
    ]
    results = combine([results])  # the speedups, over the faster plain decoding (fast decoding: 12.75 tokens/s)
    assert results[5].acceptance_from(5) == pytest.approx((10 + 8) / (12 + 10))
    assert results[5].acceptance_from(7) is None
    lines = headline(results, prompts=2)
    assert lines[:3] == ["EAGLE 3.1 tree: speedup over the best plain decoding (target alone, fast decoding): 4.00x "
                         "(5.00x over target alone at default settings)",
                         "EAGLE 3.1 tree vs assisted (small LM): 4.00x tokens/s",
                         "EAGLE 3.1 tree vs prompt lookup: 2.50x tokens/s"]
    # tau = (new tokens - prompts) / (forwards - prompts): 100 / 20 = 5.00 and 100 / 40 = 2.50
    assert lines[3] == "EAGLE 3.1 vs EAGLE-3, tree: tau 5.00 vs 2.50 (2.00x), acceptance at depth >= 5: 0.82 vs 0.25"
    # two forwards more and tau is 100 / 42 = 2.38, under the speedup of 4.00: the plain baseline is handicapped
    results[5].target_forwards = 44
    floor = Roofline(bandwidth=5.1e9, step_bytes=100_000_000, dtype="float32")  # 51 tokens/s
    assert headline(results, prompts=2, roofline=floor)[0] == (
        "EAGLE 3.1 tree: WARNING: speedup over the best plain decoding (target alone, fast decoding): 4.00x exceeds "
        "tau 2.38: the plain baseline runs below the memory's rate (26% of the floor rate), so this is not a result "
        "(5.00x over target alone at default settings)")  # after the first tokens: 100 tokens in 7.5 s, 13.3 / 51
    # after the first token: 100 tokens in 1.5 s (66.7 tokens/s, 1.31 floor rates), in 9.5 s (10.5, 0.21)
    assert "| EAGLE 3.1 tree | 51.0 | 66.7 | 1.31 | 4.00x | 5.00x | 2.38 |" in markdown_table(results, 2, roofline=floor)
    assert "| target alone | 10.2 | 10.5 | 0.21 | 0.80x |" in markdown_table(results, 2, roofline=floor)
    assert "| target alone | 10.2 | 0.80x |" in markdown_table(results, 2)  # no roofline, no column
    # a method judged against the bandwidth probed around its own calls: half the run's fastest, twice the share
    results[0].bandwidth = 2.55e9
    assert "| target alone | 10.2 | 10.5 | 0.41 | 0.80x |" in markdown_table(results, 2, roofline=floor)
    assert "target alone 2.5" in roofline_text(floor, None, results)


def test_each_method_gets_the_faster_bandwidth_probed_right_before_and_after_its_calls():
    """A shared host's read bandwidth moves between levels for tens of seconds at a time: a method that ran in a slow
    spell was judged against a floor probed in a fast one."""
    from hf_eagle31.bench.runner import combine

    target = make_target()
    probes = iter([30e9, 50e9, 45e9, 20e9])  # around the first method's calls, then the second's
    results = run_all(target, [PROMPTS[:1]], [Method("target alone"), Method("target alone, again")],
                      max_new_tokens=4, progress=False, probe=lambda: next(probes))
    assert [r.bandwidth for r in results] == [50e9, 45e9]
    assert [r.bandwidth for r in combine([results, results])] == [50e9, 45e9]
    assert run_all(target, [PROMPTS[:1]], [Method("target alone")], max_new_tokens=4, progress=False)[0].bandwidth \
        is None


def test_drift_study_writes_its_table_and_plot(tmp_path):
    from types import SimpleNamespace

    from tiny_models import make_tokenizer

    from hf_eagle31.bench.drift import DEPTH, run_drift_study

    target, eagle3 = trained_pair("llama", False)
    _, eagle31 = trained_pair("llama", True)
    tokenizer = make_tokenizer()
    texts = [tokenizer.decode(PROMPTS[i]) for i in range(3)] * 8
    args = SimpleNamespace(max_new_tokens=12, out=str(tmp_path))
    meta = {"command": "hf-eagle31 bench --drift"}
    assert run_drift_study(target, tokenizer, {"EAGLE-3": eagle3, "EAGLE 3.1": eagle31}, texts, args, meta=meta) == 0
    written = json.loads((tmp_path / "drift.json").read_text())
    assert written["command"] == meta["command"]
    results = written["drafters"]
    for name in ("EAGLE-3", "EAGLE 3.1"):
        assert len(results[name]["acceptance"]["acceptance"]) == DEPTH
        assert len(results[name]["mechanism"]["sink_attention"]) == DEPTH
        assert all(0.0 <= m <= 1.0 for m in results[name]["mechanism"]["sink_attention"])
        assert results[name]["context_length"]
    assert (tmp_path / "drift.png").stat().st_size > 0 and "acceptance at depth 10" in (tmp_path / "drift.md").read_text()


def test_tune_drafter_calibrates_without_leaving_its_settings_behind():
    from hf_eagle31.tuning import tune_drafter

    target, drafter = trained_pair("llama", True, dynamic_speculation=True, collapse_fallback=True)
    report = tune_drafter(target, drafter, [PROMPTS[0:1]], max_new_tokens=16, top_ks=(1, 3), max_depth=3, max_tokens=8)
    assert set(report.calibration_ranks) == {1, 3} and report.calibration_ranks[1]
    settings = drafter.generation_config
    assert settings.collapse_fallback  # calibration held it off, then restored it
    assert not settings.dynamic_speculation  # the tuned shape is kept fixed
    assert settings.tree_top_k == 3 and settings.num_assistant_tokens == report.best(chain=True)["tree_depth"]


def test_tuning_calibrates_a_shape_for_sampling_beside_the_greedy_ones(tmp_path):
    from hf_eagle31.tuning import tune_drafter, tune_sampling

    target, drafter = trained_pair("llama", True)
    report = tune_drafter(target, drafter, [PROMPTS[0:1]], max_new_tokens=16, top_ks=(1, 3), max_depth=3, max_tokens=8,
                          batch_sizes=(), sampling_temperature=0.7)
    sampling = report.sampling
    assert sampling["temperature"] == 0.7 and set(sampling["calibration_ranks"]) == {1, 3}
    assert sampling["calibration_ranks"] != report.calibration_ranks  # calibrated again, sampling
    shape = drafter.generation_config.sampling_shape
    assert shape == sampling["shape"] == {**max(sampling["candidates"], key=lambda c: c["speedup"]), "temperature": 0.7}
    greedy = {name: getattr(drafter.generation_config, name) for name in ("speculation_mode", "tree_total_tokens")}
    saved = json.loads(json.dumps(report.as_dict(), default=str))  # as tuning.json holds it: string keys
    drafter.generation_config.sampling_shape = None
    again = tune_sampling(target, drafter, saved, [PROMPTS[0:1]], max_new_tokens=16, temperature=1.0)
    assert again["choice"] == saved["choice"] and again["sampling"]["temperature"] == 1.0
    assert set(again["sampling"]["calibration_ranks"]) == {1, 3}
    assert drafter.generation_config.sampling_shape == again["sampling"]["shape"]
    assert greedy == {name: getattr(drafter.generation_config, name) for name in greedy}  # greedy shapes kept


def test_tuning_times_each_draft_tree_after_an_untimed_target_forward(monkeypatch):
    """Decoding drafts each tree after a verify forward has streamed the target's weights through the caches, so
    tuning times its trees after a target forward too (`target_step`), and leaves that forward out of the time."""
    from hf_eagle31.tuning import measure

    target, drafter = trained_pair("llama", True)
    events, calls = [], []
    draft_tree, draft_cost = measure.draft_tree, measure.draft_cost
    monkeypatch.setattr(measure, "draft_tree", lambda *a, **k: events.append("tree") or draft_tree(*a, **k))
    monkeypatch.setattr(measure, "draft_cost", lambda *a, **k: calls.append(1) or draft_cost(*a, **k))
    monkeypatch.setattr(measure, "TUNING_ROUNDS", 1)
    monkeypatch.setattr(measure, "verify_paths", lambda *_: (False,))
    hook = target.register_forward_pre_hook(lambda *_: events.append("target") or time.sleep(0.05))
    try:  # the pair is cached: a hook left on its target would keep later tests off the lean forward
        report = choose_tree_shape(target, drafter, {1: [[0, 1], [0]] * 3}, max_depth=2, max_tokens=4, context=32)
    finally:
        hook.remove()
    trees = [i for i, event in enumerate(events) if event == "tree"]
    assert len(calls) == 2 and len(trees) == 2 * 6  # per call a warm-up tree, then 5 timed ones
    assert all(events[i - 1] == "target" for number, i in enumerate(trees) if number % 6)
    assert 0 < max(t for per_depth in report.draft_seconds.values() for t in per_depth.values()) < 0.05


def test_tuning_prices_each_size_at_its_median_over_passes_never_below_a_smaller_one(monkeypatch):
    """A shared CPU runs fast or slow for a minute: one pass's fast minute at one size must not price that size
    below a smaller one (on the Xeon a best over passes priced 13 tokens under 12, and a 12-deep tree was chosen on
    it), so each cost is its median over the passes, raised to the highest cost of the sizes below it."""
    from hf_eagle31.tuning import measure

    target, drafter = trained_pair("llama", True)
    passes = iter([{1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4},  # 4 tokens: median 1.0, raised to 3 tokens' 1.25
                   {1: 1.0, 2: 1.2, 3: 1.25, 4: 0.8, 5: 1.5},
                   {1: 1.1, 2: 1.1, 3: 1.3, 4: 1.0, 5: 1.45}])
    drafts = iter([0.3, 0.2, 0.1, 0.5, 0.25, 0.1])  # depths 1 and 2 in each pass (one width: a chain family)
    monkeypatch.setattr(measure, "verify_cost_curve", lambda *_, **__: next(passes))
    monkeypatch.setattr(measure, "draft_cost", lambda *_, **__: next(drafts))
    monkeypatch.setattr(measure, "verify_paths", lambda *_: (False,))
    report = choose_tree_shape(target, drafter, {1: [[0, 1], [0]] * 3}, max_depth=2, max_tokens=4, context=32)
    assert report.verify_curve == {1: 1.0, 2: 1.1, 3: 1.25, 4: 1.25, 5: 1.45}
    assert report.draft_seconds == {1: {1: 0.25, 2: 0.25}} and report.plain_seconds == 1.0


@pytest.mark.skipif(not can_pack(make_target()), reason="oneDNN packed linears need a CPU build with mkldnn")
@pytest.mark.parametrize("slow", ["cpu backend", "default"])
def test_tuning_stores_the_verify_path_measured_faster(monkeypatch, slow):
    """The CPU backend pays on one CPU and not on another: tuning times both paths and keeps the faster one's
    shapes and its `cpu_backend`, which decoding then follows."""
    from hf_eagle31.tuning import measure

    target, drafter = trained_pair("llama", True)
    measured = measure.verify_cost_curve

    base: dict[int, float] = {}

    def curve(target, sizes, layer_ids, cpu_backend=False, **kwargs):  # one real curve for both paths, one 3x slower
        if missing := [n for n in sizes if n not in base]:
            base.update(measured(target, missing, layer_ids, cpu_backend=False, **kwargs))
        return {n: base[n] * (3.0 if cpu_backend == (slow == "cpu backend") else 1.0) for n in sizes}

    monkeypatch.setattr(measure, "verify_cost_curve", curve)
    monkeypatch.setattr(measure, "packing_cost", lambda *_: 0.0)
    ranks = {1: [[0, 1], [0], [0, 1, 2]] * 3}
    report = choose_tree_shape(target, drafter, ranks, max_depth=3, max_tokens=4, context=32)
    assert report.cpu_backend is (slow == "default") and set(report.paths) == {"cpu backend", "default"}
    assert report.choice == report.paths["cpu backend" if report.cpu_backend else "default"]
    apply_choice(drafter, report)
    assert drafter.generation_config.cpu_backend is (slow == "default")
    from hf_eagle31.backends.cpu import products

    packed, made = [], products.Products.__init__
    monkeypatch.setattr(products.Products, "__init__", lambda self, model, **kw: packed.append(model) or made(self, model, **kw))
    target.generate(PROMPTS[0:1], do_sample=False, max_new_tokens=4, assistant_model=drafter)
    assert (target in packed) is (slow == "default")


def test_projection_to_a_real_shape_measures_and_extrapolates():
    from transformers import LlamaConfig

    from hf_eagle31.bench.projection import measure_costs, project

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2)
    costs = measure_costs(config, [1, 2, 4], [1, 2], top_ks=(1, 3), draft_vocab_size=128, context=16,
                          dtype=torch.float32)
    assert costs["probe_layers"] == [1, 3] and costs["extrapolated_to"] == 8
    assert all(t > 0 for t in costs["verify_seconds"].values()) and set(costs["draft_seconds"]) == {1, 3}
    result = project(costs, {1: [[0, 1], [0]], 3: [[0, 1], [2]]})
    assert result["verify_cost_ratio"][1] == 1.0 and result["best"]["speedup"] > 0


def test_datasets_combine_and_the_bound_by_hand():
    from hf_eagle31.bench.report import bound, markdown_table
    from hf_eagle31.bench.runner import MethodResult, combine

    shape = {"speculation_mode": "chain", "num_assistant_tokens": 3, "tree_top_k": 10, "tree_depth": 6,
             "tree_total_tokens": 60}
    a = [MethodResult("target alone", 22, 2.0, 22, 10, True, first_token_seconds=0.5),
         MethodResult("EAGLE 3.1 chain", 22, 1.0, 9, 30, True, [8, 6], [6, 3], shape, identical_prompts=1,
                      step_seconds=0.75)]
    b = [MethodResult("target alone", 42, 4.0, 42, 20, True, first_token_seconds=1.0),
         MethodResult("EAGLE 3.1 chain", 42, 1.0, 12, 5, False, [10], [9], shape, identical_prompts=0,
                      step_seconds=0.5)]
    overall = combine([a, b])
    # after each prompt's first token: (64 - 2) tokens in 6 s less the 1.5 s of the first tokens
    assert overall[0].decode_tokens_per_second(2) == pytest.approx(62 / 4.5)
    assert overall[1].decode_tokens_per_second(2) is None  # first tokens not timed
    assert [r.new_tokens for r in overall] == [64, 64] and overall[1].target_forwards == 21
    assert overall[1].reached == [18, 6] and overall[1].accepted == [15, 3]
    assert overall[1].peak_memory_bytes == 30 and overall[1].identical_to_target is False
    assert overall[1].identical_prompts == 1 and overall[0].identical_prompts is None  # a part without counts
    assert "| **NO** (1/2) |" in markdown_table(overall, 2)
    assert overall[1].speedup == pytest.approx((64 / 2.0) / (64 / 6.0))
    # tau over 2 prompts: (64 - 2) / (21 - 2); the matching candidate costs t1 / (t_verify + t_draft) = 0.5
    tuning = {"EAGLE 3.1": {"candidates": [{"tree_top_k": 1, "tree_depth": 3, "tree_total_tokens": 3, "tau": 2.0,
                                            "speedup": 1.0}]}}
    assert bound(overall[1], tuning, 2) == pytest.approx(62 / 19 * 0.5)
    assert bound(overall[0], tuning, 2) is None
    # from the run's own costs: 62 tokens in 1.25 s of drafting and verifying, the baseline 64 tokens in 6 s
    assert bound(overall[1], tuning, 2, overall[0]) == pytest.approx(62 / 1.25 / (64 / 6.0))


def test_bench_command_on_the_demo_pair(tmp_path, capsys, monkeypatch):
    from hf_eagle31.bench import verify_cost
    from hf_eagle31.cli import main as cli_main

    # the verify forwards themselves are timed in test_verify_cost_study_...: here a step of 10 ms, and 1 ms a row
    monkeypatch.setattr(verify_cost, "verify_cost_curve", lambda target, sizes, *_, **__: {n: 0.009 + 0.001 * n
                                                                                           for n in sizes})
    out = tmp_path / "bench"
    assert cli_main(["bench", "--pair", "demo", "--num-prompts", "1", "--max-new-tokens", "6", "--no-tune",
                     "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [m["name"] for m in results["methods"]][:4] == ["target alone", "target alone, fast decoding",
                                                          "assisted (small LM)", "prompt lookup"]
    plain = [m for m in results["methods"] if m["name"].startswith("target alone")]
    assert max(m["speedup"] for m in plain) == pytest.approx(1.0)  # speedups are over the faster plain decoding
    assert results["methods"][0]["speedup_default"] == pytest.approx(1.0)
    assert all(m["identical_to_target"] for m in results["methods"][1:])
    # --no-tune: the bound comes from the costs in each drafter's shipped tuning.json
    shipped = json.loads((Path(__file__).parents[1] / "examples/demo_pair/eagle31/tuning.json").read_text())
    assert results["tuning"]["EAGLE 3.1"]["candidates"] == shipped["candidates"]
    assert "shipped" in results["tuning_source"]
    assert any(m["bound"] for m in results["methods"] if m["name"].startswith("EAGLE 3.1"))
    # the roofline, measured in the run: the floor rate from the bandwidth and the target's bytes, each method's
    # tokens/s over it, and the verify cost of 1-16 rows on both paths beside it
    line = results["roofline"]
    assert line["bandwidth_bytes_per_second"] > 0 and line["dtype"] == "float32"
    assert line["floor_tokens_per_second"] == pytest.approx(line["bandwidth_bytes_per_second"] / line["step_bytes"])
    # ... over each method's rate after the first token, its first tokens timed apart (a call for one token each;
    # none where, over 6 tokens, they took as long as the whole calls)
    # at the bandwidth probed around the method's own calls, none faster than the run's fastest
    decoded = [m for m in results["methods"] if m["seconds"] > m["first_token_seconds"] > 0]
    assert decoded and all(m["decode_tokens_per_second"] == pytest.approx((m["new_tokens"] - 1) / (
        m["seconds"] - m["first_token_seconds"])) and m["of_floor"] == pytest.approx(
        m["decode_tokens_per_second"] * line["step_bytes"] / m["bandwidth_bytes_per_second"]) for m in decoded)
    assert all(0 < m["bandwidth_bytes_per_second"] <= line["bandwidth_bytes_per_second"] for m in results["methods"])
    assert {path: list(curve) for path, curve in line["verify_seconds"].items()} == \
        {path: ["1", "2", "3", "4", "6", "8", "12", "16"] for path in ("default", "cpu backend")}
    printed = capsys.readouterr().out
    # the shipped shapes' costs and predictions, said to be measured elsewhere (in results.md too)
    for text in (printed, (out / "results.md").read_text()):
        before, source, after = text.partition("Draft shapes and costs from each drafter's tuning.json")
        assert source and "not in this run" in after.split("\n")[0]
        assert "verify cost t(n)/t(1)" in after and "verify cost t(n)/t(1)" not in before
    assert "**Roofline**: read bandwidth" in printed and "| default | 1.00 | 1.10 | 1.20 | 1.30 | 1.50 |" in printed
    assert f"the floor (a step's weights read once): {line['floor_seconds_per_token'] / 0.01:.2f} t(1)" in printed
    assert "| after the first token | over floor rate |" in (out / "results.md").read_text()
    assert cli_main(["bench", "--pair", "demo", "--prompts", str(tmp_path / "none.jsonl"), "--out", str(out)]) == 2
    assert "none.jsonl does not exist" in capsys.readouterr().err


def test_bench_resumes_a_run_part_by_part(tmp_path, capsys, monkeypatch):
    """A run stopped after its first part (--max-parts) and resumed runs only the second part, and ends with
    the counts of an uninterrupted run; other settings are refused."""
    from hf_eagle31.bench import runner
    from hf_eagle31.cli import main as cli_main

    argv = ["bench", "--pair", "demo", "--num-prompts", "2", "--part-size", "1", "--max-new-tokens", "6", "--no-tune",
            "--eagle3", "", "--assistant", ""]
    assert cli_main(argv + ["--out", str(tmp_path / "straight")]) == 0
    straight = json.loads((tmp_path / "straight" / "results.json").read_text())
    out = tmp_path / "stopped"
    assert cli_main(argv + ["--out", str(out), "--max-parts", "1"]) == 0
    assert [p.name for p in (out / "parts").iterdir()] == ["heldout_prompts_000.json"]
    assert json.loads((out / "results.json").read_text())["prompts"] == {"heldout_prompts": 1}
    calls = []
    real = runner.run_all
    monkeypatch.setattr(runner, "run_all", lambda target, prompts, *a, **k: calls.append(len(prompts)) or real(target, prompts, *a, **k))
    assert cli_main(argv + ["--out", str(out), "--resume"]) == 0
    assert calls == [1]
    resumed = json.loads((out / "results.json").read_text())
    count = lambda run: [(m["name"], m["new_tokens"], m["target_forwards"]) for m in run["methods"]]  # noqa: E731
    assert count(resumed) == count(straight) and resumed["prompts"] == {"heldout_prompts": 2}
    assert cli_main(argv + ["--max-new-tokens", "7", "--out", str(out), "--resume"]) == 2
    assert "other settings" in capsys.readouterr().err


def test_chat_contexts_take_the_longest_opening_that_fits():
    """Each prompt is a conversation cut after a user turn, the longest one within the length; conversations
    with nothing between half the length and the length give none."""
    from tiny_models import make_tokenizer

    from hf_eagle31.bench.drift import chat_contexts

    tokenizer = make_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<s>{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}</s>{% endif %}")
    user, assistant = (lambda text: {"role": "user", "content": text}), (lambda text: {"role": "assistant", "content": text})
    fits = [user("a" * 4), assistant("b" * 6), user("c" * 5), assistant("d" * 9), user("e" * 9)]
    too_long = [user("z" * 30)]  # z merges with nothing: 30 tokens
    too_short = [user("y"), assistant("z" * 40), user("y")]
    rendered = lambda messages: tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),  # noqa: E731
                                          add_special_tokens=False)["input_ids"]
    lengths = [len(rendered(fits[: end + 1])) for end in (0, 2, 4)]
    assert lengths[1] <= 20 < lengths[2] and lengths[1] > 10  # the second user turn is the last that fits in 20
    prompts = chat_contexts(tokenizer, [too_long, fits, too_short], 20)
    assert prompts == [rendered(fits[:3])]


def test_an_assistant_saved_without_its_embedding_takes_the_targets(tmp_path):
    """issue 29, point 8: the SmolLM2 small LM ships without SmolLM2's embedding; assisted generation stays exact."""
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_eagle31.bench.suite import EMBEDDING, load_assistant

    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 tie_word_embeddings=True, initializer_range=0.1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, **shape)).eval()
    small = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, **shape))
    small.set_input_embeddings(target.get_input_embeddings())  # trained on the target's frozen embedding
    small.tie_weights()
    small.save_pretrained(tmp_path / "complete")
    small.save_pretrained(tmp_path / "small", state_dict={k: v for k, v in small.state_dict().items()
                                                          if k not in (EMBEDDING, "lm_head.weight")})
    assert EMBEDDING in set(safe_open(tmp_path / "complete" / "model.safetensors", "pt").keys())
    assert EMBEDDING not in safe_open(tmp_path / "small" / "model.safetensors", "pt").keys()
    loaded = load_assistant(tmp_path / "small", target)
    assert loaded.get_input_embeddings() is target.get_input_embeddings() and loaded.lm_head.weight is \
        target.get_input_embeddings().weight
    reference = load_assistant(tmp_path / "complete", target)  # a complete checkpoint: plain from_pretrained
    assert torch.equal(loaded(PROMPTS).logits, reference(PROMPTS).logits)
    plain = target.generate(PROMPTS[:2], do_sample=False, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=12, assistant_model=loaded),
                       plain[:1])
    with pytest.raises(ValueError, match="takes its input embedding from the target"):
        load_assistant(tmp_path / "small", LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, **{**shape,
                                                                                                 "vocab_size": 300})))


def test_verify_cost_study_measures_both_paths_against_one_plain_step(tmp_path, capsys):
    from hf_eagle31.bench.verify_cost import PATHS, SIZES
    from hf_eagle31.cli import main as cli_main

    out = tmp_path / "verify_cost"
    assert cli_main(["bench", "--pair", "demo", "--eagle3", "", "--assistant", "", "--verify-cost",
                     "--out", str(out)]) == 0
    saved = json.loads((out / "verify_cost_paths.json").read_text())
    assert set(saved["seconds"]) == set(PATHS) and all(len(curve) == len(SIZES) for curve in saved["seconds"].values())
    assert all(0 < split["forward"] <= split["level"] for split in saved["draft_level_seconds"].values())
    assert (out / "verify_cost_paths.png").exists()
    assert "| default | 1.00 |" in capsys.readouterr().out  # every ratio is over the default path's own t(1)


def test_vllm_rounds_compare_each_round_and_take_the_median(tmp_path, capsys):
    """examples/vllm_cpu/compare.py --rounds: each of ours over each of vLLM's within a round (hand-computed), the
    median of those ratios, a run missing from a round left out."""
    import importlib.util

    path = Path(__file__).parents[1] / "examples" / "vllm_cpu" / "compare.py"
    spec = importlib.util.spec_from_file_location("vllm_compare", path)
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    speeds = [{"ours_tree": 60.0, "vllm_eagle": 40.0, "vllm_plain": 30.0},
              {"ours_tree": 66.0, "vllm_eagle": 40.0, "vllm_plain": 20.0},
              {"ours_tree": 50.0, "vllm_eagle": 40.0}]
    folders = []
    for i, runs in enumerate(speeds):
        folder = tmp_path / f"round{i}"
        folder.mkdir()
        for run, tokens_per_s in runs.items():
            (folder / f"{run}.json").write_text(json.dumps({"summary": {"tokens_per_s": tokens_per_s}}))
        folders.append(str(folder))
    compare.rounds(folders)
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["ours_tree", "60.0", "66.0", "50.0", "60.0"] in lines
    assert ["vllm_plain", "30.0", "20.0", "-", "25.0"] in lines
    assert ["ours_tree", "/", "vllm_eagle", "1.50", "1.65", "1.25", "median", "1.50"] in lines  # the mean: 1.47
    assert ["ours_tree", "/", "vllm_plain", "2.00", "3.30", "median", "2.65"] in lines
