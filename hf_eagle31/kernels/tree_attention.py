"""Attention of a block of new tokens against a KV cache whose tail is masked by an explicit boolean mask.

One function covers every attention pattern speculative decoding needs:
  * causal prefill or a plain decode step (the tail mask is lower-triangular),
  * tree verification (the tail is the tree block, the mask says which nodes are ancestors),
  * tree drafting (the tail holds every tree level drafted so far).
Keys before the tail are visible to every query, so no dense `(prefix + n)^2` mask is ever built.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F


def require_triton() -> None:
    """The Triton kernel's dependency is an extra: a missing one is named with its install command."""
    if importlib.util.find_spec("triton") is None:
        raise ModuleNotFoundError("the Triton tree-attention kernel (verify_mode='kernel') needs triton, which is not "
                                  "installed: pip install 'hf-eagle31[kernels]'")


def tree_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tail_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The torch oracle for the Triton kernel, and the CPU path.

    Args:
        query: `[batch, q_heads, n, head_dim]`, the new tokens.
        key, value: `[batch, kv_heads, S, head_dim]`, the cache including the new tokens' entries.
            `q_heads` must be a multiple of `kv_heads` (grouped-query attention).
        tail_mask: `[n, m]` bool, True where query `i` may attend to key `S - m + j`. Keys before
            `S - m` are visible to all queries. `None` means causal over the last `n` keys.
            `[batch, n, m]` gives each row its own (the rows of a batch hold different trees).
        scale: softmax scale, `head_dim ** -0.5` by default.

    Returns:
        `[batch, q_heads, n, head_dim]`.
    """
    n, kv_len = query.shape[-2], key.shape[-2]
    tail_mask = torch.ones(n, n, dtype=torch.bool).tril() if tail_mask is None else tail_mask
    tail_mask = tail_mask.to(query.device)
    prefix = kv_len - tail_mask.shape[-1]
    if prefix < 0:
        raise ValueError(f"tail_mask covers {tail_mask.shape[-1]} keys but the cache holds only {kv_len}.")
    mask = torch.cat([tail_mask.new_ones(*tail_mask.shape[:-1], prefix), tail_mask], dim=-1)
    mask = mask[:, None] if mask.dim() == 3 else mask[None, None]
    return grouped_attention(query, key, value, fold_mask(mask, query.shape[1] // key.shape[1]), scale)


def fold_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """A `[B, 1, n, S]` mask (boolean or additive) for `grouped_attention`: `[B, 1, groups * n, S]`, once per
    query head of a group."""
    if groups == 1:
        return mask
    return mask.expand(-1, groups, -1, -1).reshape(mask.shape[0], 1, groups * mask.shape[2], mask.shape[3])


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                      scale: float | None, attend: Callable | None = None) -> torch.Tensor:
    """torch's SDPA with the query heads that share a key/value head folded into one longer block of queries
    (`mask` folded by `fold_mask`); `[batch, q_heads, n, v_head_dim]`. `attend(query, key, value, mask, scale)`,
    where given, computes the folded attention instead of SDPA (the CPU backend's kernel, `backends/cpu/lean.py`).

    Why: every query row gets the scores SDPA's `enable_gqa` gives it, but a CPU runs it faster (the keys are
    read once per group, not once per query head; docs/benchmarks.md), and on CUDA a masked `enable_gqa` call
    falls back to the math kernel where this one keeps a fused kernel.
    """
    batch, heads, n, size = query.shape
    kv_heads = key.shape[1]
    folded = query.reshape(batch, kv_heads, heads // kv_heads * n, size)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scale) if attend is None else \
        attend(folded, key, value, mask, scale)
    return out.view(batch, heads, n, out.shape[-1])


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tail_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA for the head dims and dtypes it covers (one mask for every row),
    else the torch reference (in fp32 for one bf16 query on a CPU).

    Same contract as the reference.
    """
    if query.is_cuda and (tail_mask is None or tail_mask.dim() == 2):
        require_triton()
        from .tree_attention_triton import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, tree_attention_triton

        if query.shape[-1] in SUPPORTED_HEAD_DIMS and query.dtype in SUPPORTED_DTYPES:
            return tree_attention_triton(query, key, value, tail_mask, scale)
    if query.shape[-2] == 1 and query.dtype == torch.bfloat16 and query.device.type == "cpu":
        # torch's CPU kernel takes several times longer on one bf16 query than on one fp32 query, its upcast
        # included (docs/benchmarks.md): a chain's draft levels are single queries.
        return tree_attention_reference(query.float(), key.float(), value.float(), tail_mask, scale).bfloat16()
    return tree_attention_reference(query, key, value, tail_mask, scale)
