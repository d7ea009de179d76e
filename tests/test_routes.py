"""Which implementation multiplies how many rows (hf_eagle31/backends/cpu/routes.py): measured, kept beside the kernel
build, and whichever each row count got, decoding equals plain `generate`."""

import collections
import json

import pytest
import torch
from tiny_models import PROMPTS, make_target, trained_pair

import hf_eagle31
from hf_eagle31.backends.cpu import products as cpu_products
from hf_eagle31.backends.cpu import routes
from hf_eagle31.backends.cpu.products import Products, can_pack
from hf_eagle31.backends.cpu.rows import MAX_ROWS, rows_kernel

COUNTS = len(routes.COUNTS)

pytestmark = pytest.mark.skipif(not can_pack(make_target()), reason="the CPU backend needs a CPU build with mkldnn")


def fake_timer(fast: dict[int, str]):
    """A timer under which `fast[rows]` (else "torch") takes 1 s a product and every other implementation 2 s."""
    def timed(name, x, weight, packed):
        return 1.0 if name == fast.get(x.shape[0], "torch") else 2.0

    return timed


def record_timings(monkeypatch, fast: dict[int, str]) -> dict[str, set[int]]:
    """`fake_timer(fast)` as the routes' timer; returns, per implementation, the row counts it was timed at."""
    timer, timed = fake_timer(fast), collections.defaultdict(set)
    monkeypatch.setattr(routes, "_time", lambda name, x, *args: timed[name].add(x.shape[0]) or timer(name, x, *args))
    return timed


@pytest.fixture
def small_stream(monkeypatch, tmp_path):
    """A fresh cache folder, no routes in memory, and a small stream of weights to time."""
    monkeypatch.setenv("HF_EAGLE31_CACHE", str(tmp_path))
    monkeypatch.setattr(routes, "_ROUTES", {})
    monkeypatch.setattr(routes, "workload", lambda dtype: [(torch.randn(8, 4), None), (torch.randn(4, 8), None)])
    monkeypatch.setattr(routes, "available", lambda dtype: ("rows", "torch"))
    monkeypatch.setattr(routes.rows, "kernel_decided", lambda: True)


def test_the_faster_of_two_timings_serves_each_row_count(monkeypatch, small_stream):
    """One row went to MKL's product on every CPU, a constant tuned on a Xeon: on an AMD EPYC that product streams
    the weights far below the memory's rate."""
    monkeypatch.setattr(routes, "_time", fake_timer({1: "rows", 5: "rows"}))
    chosen = routes.routes(torch.float32)
    assert chosen == ("rows", "torch", "torch", "torch", "rows") + ("torch",) * (COUNTS - 5)
    monkeypatch.setattr(routes, "_ROUTES", {})
    monkeypatch.setattr(routes, "_time", fake_timer({count: "rows" for count in (*range(2, MAX_ROWS + 1), 64)}))
    assert routes.routes(torch.bfloat16) == ("torch",) + ("rows",) * (MAX_ROWS - 1) + ("torch", "rows", "torch",
                                                                                        "torch", "torch")


def test_a_count_past_those_measured_goes_where_the_next_one_measured_goes(monkeypatch):
    """A prefill's products went to torch's product at any length, though on an AMD EPYC the kernel multiplied
    17-128 rows faster (fp32: 1.2-2x)."""
    chosen = ("rows",) * MAX_ROWS + ("torch", "rows", "onednn", "torch", "rows")
    monkeypatch.setattr(routes, "routes", lambda dtype: chosen)
    assert [routes.route(count, torch.float32) for count in (16, 17, 32, 33, 64, 65, 128, 129, 512, 4096)] == [
        "rows", "torch", "torch", "rows", "rows", "onednn", "onednn", "torch", "rows", "rows"]


def test_routes_are_measured_once_and_kept_per_dtype_and_thread_count(monkeypatch, small_stream):
    timed = []
    timer = fake_timer({1: "rows"})
    monkeypatch.setattr(routes, "_time", lambda *args: timed.append(args[0]) or timer(*args))
    first = routes.routes(torch.float32)
    assert timed and first[0] == "rows"
    timed.clear()
    monkeypatch.setattr(routes, "_ROUTES", {})  # another process: reads the file the first one wrote
    assert routes.routes(torch.float32) == first and not timed
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # other threads, other timings: measured for themselves
        assert routes.routes(torch.float32) == first and timed
    finally:
        torch.set_num_threads(threads)


