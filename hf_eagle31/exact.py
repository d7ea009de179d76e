"""Exact verification (`verify_mode="exact"`): every verify block token computed the way a one-token decode step
computes it, so the logits are bit-identical to plain decoding on any device and in any dtype.

Two things differ from one batched forward over the block: the attention (each node runs the target's own
attention with a single query over exactly the keys a decode step at its position would see:
`decode_equivalent_attention`), and the linear layers (every `F.linear` one block position at a time over the
batch plain decoding runs: `RowByRowLinear`, entered around the verify forward by `exact_mode`; bitsandbytes
layers, whose own forward takes another path for one token, run their whole forward position by position:
`OwnForwardByPosition`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_eagle31.verify_plan import VerifyPlan, additive_mask


def decode_equivalent_attention(module, query, key, value, plan: VerifyPlan, window: int | None, scaling, dropout,
                                attention: Callable = sdpa_attention_forward, **kwargs):
    """The verify block's attention computed the way one-token decoding computes it.

    Why: one batched attention over the block sums in a different order than a decode step does,
    which can flip a near-tied argmax (often, in bf16). Each node instead runs the target's own
    `attention` with a single query over exactly the keys a decode step at its position would see
    (`VerifyPlan.held_keys`: the cached keys, only the last `window - 1` of them in a sliding-window
    cache layer, then its ancestors in order), with the mask that step would get: transformers
    skips the SDPA mask of a decode step unless the prompts are padded or the keys fill the window;
    eager attention always gets one. Each row of a batch runs alone, over its keys without the
    batch's holes, as plain batched decoding computes each row of its one attention call. A
    contiguous run of keys is a slice of the cache (no copy).
    """
    n = query.shape[2]
    past = plan.past(key.shape[2])
    eager = attention is not sdpa_attention_forward
    masks = plan.layer_mask(key.shape[2], window)
    out = query.new_empty(query.shape[0], n, query.shape[1], value.shape[3])
    for row, node in itertools.product(range(query.shape[0]), range(n)):
        held = plan.held_keys(row, node, past, getattr(module, "layer_idx", None))
        first, count = int(held[0]), held.shape[0]
        if int(held[-1]) - first + 1 == count:
            held = slice(first, first + count)
        keys, values = key[row : row + 1, :, held], value[row : row + 1, :, held]
        mask = None
        if eager or plan.padded or (window is not None and count >= window):
            seen = masks[row, node : node + 1, held]
            mask = (additive_mask(seen, query.dtype) if eager else seen)[None, None]
        attended, _ = attention(module, query[row : row + 1, :, node : node + 1], keys, values, mask,
                                scaling=scaling, dropout=dropout, **kwargs)
        out[row, node] = attended[0, 0]
    return out, None


class RowByRowLinear(TorchFunctionMode):
    """Inside an "exact" verify forward, every linear layer runs one block position at a time, over
    `batch_size` rows.

    Why: a matrix multiply over n rows is not bit-identical, row for row, to n one-row multiplies on
    most backends (MKL and oneDNN on CPU, cuBLAS on CUDA choose other kernels and reduction orders by
    shape), and plain decoding multiplies one token of each of its `batch_size` rows at once (rows
    that finished included): each position is computed in that shape, with zero rows for the rows
    this batch no longer has. Everything else in a decoder layer (norms, rotary, activations) works
    row by row already.
    """

    def __init__(self, batch_size: int = 1):
        super().__init__()
        self.batch_size = batch_size

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return self.by_position(func, args[0], args[1:], kwargs)
        return func(*args, **kwargs)

    def by_position(self, func: Callable, rows: torch.Tensor, args, kwargs) -> torch.Tensor:
        """`func(rows, *args, **kwargs)` one block position at a time."""
        if rows.dim() < 2 or rows.shape[-2] == 1:
            return func(rows, *args, **kwargs)
        return torch.cat([self._position(func, rows[..., i : i + 1, :], args, kwargs)
                          for i in range(rows.shape[-2])], -2)

    def _position(self, func, position: torch.Tensor, args, kwargs) -> torch.Tensor:
        missing = self.batch_size - position.shape[0] if position.dim() == 3 else 0
        if missing <= 0:
            return func(position, *args, **kwargs)
        padded = torch.cat([position, position.new_zeros(missing, *position.shape[1:])])
        return func(padded, *args, **kwargs)[: position.shape[0]]


_ROW_BY_ROW = threading.local()  # the mode is entered per thread (torch keeps its mode stack per thread)


@contextlib.contextmanager
def exact_mode(plan: VerifyPlan):
    """Around an "exact" plan's verify forward: `RowByRowLinear` in this thread (nothing for other plans)."""
    if plan.mode != "exact":
        yield
        return
    _ROW_BY_ROW.mode = mode = RowByRowLinear(plan.batch_size)
    try:
        with mode:
            yield
    finally:
        _ROW_BY_ROW.mode = None


class OwnForwardByPosition:
    """Linear layers with a forward of their own (bitsandbytes' 4- and 8-bit layers) run one block
    position at a time in an "exact" verify forward, their whole forward and not only the `F.linear`
    it may call.

    Why: bitsandbytes multiplies one token by a 4-bit weight with a fused kernel of its own (on CUDA)
    and several tokens by the dequantized weight through `F.linear`: split below its forward, each
    position would still take the several-token path, which one-token decoding never does.
    """

    def __init__(self, target: nn.Module):
        self.layers = [m for m in target.modules() if isinstance(m, nn.Linear) and type(m).forward is not nn.Linear.forward]
        self.own = [vars(m).get("forward") for m in self.layers]  # an instance's forward (accelerate's hooks) comes back
        for layer in self.layers:
            layer.forward = functools.partial(_forward_by_position, layer.forward)

    def remove(self) -> None:
        for layer, own in zip(self.layers, self.own):
            if own is None:
                del layer.forward
            else:
                layer.forward = own


def _forward_by_position(forward: Callable, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    mode = getattr(_ROW_BY_ROW, "mode", None)
    return forward(x, *args, **kwargs) if mode is None else mode.by_position(forward, x, args, kwargs)
