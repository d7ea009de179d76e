"""The Triton tree-attention kernel against the torch reference, and the reference against a naive loop.

The `test_interpreted_*` tests run the kernel on CPU through Triton's interpreter; `test_triton_interpreter_run`
starts them in a fresh process (see there). Tests marked `cuda` compile the kernel for a real GPU.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from hf_eagle31.drafting import DraftTree  # noqa: E402
from hf_eagle31.kernels.tree_attention import tree_attention, tree_attention_reference  # noqa: E402
from hf_eagle31.kernels.tree_attention_triton import tree_attention_triton  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRETED, reason="run by test_triton_interpreter_run in a fresh process")
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA GPU and the compiled kernel"
)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter run")
def test_triton_interpreter_run():
    """Runs this file's `test_interpreted_*` tests in a fresh process with TRITON_INTERPRET=1.

    Triton reads the variable when `@triton.jit` decorates a function, including its own library
    functions (`tl.zeros`, `tl.max`, ...) decorated when triton is first imported, so it has to be
    set before that import: too late inside a pytest session that may already hold triton.
    """
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_interpreted_", __file__],
        cwd=Path(__file__).parents[1],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout, run.stdout[-2000:]


def random_tree_mask(count: int, generator: torch.Generator) -> torch.Tensor:
    """Ancestor mask of a random tree in level order: every node hangs under an earlier one."""
    parents, depths = [-1], [0]
    for node in range(1, count):
        parents.append(int(torch.randint(0, node, (1,), generator=generator)))
        depths.append(depths[parents[-1]] + 1)
    tree = DraftTree(torch.zeros(count, dtype=torch.long), torch.tensor(parents), torch.tensor(depths))
    return tree.ancestor_mask()


def make_tail_mask(kind: str, generator: torch.Generator) -> tuple[int, torch.Tensor | None]:
    """(number of queries, tail mask) for each attention pattern decoding uses."""
    if kind == "causal":  # prefill or a chain: tail_mask=None
        return 9, None
    if kind == "decode":
        return 1, None
    if kind == "tree":  # verification: the tail is the tree block itself
        return 40, random_tree_mask(40, generator)
    if kind == "levels":  # drafting: the tail holds every level so far, the queries are the newest level
        return 12, random_tree_mask(33, generator)[-12:]
    raise ValueError(kind)


def make_inputs(batch, q_heads, kv_heads, n, kv_len, head_dim, dtype, generator):
    query = torch.randn(batch, q_heads, n, head_dim, generator=generator).to(dtype)
    key = torch.randn(batch, kv_heads, kv_len, head_dim, generator=generator).to(dtype)
    value = torch.randn(batch, kv_heads, kv_len, head_dim, generator=generator).to(dtype)
    return query, key, value


def assert_matches_reference(out, query, key, value, tail_mask, scale=None):
    expected = tree_attention_reference(query.double(), key.double(), value.double(), tail_mask, scale)
    assert out.dtype == query.dtype and out.shape == query.shape
    tol = TOLERANCE[query.dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@interpreter_only
@pytest.mark.parametrize("kind", ["causal", "decode", "tree", "levels"])
@pytest.mark.parametrize("prefix", [0, 250])
@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (4, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_interpreted_kernel_matches_reference(head_dim, q_heads, kv_heads, prefix, kind):
    generator = torch.Generator().manual_seed(head_dim + 10 * q_heads + prefix)
    n, tail_mask = make_tail_mask(kind, generator)
    kv_len = prefix + (n if tail_mask is None else tail_mask.shape[1])
    query, key, value = make_inputs(2, q_heads, kv_heads, n, kv_len, head_dim, torch.float32, generator)
    assert_matches_reference(tree_attention_triton(query, key, value, tail_mask), query, key, value, tail_mask)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_interpreted_kernel_half_precision(head_dim, dtype):
    generator = torch.Generator().manual_seed(head_dim)
    n, tail_mask = make_tail_mask("levels", generator)
    query, key, value = make_inputs(1, 4, 1, n, 70 + tail_mask.shape[1], head_dim, dtype, generator)
    assert_matches_reference(tree_attention_triton(query, key, value, tail_mask), query, key, value, tail_mask)


@interpreter_only
@pytest.mark.parametrize("head_dim", [16, 32])
def test_interpreted_kernel_small_head_dims_and_explicit_scale(head_dim):
    """Tiny test models use head_dim 16; the drafter passes its own softmax scale."""
    generator = torch.Generator().manual_seed(head_dim)
    n, tail_mask = make_tail_mask("tree", generator)
    query, key, value = make_inputs(1, 4, 2, n, 20 + n, head_dim, torch.float32, generator)
    out = tree_attention_triton(query, key, value, tail_mask, scale=0.7)
    assert_matches_reference(out, query, key, value, tail_mask, scale=0.7)


@interpreter_only
def test_interpreted_kernel_reads_strided_views():
    """A query transposed from `[batch, n, heads, dim]` and a cache slice of a longer buffer, no copies."""
    generator = torch.Generator().manual_seed(0)
    batch, q_heads, kv_heads, n, kv_len, head_dim = 2, 4, 2, 13, 60, 64
    query = torch.randn(batch, n, q_heads, head_dim, generator=generator).transpose(1, 2)
    buffer = torch.randn(2, batch, kv_len + 40, kv_heads, head_dim, generator=generator)
    key, value = (t[:, :kv_len].transpose(1, 2) for t in buffer)  # [batch, kv_heads, kv_len, dim] views
    tail_mask = random_tree_mask(n, generator)
    assert not (query.is_contiguous() or key.is_contiguous() or value.is_contiguous())
    assert_matches_reference(tree_attention_triton(query, key, value, tail_mask), query, key, value, tail_mask)


@interpreter_only
def test_interpreted_kernel_row_without_visible_keys_is_zero():
    """Same as torch's SDPA: a query that may see nothing gets zeros, not NaN."""
    generator = torch.Generator().manual_seed(1)
    query, key, value = make_inputs(1, 2, 1, 3, 3, 16, torch.float32, generator)
    tail_mask = torch.tensor([[True, False, False], [False, False, False], [True, False, True]])
    out = tree_attention_triton(query, key, value, tail_mask)
    assert out[:, :, 1].eq(0).all()
    assert_matches_reference(out, query, key, value, tail_mask)