def test_the_memory_measuring_held_goes_back_to_the_system_once_freed(monkeypatch, small_stream):
    """Measuring frees its weights into glibc's heap, which kept them (a bench run that measured counted ~0.7 GB
    more peak memory): the heap is trimmed once a measurement is done, not when a kept file is read."""
    order = []
    timer = fake_timer({1: "rows"})
    monkeypatch.setattr(routes, "_time", lambda *args: order.append("timed") or timer(*args))
    monkeypatch.setattr(routes, "_trim_heap", lambda: order.append("trimmed"))
    routes.routes(torch.float32)
    assert order[-1] == "trimmed" and order.count("trimmed") == 1 and "timed" in order
    order.clear()
    monkeypatch.setattr(routes, "_ROUTES", {})  # another process: reads the file the first one wrote
    routes.routes(torch.float32)
    assert order == []


def test_onednn_serves_only_where_its_copy_pays_over_all_row_counts():
    """A row count measured a little faster on oneDNN's product (or the others slowed by other work meanwhile) made
    every call copy every weight for it."""
    past = COUNTS - MAX_ROWS
    seconds = {"rows": [1.0] * COUNTS, "torch": [3.0] * COUNTS, "onednn": [1.5] * MAX_ROWS + [0.1] * past}
    seconds["onednn"][4] = 0.9  # and fastest past 16 rows: a prefill's products do not make the copy either
    assert routes.choose(seconds) == ("rows",) * COUNTS
    seconds["torch"][0] = 0.5
    assert routes.choose(seconds) == ("torch",) + ("rows",) * (COUNTS - 1)
    seconds["onednn"] = [1.1] * 8 + [0.5] * (COUNTS - 8)  # faster over all: the copy pays, and serves where fastest
    assert routes.choose(seconds) == ("torch",) + ("rows",) * 7 + ("onednn",) * (COUNTS - 8)


def test_onednn_serves_only_where_it_repays_its_copy(monkeypatch):
    """Faster by 1-2% over all row counts, oneDNN's product was chosen on an AMD EPYC, and every call made its copy
    of the weights (0.14 s for SmolLM2 in fp32) to save less than that over its steps."""
    seconds = {"rows": [1.0] * COUNTS, "torch": [3.0] * COUNTS, "onednn": [0.8] * COUNTS}
    assert routes.choose(seconds, copy=0.0) == ("onednn",) * COUNTS
    saved = 0.2 * routes.PAYBACK_STEPS  # what it saves over `PAYBACK_STEPS`
    assert routes.choose(seconds, copy=saved * 1.5) == ("rows",) * COUNTS
    assert routes.choose(seconds, copy=saved / 2) == ("onednn",) * COUNTS
    # `measure` times the copy of the weights it streams (large enough that a copy outlasts any hiccup)
    weights = [torch.randn(1024, 2048), torch.randn(2048, 1024)]
    monkeypatch.setattr(routes, "workload", lambda dtype: [(w, torch.ops.mkldnn._reorder_linear_weight(w, 8))
                                                           for w in weights])
    monkeypatch.setattr(routes, "_time", fake_timer({}))
    assert routes.measure(torch.float32, ("torch",))[1] < routes.measure(torch.float32, ("torch", "onednn"))[1]


@pytest.mark.parametrize("own", ["rows_near", "rows"])
def test_up_to_16_rows_another_product_must_beat_the_kernel_by_more_than_the_timings_noise(own):
    """On an Intel Xeon MKL's one-row fp32 product was timed 1% faster than the kernel and took one row: the step then
    left the rows library's one-call forward, and `fast_decoding` ran half as fast. Up to 16 rows a product off the
    kernel (any of its ways; "rows" alone on the AVX2 kernel) must be faster by more than `OFF_KERNEL_MARGIN`; past
    them, and where it does not run, the fastest serves."""
    close, far = 1 / (1 + routes.OFF_KERNEL_MARGIN / 2), 1 / (1 + routes.OFF_KERNEL_MARGIN * 2)
    seconds = {own: [1.0] * COUNTS, "torch": [close] * MAX_ROWS + [far] * (COUNTS - MAX_ROWS)}
    seconds["torch"][3] = far
    chosen = routes.choose(seconds)
    assert chosen[:MAX_ROWS] == (own,) * 3 + ("torch",) + (own,) * (MAX_ROWS - 4)
    assert chosen[MAX_ROWS:] == ("torch",) * (COUNTS - MAX_ROWS)
    assert routes.choose({"torch": [1.0] * COUNTS, "onednn": [close] * COUNTS}) == ("onednn",) * COUNTS


