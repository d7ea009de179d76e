"""Counting the points where the host would wait for the device: reads of a value (`.item()`, `.tolist()`,
`bool()`, `int()`, ...), data-dependent shapes (`nonzero`, boolean-mask indexing) and blocking copies (`.cpu()`,
`torch.tensor(...)` onto a device). A CPU test sees the same calls a CUDA run would make, so it counts them there."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy", "tensor",
         "masked_select", "unique", "argwhere"}


def _masked(args) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


class SyncCounter(TorchFunctionMode):
    """`with SyncCounter() as syncs: ...` then `syncs.count`, `syncs.calls` (the names, in order)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    @property
    def count(self) -> int:
        return len(self.calls)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS or (name in ("__getitem__", "__setitem__") and _masked(args)) or \
                (name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else None, torch.Tensor)):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))
