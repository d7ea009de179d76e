"""The fp32 rows kernel (backends/cpu/rows_linear.cpp) against torch's products, and its build: robust to a build
killed halfway and to a compiler that fails."""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

from hf_eagle31.backends.cpu import rows
from hf_eagle31.backends.cpu.rows import rows_kernel, rows_linear

needs_kernel = pytest.mark.skipif(not rows_kernel(), reason="the rows kernel needs a CPU with AVX-512 and a C++ compiler")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 13, 16, 17, 40])  # 1 and 40: torch's; 17: a second pass of 16
@pytest.mark.parametrize("features", [(576, 1536), (1536, 577), (100, 7), (24, 3)])  # tails of 16 inputs, 6 outputs
def test_the_kernel_computes_torchs_product(rows, features):
    in_features, out_features = features
    torch.manual_seed(rows)
    x = torch.randn(2, rows, in_features)[:, :, :]  # leading dimensions kept
    weights = [torch.randn(out_features, in_features), torch.randn(5, in_features)]
    bias = torch.randn(out_features + 5)
    expected = F.linear(x, torch.cat(weights), bias)
    out = rows_linear(x[:1], weights, bias)
    assert out.shape == expected[:1].shape
    torch.testing.assert_close(out, expected[:1], atol=2e-4 * in_features ** 0.5, rtol=1e-4)
    torch.testing.assert_close(rows_linear(x[:1], weights[:1], None), F.linear(x[:1], weights[0]),
                               atol=2e-4 * in_features ** 0.5, rtol=1e-4)


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_multiply():
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="fp32 input"):
        torch.ops.hf_eagle31_rows.linear(x.double(), [torch.randn(4, 8)], None)
    with pytest.raises(RuntimeError, match="8 input features"):
        torch.ops.hf_eagle31_rows.linear(x, [torch.randn(4, 9)], None)


FIRST_CALL = textwrap.dedent("""
    import sys, warnings
    sys.path.insert(0, sys.argv[1])
    warnings.simplefilter("always")
    import torch
    from tiny_models import PROMPTS, trained_pair
    target, drafter = trained_pair("llama", eagle31=True)
    expected = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=12)
    out = target.generate(PROMPTS[:1], assistant_model=drafter, do_sample=False, max_new_tokens=12)
    from hf_eagle31.backends.cpu.rows import rows_kernel
    print("kernel", rows_kernel(), "equal", torch.equal(out, expected))
""")


def first_call(environment: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    """A fresh process's first EAGLE call in fp32 (the one that builds or loads the kernel)."""
    return subprocess.run([sys.executable, "-c", FIRST_CALL, os.path.dirname(__file__)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **environment})


@needs_kernel
def test_a_build_killed_halfway_does_not_hang_the_next_process():
    """A process killed while torch built the kernel left torch's lock file in the build folder, and every later
    process's first fp32 EAGLE call waited on it forever."""
    (rows.build_directory() / "lock").write_text("")  # what the killed build leaves
    done = first_call({})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kernel True equal True" in done.stdout


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="the kernel builds on AVX-512 only")
def test_a_compiler_that_fails_falls_back_with_one_warning(tmp_path):
    """`CXX` set to a compiler that fails raised a raw CalledProcessError from generate, at every call."""
    done = first_call({"CXX": "false", "HF_EAGLE31_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kernel False equal True" in done.stdout
    assert done.stderr.count("the fp32 rows kernel did not build") == 1


def test_a_kernel_that_cannot_build_is_named_in_the_warning(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def no_ninja(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", no_ninja)
    with pytest.warns(UserWarning, match="rows kernel did not build .*Ninja is required.*oneDNN's packed layout"):
        assert rows._build(tmp_path) is False


def test_a_thread_asking_while_another_builds_computes_without_it(monkeypatch):
    monkeypatch.setattr(rows, "_LOADED", [])
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(rows.shutil, "which", lambda name: "/usr/bin/c++")
    with rows._BUILDING:  # another thread is building
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert rows_kernel() is False
    assert rows._LOADED == []  # not decided: the builder decides


def test_no_avx512_means_no_kernel(monkeypatch):
    monkeypatch.setattr(rows, "_LOADED", [])
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert rows_kernel() is False