def test_a_kept_file_without_the_copys_cost_is_measured_again(tmp_path):
    path = tmp_path / "routes.json"
    candidates = ("rows", "rows_near", "torch", "onednn")
    seconds = {name: [1.0] * COUNTS for name in candidates}
    path.write_text(json.dumps({"counts": list(routes.COUNTS), "routes": ["torch"] * COUNTS, "seconds": seconds}))
    assert routes._read(path, candidates) is None
    seconds["torch"] = [0.5] * COUNTS
    path.write_text(json.dumps({"counts": list(routes.COUNTS), "routes": ["torch"] * COUNTS, "seconds": seconds,
                                "copy_seconds": 0.1, "streamed_bytes": routes.streamed_bytes()}))
    assert routes._read(path, candidates) == ("torch",) * COUNTS


def test_kept_timings_are_chosen_from_again_under_todays_rule(tmp_path):
    """A file kept by an earlier release chose MKL's one-row product 1% faster than the kernel (`choose`'s margin
    came later): the timings it keeps are chosen from again, not its choice."""
    path = tmp_path / "routes.json"
    seconds = {"rows_near": [1.0] * COUNTS, "torch": [0.99] + [2.0] * (COUNTS - 1)}
    path.write_text(json.dumps({"counts": list(routes.COUNTS), "routes": ["torch"] + ["rows_near"] * (COUNTS - 1),
                                "seconds": seconds, "copy_seconds": 0.0, "streamed_bytes": routes.streamed_bytes()}))
    assert routes._read(path, ("rows_near", "torch")) == ("rows_near",) * COUNTS


