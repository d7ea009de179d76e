"""Triton kernel for `tree_attention`: a block of new tokens against a KV cache with a masked tail.

Flash-attention style: each program owns a block of query rows, streams the cache in key blocks and
keeps an online softmax in fp32. The prefix (every key before the tail) is read without any mask;
only the small `[n, m]` tail mask is loaded, for the last `m` keys.

Grouped-query attention is handled by packing the `q_heads // kv_heads` query heads that share a
KV head into the rows of one program (row `r` is head `r // n`, token `r % n` of the group), so each
KV block is loaded once per group and repeated KV is never materialised.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _attend_blocks(
    acc, m_i, l_i, q,
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    mask_base, stride_mask_m,
    start, end, prefix, offs_n, offs_d, qk_scale,
    TAIL: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold keys `[start, end)` into the running softmax; `TAIL` reads the tail mask for them."""
    for block_start in range(start, end, BLOCK_N):
        cols = block_start + offs_n
        col_ok = cols < end
        k = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd, mask=col_ok[None, :], other=0.0)
        k = k.to(DOT_DTYPE)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        visible = col_ok[None, :]
        if TAIL:
            tail = tl.load(mask_base + (cols - prefix)[None, :] * stride_mask_m, mask=visible, other=0)
            visible = visible & (tail != 0)
        scores = tl.where(visible, scores, float("-inf"))
        # m_i starts finite, so a row with no visible key so far gives exp2(-inf) = 0, never NaN.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=col_ok[:, None], other=0.0)
        p = p.to(v.dtype).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_mask_n, stride_mask_m,
    kv_heads, group, n, kv_len, tail_len, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    block_m = tl.program_id(0)
    batch = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads

    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group * n
    q_head = kv_head * group + rows // n
    token = rows % n
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    q_rows = batch.to(tl.int64) * stride_qb + q_head.to(tl.int64) * stride_qh + token * stride_qn
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
    q = q.to(DOT_DTYPE)
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    mask_base = mask_ptr + token[:, None] * stride_mask_n

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    prefix = kv_len - tail_len
    acc, m_i, l_i = _attend_blocks(
        acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        mask_base, stride_mask_m, 0, prefix, prefix, offs_n, offs_d, qk_scale,
        False, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
    )
    acc, m_i, l_i = _attend_blocks(
        acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        mask_base, stride_mask_m, prefix, kv_len, prefix, offs_n, offs_d, qk_scale,
        True, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
    )
    # A row that sees no key at all gets zeros, as torch's scaled_dot_product_attention gives.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = batch.to(tl.int64) * stride_ob + q_head.to(tl.int64) * stride_oh + token * stride_on
    o_ptrs = out_ptr + o_rows[:, None] + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# Triton's CPU interpreter (TRITON_INTERPRET=1, used by the tests) multiplies bf16 bit patterns as
# integers in tl.dot (seen in triton 3.9), so there the dots take operands already rounded to the
# input dtype and widened to fp32: the same multiplications, computed exactly.
_INTERPRETED = not isinstance(_tree_attention_kernel, triton.runtime.JITFunction)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _check_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tail_mask: torch.Tensor | None) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"query, key and value must be 4-D [batch, heads, tokens, head_dim]; got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}."
        )
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape.")
    if query.shape[0] != key.shape[0] or query.shape[3] != key.shape[3]:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} differ in batch or head_dim.")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"q_heads ({query.shape[1]}) must be a multiple of kv_heads ({key.shape[1]}).")
    if query.dtype not in SUPPORTED_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(
            f"query, key and value must share one dtype among {SUPPORTED_DTYPES}; "
            f"got {query.dtype}, {key.dtype}, {value.dtype}."
        )
    if query.shape[3] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {query.shape[3]} is not supported by the Triton kernel ({SUPPORTED_HEAD_DIMS}).")
    if key.device != query.device or value.device != query.device:
        raise ValueError(f"query, key and value must share one device; got {query.device}, {key.device}, {value.device}.")
    if query.shape[2] > key.shape[2]:
        raise ValueError(f"{query.shape[2]} queries but the cache holds only {key.shape[2]} keys.")
    if tail_mask is not None:
        if tail_mask.dtype != torch.bool or tail_mask.dim() != 2 or tail_mask.shape[0] != query.shape[2]:
            raise ValueError(
                f"tail_mask must be a bool [n={query.shape[2]}, m] tensor; got {tail_mask.dtype} "
                f"{tuple(tail_mask.shape)}."
            )
        if tail_mask.shape[1] > key.shape[2]:
            raise ValueError(f"tail_mask covers {tail_mask.shape[1]} keys but the cache holds only {key.shape[2]}.")


def tree_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tail_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Same contract as `tree_attention_reference`; inputs may be strided views (e.g. cache slices)."""
    _check_inputs(query, key, value, tail_mask)
    batch, q_heads, n, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if tail_mask is None:
        tail_mask = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
    mask = tail_mask.to(device=query.device, dtype=torch.uint8)
    out = query.new_empty(batch, q_heads, n, head_dim)
    if out.numel() == 0:
        return out

    group = q_heads // kv_heads
    block_m = min(64, max(16, triton.next_power_of_2(group * n)))
    block_n = 32 if query.dtype == torch.float32 else 64
    scale = head_dim**-0.5 if scale is None else scale
    grid = (triton.cdiv(group * n, block_m), batch * kv_heads)
    device_guard = torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext()
    with device_guard:
        _tree_attention_kernel[grid](
            query, key, value, mask, out,
            *query.stride(), *key.stride(), *value.stride(), *out.stride(), *mask.stride(),
            kv_heads, group, n, kv_len, mask.shape[1], scale * math.log2(math.e),
            HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
            DOT_DTYPE=tl.float32 if _INTERPRETED else _TL_DTYPES[query.dtype],
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # fp32 stays exact; 16-bit ignores it
            num_warps=4, num_stages=2,
        )
    return out
