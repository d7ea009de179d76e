"""The rows library built for CPUs with AVX2 but not AVX-512 (rows.h's vectors as two AVX2 vectors, its products by
backends/cpu/rows_avx2.cpp): its products against torch's, in fp32 and bf16, where this CPU gets that build. On an
AVX-512 CPU a fresh process with AVX-512 masked (`ATEN_CPU_CAPABILITY=avx2`, as on such a CPU) runs these and the
library's other tests on it (`MASKED`: attention, argmax, held products, whole forwards of the target and the
drafter, decoding equal to plain `generate`), so that CI tests the build wherever the CPU has AVX2."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from product_cases import assert_product, product_case

from hf_eagle31.backends.cpu import routes, rows


@pytest.fixture(scope="module")
def linear():
    if torch.backends.cpu.get_cpu_capability() != "AVX2" or shutil.which(rows._compiler()) is None:
        pytest.skip("this CPU gets another build (on AVX-512: tested masked, below)")
    assert rows.rows_kernel() and not rows.reads_ways(), "the AVX2 build did not load: see the warning"
    return lambda x, weights, bias: torch.ops.hf_eagle31_rows.linear(x, weights, bias, -1)  # `ways`: one way here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [*range(1, 17), 17, 40])  # 17, 40: groups of 3 rows and their tails, further on
@pytest.mark.parametrize("features", [(576, 1536), (1536, 577), (100, 7), (24, 2), (33, 13)])  # K, N tails
def test_the_products_compute_torchs_product(linear, count, features, dtype):
    x, weights, bias = product_case(count, features, dtype)
    assert_product(linear(x, weights, bias), x, weights, bias)
    assert_product(linear(x, weights[:1], None), x, weights[:1], None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_gets_the_bits_it_gets_in_a_block(linear, dtype):
    """A token's logits do not depend on whether it was verified alone or in a block of any size: every output is
    summed in the same order whatever the group of rows or of weight rows it is computed in."""
    torch.manual_seed(0)
    x = torch.randn(16, 577).to(dtype)
    weights = [torch.randn(1000, 577).to(dtype), torch.randn(7, 577).to(dtype)]
    for count in (2, 4, 7, 16):
        block = linear(x[:count], weights, None)
        for row in range(count):
            assert torch.equal(linear(x[row : row + 1], weights, None), block[row : row + 1])


def test_bad_input_is_named(linear):
    x = torch.randn(2, 8)
    for bad, named in [((x.double(), [torch.randn(4, 8)], None), "fp32 or bf16 input expected, got Double"),
                       ((x, [torch.randn(4, 9)], None), "weights of 8 input features expected"),
                       ((x, [torch.randn(4, 8).bfloat16()], None), "contiguous Float weights"),
                       ((x, [torch.randn(8, 4).t()], None), "contiguous Float weights"),
                       ((x, [torch.randn(4, 8)], torch.randn(5)), "a bias of 4 features expected")]:
        with pytest.raises(RuntimeError, match=named):
            linear(*bad)


# the library's tests that its AVX2 build must pass too (those of the AVX-512 kernel's ways, AMX and the build left out)
MASKED = [
    *(f"tests/test_avx2_kernel.py::test_{name}" for name in (
        "the_products_compute_torchs_product", "a_row_alone_gets_the_bits_it_gets_in_a_block", "bad_input_is_named")),
    *(f"tests/test_rows_kernel.py::test_{name}" for name in (
        "the_kernel_refuses_what_it_cannot_multiply",
        "a_product_held_under_a_key_is_the_product_of_the_weights_held_there",
        "the_kernels_attention_computes_torchs", "a_key_scores_the_same_bits_summed_with_fifteen_others_or_alone",
        "attention_in_a_held_room_writes_the_new_keys_behind_the_cache_and_attends_over_all",
        "the_kernels_attention_refuses_what_it_cannot_compute",
        "the_librarys_argmax_picks_the_index_torchs_argmax_picks")),
    *(f"tests/test_lean.py::test_{name}" for name in (
        "decoding_on_forwards_computed_whole_by_the_rows_library_equals_plain_greedy",
        "fast_decoding_takes_the_lean_forward_one_token_a_step_and_equals_plain_greedy",
        "a_whole_forward_holds_the_weights_while_its_call_lasts_and_lets_them_go",
        "a_forward_computed_whole_by_the_rows_library_is_the_lean_forwards_to_a_rounding",
        "a_forward_computed_whole_gives_the_same_bits_on_any_number_of_threads",
        "a_forward_computed_whole_multiplies_by_the_lm_head_as_its_own_call_would",
        "a_step_is_computed_whole_only_for_mlps_gated_by_silu")),
    "tests/test_whole_draft.py"]


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512" or shutil.which(rows._compiler()) is None,
                    reason="masks AVX-512 on a CPU that has it, with a C++ compiler")
def test_a_cpu_without_avx512_passes_the_librarys_tests_on_its_build(tmp_path):
    """What such a CPU runs: the AVX2 build, its kernel serving every row count (routes kept here as if measured so:
    a measurement is the bench's), every test in `MASKED` passing on it, none skipped."""
    environment = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2",
                   "HF_EAGLE31_CACHE": os.environ.get("HF_EAGLE31_CACHE", str(tmp_path))}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
        patch.setenv("HF_EAGLE31_CACHE", environment["HF_EAGLE31_CACHE"])
        folder = rows.build_directory()
    folder.mkdir(parents=True, exist_ok=True)
    kept = {"counts": list(routes.COUNTS), "routes": ["rows"] * len(routes.COUNTS), "copy_seconds": 0.0,
            "streamed_bytes": routes.streamed_bytes(),
            "seconds": {name: [1.0 if name == "rows" else 2.0] * len(routes.COUNTS)
                        for name in ("rows", "torch", "onednn")}}
    for dtype in ("float32", "bfloat16"):
        for threads in range(1, (os.cpu_count() or 1) + 1):  # whichever the process below runs with
            (folder / f"routes-{dtype}-{threads}threads.json").write_text(json.dumps(kept))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *MASKED],
                          capture_output=True, text=True, timeout=1200, env=environment,
                          cwd=Path(__file__).parent.parent)
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0 and "skipped" not in summary, done.stdout[-4000:] + done.stderr[-2000:]