def test_a_kept_file_timed_over_a_stream_the_cache_held_part_of_is_measured_again(tmp_path):
    """Over weights of two last-level caches, one row with the L1 prefetch was timed faster in 15 of 22 measurements on
    an AMD EPYC, and ran SmolLM2's steps 3-29% slower (bf16) with it."""
    path = tmp_path / "routes.json"
    seconds = {name: [1.0] * COUNTS for name in ("rows", "torch")}
    record = {"counts": list(routes.COUNTS), "routes": ["rows"] * COUNTS, "seconds": seconds, "copy_seconds": 0.0}
    path.write_text(json.dumps(record))
    assert routes._read(path, ("rows", "torch")) is None
    path.write_text(json.dumps({**record, "streamed_bytes": routes.streamed_bytes() // 4}))
    assert routes._read(path, ("rows", "torch")) is None
    path.write_text(json.dumps({**record, "streamed_bytes": routes.streamed_bytes()}))
    assert routes._read(path, ("rows", "torch")) == ("rows",) * COUNTS


def test_products_are_timed_over_weights_of_eight_last_level_caches(monkeypatch):
    """As many bytes as the bandwidth probe reads (bench/roofline.py): all but a sliver from memory."""
    assert routes.streamed_bytes(32 << 20) == 256 << 20
    assert routes.streamed_bytes(64 << 20) == 512 << 20
    assert routes.streamed_bytes(1 << 20) == 256 << 20  # a small cache, or none reported: at least 256 MiB
    assert routes.streamed_bytes(1 << 30) == 1 << 30  # at most 1 GiB
    monkeypatch.setattr(routes, "streamed_bytes", lambda: 40 << 20)
    monkeypatch.setattr(routes, "available", lambda dtype: ("rows", "torch"))
    total = sum(weight.numel() * weight.element_size() for weight, _ in routes.workload(torch.float32))
    largest = max(out * features for out, features in routes.SHAPES) * 4
    assert 40 << 20 <= total < (40 << 20) + largest


def test_a_kept_file_that_never_timed_the_l1_prefetch_is_measured_again(tmp_path):
    path = tmp_path / "routes.json"
    seconds = {name: [1.0] * COUNTS for name in ("rows", "torch")}
    path.write_text(json.dumps({"counts": list(routes.COUNTS), "routes": ["rows"] * COUNTS, "seconds": seconds,
                                "copy_seconds": 0.0, "streamed_bytes": routes.streamed_bytes()}))
    assert routes._read(path, ("rows", "torch")) == ("rows",) * COUNTS
    assert routes._read(path, ("rows", "rows_near", "torch")) is None


def test_the_kernels_l1_prefetch_serves_the_row_counts_it_was_measured_faster_at(monkeypatch, small_stream):
    """The prefetch made 8-16 rows faster on an AMD EPYC, 2-6 rows up to 3% and one row up to 29% slower: a choice per
    row count, measured, which the kernel takes as a bit per count (`routes.ways`). Blocks past 16 rows are not timed
    with it (their groups of up to 16 take their counts' bits)."""
    monkeypatch.setattr(routes, "available", lambda dtype: ("rows", "rows_near", "torch"))
    timed = record_timings(monkeypatch, {1: "rows_near", 2: "rows", 8: "rows_near", 16: "rows_near", 32: "rows_near"})
    chosen = routes.routes(torch.float32)
    assert chosen[:2] == ("rows_near", "rows") and chosen[7] == chosen[15] == "rows_near" and chosen[16] != "rows_near"
    assert routes.ways(torch.float32) == 1 | (1 << 7) | (1 << 15)
    assert routes.on_kernel(8, torch.float32) and not routes.on_kernel(3, torch.float32)
    assert timed["rows_near"] == set(range(1, MAX_ROWS + 1))


def test_reading_a_weight_row_at_a_time_serves_the_row_counts_it_was_measured_faster_at(monkeypatch, small_stream):
    """2-8 bf16 rows ran 1.2-1.3x faster on an AMD EPYC reading one weight row at a time, fp32 rows 0.7-1.15x as fast,
    and one row (a decoding step) 1.04-1.12x there and 0.89-0.94x on an Intel Xeon: per row count, measured (bit 16 +
    r - 1 of `routes.ways`), with or without the L1 prefetch."""
    monkeypatch.setattr(routes, "available", lambda dtype: routes.KERNEL + ("torch",))
    timed = record_timings(monkeypatch, {1: "rows_single_near", 2: "rows_single", 3: "rows_single_near",
                                         4: "rows_near", 5: "rows_single"})
    chosen = routes.routes(torch.float32)
    assert chosen[:5] == ("rows_single_near", "rows_single", "rows_single_near", "rows_near", "rows_single")
    single = routes.SINGLE_BITS
    assert routes.ways(torch.float32) == (1 << single) | 1 | (1 << (single + 1)) | (1 << 2) | (1 << (single + 2)) | \
        (1 << 3) | (1 << (single + 4))
    for name in ("rows_single", "rows_single_near"):
        assert timed[name] == set(range(1, MAX_ROWS + 1))


def test_amx_serves_the_bf16_row_counts_it_was_measured_faster_at(monkeypatch, small_stream):
    """On an Intel Xeon oneDNN's AMX product multiplied 8-16 bf16 rows up to 2.3x faster than the vector kernel, and
    a verify block sent to it left the rows library's one-call step (0.87-1.02 plain steps against 0.42 for 4 rows):
    the kernel's own AMX way is measured at 2-16 rows like the others (bit AMX_BITS + r - 2 of `routes.ways`), not at
    one row, whose bit would be another way's."""
    monkeypatch.setattr(routes, "available", lambda dtype: ("rows", "rows_amx", "torch"))
    timed = record_timings(monkeypatch, {1: "rows", 6: "rows_amx", 16: "rows_amx"})
    chosen = routes.routes(torch.bfloat16)
    assert chosen[0] == "rows" and chosen[5] == chosen[15] == "rows_amx" and chosen[6] == "torch"
    assert routes.ways(torch.bfloat16) == (1 << (routes.AMX_BITS + 4)) | (1 << (routes.AMX_BITS + 14))
    assert timed["rows_amx"] == set(range(2, MAX_ROWS + 1))


def test_groups_of_up_to_six_rows_serve_the_row_counts_they_were_measured_faster_at(monkeypatch, small_stream):
    """8-16 fp32 rows in groups of up to 6 ran 1.2-1.3x faster on an AMD EPYC where the weights came from the cache,
    bf16 rows up to 10% slower: per row count, measured (bit 32 + r - 1 of `routes.ways`), with or without the L1
    prefetch. Fewer than 7 rows are one group either way, so they are not timed."""
    monkeypatch.setattr(routes, "available", lambda dtype: routes.KERNEL + ("torch",))
    timed = record_timings(monkeypatch,
                           {6: "rows_near", 7: "rows_narrow", 8: "rows_narrow_near", 16: "rows_narrow_near"})
    chosen = routes.routes(torch.float32)
    assert chosen[5:8] == ("rows_near", "rows_narrow", "rows_narrow_near") and chosen[15] == "rows_narrow_near"
    narrow = routes.NARROW_BITS
    assert routes.ways(torch.float32) == (1 << 5) | (1 << (narrow + 6)) | (1 << 7) | (1 << (narrow + 7)) | \
        (1 << 15) | (1 << (narrow + 15))
    for name in ("rows_narrow", "rows_narrow_near"):
        assert timed[name] == set(range(7, MAX_ROWS + 1))


def test_only_a_row_count_measured_fastest_on_onednn_makes_its_copy(monkeypatch):
    monkeypatch.setattr(routes, "routes", lambda dtype: ("rows",) * COUNTS)
    assert cpu_products.rows_layout(torch.float32)
    monkeypatch.setattr(routes, "routes", lambda dtype: ("rows",) * (COUNTS - 1) + ("onednn",))
    assert not cpu_products.rows_layout(torch.float32)


ROUTE_SETS = {
    "rows": ("rows",) * COUNTS,
    "torch": ("torch",) * COUNTS,
    "onednn": ("onednn",) * COUNTS,
    "rows_near": ("rows_near",) * COUNTS,
    "rows_single": ("rows_single",) * COUNTS,
    "rows_narrow": ("rows_narrow",) * COUNTS,
    "mixed": tuple(routes.IMPLEMENTATIONS[count % len(routes.IMPLEMENTATIONS)] for count in range(COUNTS)),
}


@pytest.mark.parametrize("route_set", ROUTE_SETS)
def test_greedy_decoding_equals_plain_generate_whichever_implementation_each_row_count_got(monkeypatch, route_set):
    if set(routes.KERNEL) & set(ROUTE_SETS[route_set]) and not rows_kernel():
        pytest.skip("the rows kernel needs a CPU with AVX-512 and a C++ compiler")
    target, drafter = trained_pair("llama", eagle31=True, speculation_mode="tree", tree_total_tokens=12)
    plain = [target.generate(PROMPTS[i : i + 1], do_sample=False, max_new_tokens=20) for i in (0, 3)]
    monkeypatch.setattr(routes, "routes", lambda dtype: ROUTE_SETS[route_set])
    seen = []
    linear = routes.linear
    monkeypatch.setattr(routes, "linear", lambda x, *args: seen.append(x.numel() // x.shape[-1]) or linear(x, *args))
    for i, expected in zip((0, 3), plain):
        prompt = PROMPTS[i : i + 1]
        fast = target.generate(prompt, do_sample=False, max_new_tokens=20, custom_generate=hf_eagle31.fast_decoding)
        assert torch.equal(fast, expected)
        assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafter),
                           expected)
    assert 1 in seen and any(1 < count <= MAX_ROWS for count in seen)  # one-row steps, verify blocks


def test_a_product_of_each_route_equals_torchs(monkeypatch):
    target = make_target(seed=3)
    reference = {count: target(PROMPTS[:1, :count]).logits for count in (1, 2, 7)}
    for route_set, chosen in ROUTE_SETS.items():
        if set(routes.KERNEL) & set(chosen) and not rows_kernel():
            continue
        monkeypatch.setattr(routes, "routes", lambda dtype, chosen=chosen: chosen)
        products = Products(target)
        with products.active(mode=True):
            for count, logits in reference.items():
                torch.testing.assert_close(target(PROMPTS[:1, :count]).logits, logits, atol=1e-4, rtol=1e-4)
