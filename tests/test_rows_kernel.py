"""The rows kernel (backends/cpu/rows_linear.cpp) against torch's products, in fp32 and bf16, at every row count a
verify block has, its attention (rows_attention.cpp) against torch's, and its build: keyed to what it depends on,
loaded by later processes without torch's builder, robust to a build killed halfway and to a compiler that fails."""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from product_cases import assert_product, product_case

from hf_eagle31.backends.cpu import routes, rows
from hf_eagle31.backends.cpu.rows import MAX_ROWS, bf16_kernel, rows_kernel

needs_kernel = pytest.mark.skipif(not rows_kernel(), reason="the rows kernel needs a CPU with AVX-512 and a C++ compiler")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not bf16_kernel(), reason="the bf16 rows kernel needs a CPU with AVX512-BF16"))]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [*range(1, MAX_ROWS + 1), 17, 40])  # 17, 40: further passes of 16
@pytest.mark.parametrize("features", [(576, 1536), (1536, 577), (100, 7), (24, 3), (33, 13)])  # K, N tails
# weights read side by side; a weight row at a time; 7-16 rows in groups of up to 6; all with the L1 prefetch
@pytest.mark.parametrize("ways", [0, 0xFFFF << 16, 0xFFFF << 32, -1])
def test_the_kernel_computes_torchs_product(rows, features, dtype, ways):
    x, weights, bias = product_case(rows, features, dtype)
    x = x[:1]
    assert_product(torch.ops.hf_eagle31_rows.linear(x, weights, bias, ways), x, weights, bias)
    assert_product(torch.ops.hf_eagle31_rows.linear(x, weights[:1], None, ways), x, weights[:1], None)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_alone_gets_the_bits_it_gets_in_a_block(dtype):
    """A decoding step multiplies one row and a verify block several: the kernel may read the weights in another
    order for one row (one stream, rows_linear.cpp's `stream_rows`, or a few weight rows side by side) but sums each
    output in the same order, so a token's logits do not depend on whether it was verified alone or in a block; nor
    on how the row or the block read the weights (`ways`, choices measured per row count: routes.py)."""
    torch.manual_seed(0)
    x = torch.randn(16, 577).to(dtype)  # a tail of K past the vectors
    weights = [torch.randn(1000, 577).to(dtype), torch.randn(7, 577).to(dtype)]
    bias = torch.randn(1007).to(dtype)
    for count in (2, 7, 9, 13, 16):
        block = torch.ops.hf_eagle31_rows.linear(x[:count], weights, bias)
        # with the L1 prefetch; a weight row at a time; in groups of up to 6 (two or three); all three (not AMX's
        # tiles, which sum in an order of their own: test_amx_gives_a_row_the_same_bits_in_every_block)
        for ways in (0xFFFF, 0xFFFF << 16, 0xFFFF << 32, (1 << routes.AMX_BITS) - 1):
            assert torch.equal(torch.ops.hf_eagle31_rows.linear(x[:count], weights, bias, ways), block)
        for row in (0, count - 1):
            for ways in (0, 1, 1 << 16, (1 << 16) | 1):  # side by side or one stream, each with the L1 prefetch
                alone = torch.ops.hf_eagle31_rows.linear(x[row : row + 1], weights, bias, ways)
                assert torch.equal(alone, block[row : row + 1])