@interpreter_only
def test_interpreted_kernel_detects_wrong_mask():
    """The comparison can fail: dropping one ancestor link changes the output past the tolerance."""
    generator = torch.Generator().manual_seed(2)
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 0, 0, 1]]).bool()
    query, key, value = make_inputs(1, 2, 2, 5, 5, 16, torch.float32, generator)
    broken = mask.clone()
    broken[3, 1] = False
    with pytest.raises(AssertionError):
        assert_matches_reference(tree_attention_triton(query, key, value, broken), query, key, value, mask)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(head_dim=48), "head_dim 48"),
        (dict(q_heads=3), "multiple of kv_heads"),
        (dict(mask_width=99), "cache holds only"),
        (dict(mask_dtype=torch.float32), "bool"),
    ],
)
def test_kernel_rejects_bad_input(change, message):
    head_dim, q_heads = change.get("head_dim", 16), change.get("q_heads", 4)
    query, key, value = make_inputs(1, q_heads, 2, 4, 10, head_dim, torch.float32, torch.Generator())
    tail_mask = torch.ones(4, change.get("mask_width", 4), dtype=change.get("mask_dtype", torch.bool))
    with pytest.raises(ValueError, match=message):
        tree_attention_triton(query, key, value, tail_mask)


def naive_attention(query, key, value, tail_mask, scale):
    """softmax(q k^T) v one query at a time in float64, over the keys the mask lets it see."""
    batch, q_heads, n, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    prefix = kv_len - tail_mask.shape[1]
    out = torch.zeros(batch, q_heads, n, head_dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            kv = h // (q_heads // kv_heads)
            for i in range(n):
                keys = [j for j in range(kv_len) if j < prefix or tail_mask[i, j - prefix]]
                scores = torch.stack([query[b, h, i].double() @ key[b, kv, j].double() * scale for j in keys])
                weights = scores.softmax(0)
                out[b, h, i] = sum(w * value[b, kv, j].double() for w, j in zip(weights, keys))
    return out


@pytest.mark.parametrize("kind", ["causal", "tree", "levels"])
def test_reference_matches_naive_loop(kind):
    generator = torch.Generator().manual_seed(3)
    n, tail_mask = make_tail_mask(kind, generator)
    explicit = torch.ones(n, n, dtype=torch.bool).tril() if tail_mask is None else tail_mask
    query, key, value = make_inputs(1, 4, 2, n, 7 + explicit.shape[1], 16, torch.float32, generator)
    expected = naive_attention(query, key, value, explicit, 16**-0.5)
    out = tree_attention_reference(query, key, value, tail_mask)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_compiled_kernel_on_gpu(head_dim, dtype):
    """Llama-like GQA (4 query heads per KV head), a long prefix and a 64-node tree."""
    generator = torch.Generator().manual_seed(head_dim)
    tail_mask = random_tree_mask(64, generator)
    query, key, value = (t.cuda() for t in make_inputs(2, 32, 8, 64, 3000, head_dim, dtype, generator))
    assert_matches_reference(tree_attention(query, key, value, tail_mask), query, key, value, tail_mask)


@pytest.mark.cuda
@requires_cuda
def test_dispatcher_falls_back_for_unsupported_head_dim():
    generator = torch.Generator().manual_seed(0)
    query, key, value = (t.cuda() for t in make_inputs(1, 4, 2, 5, 20, 48, torch.float32, generator))
    assert_matches_reference(tree_attention(query, key, value), query, key, value, None)
