"""The products built for CPUs with AVX2 but not AVX-512 (backends/cpu/rows_avx2.cpp) against torch's, in fp32 and
bf16, and a fresh process with AVX-512 masked (`ATEN_CPU_CAPABILITY=avx2`, as on such a CPU) decoding on them: the
same tokens as plain `generate`. On an AVX-512 CPU the library is loaded here beside the rows library (its own ops'
namespace), so that these run wherever the CPU has AVX2."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from product_cases import assert_product, product_case

from hf_eagle31.backends.cpu import routes, rows

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or shutil.which(rows._compiler()) is None,
    reason="the AVX2 products need a CPU with AVX2 and a C++ compiler")


@pytest.fixture(scope="module")
def linear():
    assert rows._load(rows.AVX2, rows.build_directory(rows.AVX2)), "the AVX2 products did not build: see the warning"
    return torch.ops.hf_eagle31_avx2.linear


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
    for bad, named in [((x.double(), [torch.randn(4, 8)], None), "fp32 or bf16 input expected"),
                       ((x, [torch.randn(4, 9)], None), "weights of 8 input features expected"),
                       ((x, [torch.randn(4, 8).bfloat16()], None), "contiguous Float weights"),
                       ((x, [torch.randn(8, 4).t()], None), "contiguous Float weights"),
                       ((x, [torch.randn(4, 8)], torch.randn(5)), "a bias of 4 features expected")]:
        with pytest.raises(RuntimeError, match=named):
            linear(*bad)


MASKED = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import torch
    import hf_eagle31
    from hf_eagle31.backends.cpu import routes, rows
    from hf_eagle31.backends.cpu.products import can_pack
    from tiny_models import PROMPTS, trained_pair
    target, drafter = trained_pair("llama", eagle31=True)
    expected = target.generate(PROMPTS[:2], do_sample=False, max_new_tokens=12)
    eagle = target.generate(PROMPTS[:2], assistant_model=drafter, do_sample=False, max_new_tokens=12)
    fast = target.generate(PROMPTS[:2], do_sample=False, max_new_tokens=12, custom_generate=hf_eagle31.fast_decoding)
    print("capability", torch.backends.cpu.get_cpu_capability(), "rows", rows.rows_kernel(), "avx2",
          rows.avx2_kernel(), "routes", set(routes.routes(torch.float32)), "equal", torch.equal(eagle, expected),
          torch.equal(fast, expected), "bf16 served", can_pack(target.to(torch.bfloat16)))
""")


def test_a_cpu_without_avx512_decodes_on_them(tmp_path):
    """What such a CPU runs: the AVX2 build (not the rows library, which needs AVX-512), its products serving every
    row count (routes kept here as if measured so), EAGLE's and `fast_decoding`'s tokens plain `generate`'s; and a
    bf16 model is served too (oneDNN does not compute bf16 there)."""
    environment = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2",
                   "HF_EAGLE31_CACHE": os.environ.get("HF_EAGLE31_CACHE", str(tmp_path))}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
        patch.setenv("HF_EAGLE31_CACHE", environment["HF_EAGLE31_CACHE"])
        folder = rows.build_directory()
    folder.mkdir(parents=True, exist_ok=True)
    kept = {"counts": list(routes.COUNTS), "routes": ["avx2"] * len(routes.COUNTS), "copy_seconds": 0.0,
            "streamed_bytes": routes.streamed_bytes(),
            "seconds": {name: [1.0 if name == "avx2" else 2.0] * len(routes.COUNTS)
                        for name in ("avx2", "torch", "onednn")}}
    for threads in range(1, (os.cpu_count() or 1) + 1):  # whichever the process below runs with
        (folder / f"routes-float32-{threads}threads.json").write_text(json.dumps(kept))
    done = subprocess.run([sys.executable, "-c", MASKED, os.path.dirname(__file__)], capture_output=True, text=True,
                          timeout=600, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "capability AVX2 rows False avx2 True routes {'avx2'} equal True True bf16 served True" in done.stdout, \
        done.stderr[-3000:]