@pytest.mark.skipif(not rows.amx_kernel(), reason="AMX's tiles need an Intel CPU with AMX-BF16")
def test_amx_gives_a_row_the_same_bits_in_every_block():
    """2-16 bf16 rows on AMX's tiles (a way of their own, `routes.AMX_BITS`) sum each output in AMX's order, not the
    vector kernel's: as close to the exact sums, and a row's outputs are the same bits in a block of any size, so a
    token's logits do not depend on the size of the block it was verified in."""
    torch.manual_seed(0)
    x = torch.randn(16, 576).to(torch.bfloat16)
    weights = [torch.randn(1000, 576).to(torch.bfloat16), torch.randn(7, 576).to(torch.bfloat16)]  # a tail of 7
    bias = torch.randn(1007).to(torch.bfloat16)
    exact = F.linear(x.float(), torch.cat(weights).float(), bias.float())
    amx = sum(1 << (routes.AMX_BITS + count - 2) for count in range(2, MAX_ROWS + 1))
    blocks = {count: torch.ops.hf_eagle31_rows.linear(x[:count], weights, bias, amx) for count in range(2, 17)}
    for count, block in blocks.items():  # each output rounded once to bf16, as the vector kernel's
        torch.testing.assert_close(block.float(), exact[:count], atol=1e-3 * 576 ** 0.5, rtol=2 ** -8)
        assert torch.equal(block[:2], blocks[2])
    assert not torch.equal(blocks[16], torch.ops.hf_eagle31_rows.linear(x, weights, bias, 0))  # AMX's own order


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_multiply():
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="fp32( or bf16)? input expected, got Double"):
        torch.ops.hf_eagle31_rows.linear(x.double(), [torch.randn(4, 8)], None)
    with pytest.raises(RuntimeError, match="8 input features"):
        torch.ops.hf_eagle31_rows.linear(x, [torch.randn(4, 9)], None)
    with pytest.raises(RuntimeError, match="8 input features"):
        torch.ops.hf_eagle31_rows.linear(x, [torch.randn(4, 8).bfloat16()], None)
    with pytest.raises(RuntimeError, match="a bias of 4 features"):
        torch.ops.hf_eagle31_rows.linear(x, [torch.randn(4, 8)], torch.randn(5))


@needs_kernel
def test_a_product_held_under_a_key_is_the_product_of_the_weights_held_there():
    """`product` multiplies by the weights and bias `hold` put under a key, as `linear` on them does; the weights are
    held weakly (freed with their owner, then refused by name), a key held again takes the new weights, and a key
    never held is refused."""
    ops, x = torch.ops.hf_eagle31_rows, torch.randn(2, 3, 24)
    weights, bias = [torch.randn(5, 24), torch.randn(7, 24)], torch.randn(12)
    lone = torch.randn(4, 24)
    ops.hold([9001, 9002], [2, 1], [*weights, lone], [bias, None])
    assert torch.equal(ops.product(x, 9001, 12, 0), ops.linear(x, weights, bias, 0))
    assert torch.equal(ops.product(x, 9002, 4, 0), ops.linear(x, [lone], None, 0))
    weights[0].mul_(2.0)  # in place: the same tensor, seen
    assert torch.equal(ops.product(x, 9001, 12, 0), ops.linear(x, weights, bias, 0))
    with pytest.raises(RuntimeError, match="key 9001 give 12 features, not 13"):
        ops.product(x, 9001, 13, 0)
    del lone
    with pytest.raises(RuntimeError, match="weights held under key 9002 were freed"):
        ops.product(x, 9002, 4, 0)
    other = torch.randn(6, 24)
    ops.hold([9002], [1], [other], [None])
    assert torch.equal(ops.product(x, 9002, 6, 0), ops.linear(x, [other], None, 0))
    with pytest.raises(RuntimeError, match="no weights held under key 9003"):
        ops.product(x, 9003, 4, 0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16 read by shifts: any AVX-512 CPU
@pytest.mark.parametrize("keys", [1, 7, 16, 300, 1027])  # one key, a partial vector, whole vectors, longer caches
@pytest.mark.parametrize("head_dim", [64, 128, 48, 32])  # 64: a group's rows weigh its values together
def test_the_kernels_attention_computes_torchs(keys, head_dim, dtype):
    """A few query rows over a cache's keys and values as the lean step hands them (views of buffers with room
    behind them), with an additive mask that hides some keys (a pad's, as `additive_mask` writes it) or none."""
    torch.manual_seed(keys)
    batch, groups, rows_, room = 2, 3, 5, 5  # 5 rows a group: 3, then 2, weighed at once (head size 64)
    query = torch.randn(batch, groups, rows_, head_dim).to(dtype)
    key, value = (torch.randn(batch, groups, keys + room, head_dim).to(dtype)[:, :, :keys] for _ in range(2))
    mask = torch.zeros(batch, 1, rows_, keys, dtype=dtype)
    mask[0, :, :, : keys // 2] = torch.finfo(dtype).min  # the first row's first half: pads
    exact = [F.scaled_dot_product_attention(query.double(), key.double(), value.double(), attn_mask=m, scale=0.3)
             for m in (mask.double(), None)]
    for m, expected in zip((mask, None), exact):
        out = torch.ops.hf_eagle31_rows.attention(query, key, value, m, 0.3)
        torchs = F.scaled_dot_product_attention(query, key, value, attn_mask=m, scale=0.3)
        assert out.dtype == dtype and out.shape == expected.shape
        # as close to the exact attention as torch's own (fp32: sums in another order; bf16: each output rounded
        # once, torch's rounds the weights too)
        assert (out.double() - expected).abs().max() <= 2 * (torchs.double() - expected).abs().max() + 1e-6


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keys", [15, 31, 47])  # 16 keys summed together, or fewer one at a time
@pytest.mark.parametrize("head_dim", [64, 128, 256])  # 256: never 16 keys at once (four at a time)
def test_a_key_scores_the_same_bits_summed_with_fifteen_others_or_alone(keys, head_dim, dtype):
    """A row's output over `keys` keys equals, bit for bit, its output over one more key that the mask hides: its
    last 16 keys are then scored 16 at once where they were scored one at a time, so a block's rows (whose caches
    hold the block too) get the bits a one-token step gets."""
    torch.manual_seed(keys + head_dim)
    query = torch.randn(1, 3, 5, head_dim).to(dtype)
    key, value = (torch.randn(1, 3, keys + 1, head_dim).to(dtype) for _ in range(2))
    hidden = torch.zeros(1, 1, 5, keys + 1, dtype=dtype)
    hidden[..., keys] = torch.finfo(dtype).min
    ops = torch.ops.hf_eagle31_rows
    assert torch.equal(ops.attention(query, key, value, hidden, 0.3),
                       ops.attention(query, key[:, :, :keys], value[:, :, :keys], hidden[..., :keys], 0.3))


@needs_kernel
def test_attention_in_a_held_room_writes_the_new_keys_behind_the_cache_and_attends_over_all():
    """`attention_in_room` writes a step's keys and values into the buffers `hold_room` holds for the layer, behind
    the `length` cached, and attends as `attention` over the cache and them; a room never held, freed buffers and a
    step past the buffers' room are refused by name."""
    torch.manual_seed(0)
    ops, length = torch.ops.hf_eagle31_rows, 9
    buffers = [(torch.randn(1, 3, 16, 64), torch.randn(1, 3, 16, 64)) for _ in range(2)]
    cached = [(keys[:, :, :length].clone(), values[:, :, :length].clone()) for keys, values in buffers]
    ops.hold_room(7001, [keys for keys, _ in buffers], [values for _, values in buffers])
    query, new_keys, new_values = torch.randn(1, 3, 2, 64), torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64)
    out = ops.attention_in_room(query, new_keys, new_values, 7001, 1, length, None, 0.125)
    keys, values = (torch.cat([old, new], dim=2) for old, new in zip(cached[1], (new_keys, new_values)))
    assert torch.equal(buffers[1][0][:, :, : length + 1], keys)
    assert torch.equal(buffers[1][1][:, :, : length + 1], values)
    assert torch.equal(buffers[0][0][:, :, :length], cached[0][0])  # the other layer untouched
    assert torch.equal(out, ops.attention(query, keys, values, None, 0.125))
    with pytest.raises(RuntimeError, match="no room for 1 more keys after 16"):
        ops.attention_in_room(query, new_keys, new_values, 7001, 0, 16, None, 0.125)
    with pytest.raises(RuntimeError, match="no buffers held for layer 0 of room 7002"):
        ops.attention_in_room(query, new_keys, new_values, 7002, 0, length, None, 0.125)
    del buffers
    with pytest.raises(RuntimeError, match="the buffers of room 7001 were freed"):
        ops.attention_in_room(query, new_keys, new_values, 7001, 0, length, None, 0.125)


@needs_kernel
def test_the_kernels_attention_refuses_what_it_cannot_compute():
    query, key = torch.randn(1, 2, 3, 64), torch.randn(1, 2, 5, 64)
    with pytest.raises(RuntimeError, match="head dims of a multiple of 16"):
        torch.ops.hf_eagle31_rows.attention(query[..., :40], key[..., :40], key[..., :40], None, 1.0)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        torch.ops.hf_eagle31_rows.attention(query.double(), key.double(), key.double(), None, 1.0)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.hf_eagle31_rows.attention(query, key.bfloat16(), key, None, 1.0)
    assert rows.attends(64) and rows.attends(256) and not rows.attends(40) and not rows.attends(272)


@needs_kernel
@pytest.mark.parametrize("size", [1, 15, 16, 17, 100, 49152])  # a partial vector, whole ones, a vocabulary
def test_the_librarys_argmax_picks_the_index_torchs_argmax_picks(size):
    """The greedy pick a CPU decoding takes (`acceptance.pick_token`): the first of equal largest scores (-0 equal
    to 0), the first NaN where there is one, as torch's argmax; other dtypes and layouts are torch's own."""
    generator = torch.Generator().manual_seed(size)
    for trial in range(60):
        scores = torch.randint(-3, 3, (3, size), generator=generator).float()  # ties everywhere
        where = torch.rand(3, size, generator=generator)
        scores[where > 0.97] = -0.0
        scores[where < 0.01 * (trial % 3)] = float("nan")
        if trial % 10 == 0:
            scores[1] = -math.inf
        for case in (scores, scores[:, :-1] if size > 1 else scores, scores.bfloat16(), scores.t()[:, :1]):
            assert torch.equal(torch.ops.hf_eagle31_rows.argmax(case), case.argmax(-1, keepdim=True))


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


def first_call(environment: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    """A fresh process's first EAGLE call in fp32 (the one that builds or loads the kernel), its fp32 routes kept
    already (torch's at every row count) so that it times nothing."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment.items():
            patch.setenv(name, value)
        folder = rows.build_directory()
    folder.mkdir(parents=True, exist_ok=True)
    kept = folder / f"routes-float32-{torch.get_num_threads()}threads.json"
    if not kept.exists():
        kept.write_text(json.dumps({"counts": list(routes.COUNTS), "routes": ["torch"] * len(routes.COUNTS)}))
    return subprocess.run([sys.executable, "-c", FIRST_CALL, os.path.dirname(__file__)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **environment})


@needs_kernel
def test_a_build_killed_halfway_does_not_hang_the_next_process(tmp_path, monkeypatch):
    """A process killed while torch built the kernel left torch's lock file in the build folder, and every later
    process's first fp32 EAGLE call waited on it forever; one killed while it linked left half a library."""
    monkeypatch.setenv("HF_EAGLE31_CACHE", str(tmp_path))
    folder = rows.build_directory()  # where the process below builds
    (folder / "build").mkdir(parents=True)
    (folder / "build" / "lock").write_text("")  # what the killed build leaves
    (folder / "build" / rows.ROWS.library).write_bytes(b"half a library")
    done = first_call({"HF_EAGLE31_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kernel True equal True" in done.stdout


LOADS_WITHOUT_BUILDING = textwrap.dedent("""
    from torch.utils import cpp_extension
    def refused(*args, **kwargs):
        raise AssertionError("torch's builder called")
    cpp_extension.load = refused
    from hf_eagle31.backends.cpu.rows import rows_kernel
    print("kernel", rows_kernel())
""")


@needs_kernel
def test_a_later_process_loads_the_built_library_without_torchs_builder():
    """torch's builder, called by each process, rebuilt the kernel whenever its command line changed: another
    virtual environment's include paths, another checkout's source path, another `$CXX`."""
    done = subprocess.run([sys.executable, "-c", LOADS_WITHOUT_BUILDING], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kernel True" in done.stdout and "did not build" not in done.stderr


@needs_kernel
@pytest.mark.parametrize("policy", ["PASSIVE", "active", None])
def test_sleeping_openmp_workers_are_named_once_when_the_kernel_loads(policy):
    """`OMP_WAIT_POLICY=PASSIVE` made every wait between products wake a sleeping worker: a step slower, and nothing said
    why."""
    environment = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        environment["OMP_WAIT_POLICY"] = policy
    code = "from hf_eagle31.backends.cpu.rows import rows_kernel; print('kernel', rows_kernel(), rows_kernel())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environment)
    assert done.returncode == 0 and "kernel True True" in done.stdout, done.stderr[-2000:]
    assert done.stderr.count("OMP_WAIT_POLICY=PASSIVE makes OpenMP") == (policy == "PASSIVE")


def test_the_build_is_keyed_by_source_compiler_torch_and_cpu_not_by_environment(monkeypatch):
    key = rows.build_key()
    monkeypatch.setattr(sys, "prefix", "/another/environment")
    monkeypatch.setattr(sys, "executable", "/another/environment/bin/python")
    assert rows.build_key() == key
    changes = [(rows, "_compiler", lambda: "clang++"), (rows, "_cpu", lambda: "another CPU"),
               (torch, "__version__", "0.0.1"), (rows, "_flags", lambda build: ["-O2"]),
               (rows, "ROWS", dataclasses.replace(rows.ROWS, sources=rows.ROWS.sources[:1])),
               (rows, "ROWS", dataclasses.replace(rows.ROWS, header=rows.ROWS.sources[0])),  # the header, changed
               (torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT"),  # ATEN_CPU_CAPABILITY=default
               (rows.subprocess, "run", lambda *args, **kwargs: subprocess.CompletedProcess(args, 0, "c++ 99.1", ""))]
    for owner, name, value in changes:
        with monkeypatch.context() as patch:
            patch.setattr(owner, name, value)
            assert rows.build_key() != key, name


def test_amx_flags_go_only_to_a_compiler_that_takes_them(monkeypatch):
    """AMX's flags on a compiler without them (GCC before 11) would fail the whole build: without them the kernel
    builds, its AMX way left out."""
    assert rows._accepts("false", rows.AMX_FLAGS) is False  # a compiler that fails takes none
    monkeypatch.setattr(rows, "_accepts", lambda compiler, flags: False)
    assert not set(rows.AMX_FLAGS) & set(rows._flags()) and "-O3" in rows._flags()


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="the kernel builds on AVX-512 only")
def test_a_compiler_that_fails_falls_back_with_one_warning(tmp_path):
    """`CXX` set to a compiler that fails raised a raw CalledProcessError from generate, at every call."""
    done = first_call({"CXX": "false", "HF_EAGLE31_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kernel False equal True" in done.stdout
    assert done.stderr.count("the rows kernel did not build") == 1


def test_a_kernel_that_cannot_build_is_named_in_the_warning(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def no_ninja(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", no_ninja)
    with pytest.warns(UserWarning, match="rows kernel did not build .*Ninja is required.*torch's and oneDNN's"):
        assert rows._load(rows.ROWS, tmp_path) is False


def test_a_thread_asking_while_another_builds_computes_without_it(monkeypatch):
    monkeypatch.setattr(rows, "_LOADED", [])
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(rows.shutil, "which", lambda name: "/usr/bin/c++")
    with rows._BUILDING:  # another thread is building
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert rows_kernel() is False
    assert rows._LOADED == []  # not decided: the builder decides


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512" or shutil.which(rows._compiler()) is None,
                    reason="the kernel builds on AVX-512 with a C++ compiler only")
def test_the_library_builds_where_it_can():
    """A source that did not compile fell back with a warning, every test of the library skipped and the suite
    passed: here, with the CPU and the compiler it needs, it must have built (bf16 too where the CPU has it)."""
    assert rows_kernel(), "the rows library did not build: see the warning above for the compiler's error"
    assert bf16_kernel() == torch.cpu._is_avx512_bf16_supported()


def test_avx2_alone_builds_the_library_on_its_own_kernel_and_less_builds_nothing(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert rows.for_this_cpu() is rows.AVX2  # built and tested with AVX-512 masked: test_avx2_kernel.py
    assert rows.build_key() == rows.build_key(rows.AVX2) != rows.build_key(rows.ROWS)
    assert set(rows.ROWS.sources) ^ set(rows.AVX2.sources) == {rows.ROWS.sources[1], rows.AVX2.sources[1]}
    monkeypatch.setattr(rows, "_LOADED", [])
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert rows_kernel() is False
