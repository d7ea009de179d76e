"""fp32 products of a few rows on a linear layer's own weights, built once per machine (rows_linear.cpp).

Why: on a CPU a verify forward multiplies 2-16 rows by every weight of the target, and a step is bound by
streaming the weights. torch's fp32 path (MKL) costs ~2 one-row products for 8 rows and oneDNN's packed
weights ~1.5 on a 2-core Xeon, since both compute the rows while the memory waits; this kernel reads each
weight once for up to 16 rows and prefetches the next into L2 while it multiplies (~1.0 one-row products for 2
rows, ~1.2 for 8; SmolLM2's compiled verify forward of 8 tokens 0.89 plain steps, of 16 1.15; docs/benchmarks.md),
on the weights as they are: nothing to pack, no second copy, and the target's own weights stay readable.
It is compiled with torch's C++ extension builder (a C++ compiler and ninja) on a CPU with AVX-512, the
first time a process asks for it (~22 s, then cached by torch); elsewhere `rows_kernel()` is False and the
packed path keeps oneDNN's layout.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_ROWS = 16  # more rows (a prompt's prefill) go to torch's GEMM, which wins once the weights are reused enough;
# from 24 rows torch's is as fast; one row goes to MKL's GEMV, a little faster than the kernel's


@functools.cache
def rows_kernel() -> bool:
    """Whether `torch.ops.hf_eagle31_rows.linear` is loaded: built here if this CPU has AVX-512 and a compiler."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512" or shutil.which(os.environ.get("CXX", "c++")) is None:
        return False
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None and importlib.util.find_spec("ninja") is not None:  # pip's ninja, off PATH
        import ninja                                                      # when the venv is not activated

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

    try:
        cpp_extension.load("hf_eagle31_rows", [str(Path(__file__).with_suffix(".cpp"))], is_python_module=False,
                           extra_cflags=["-O3", "-mavx512f", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except (RuntimeError, OSError, ImportError) as error:  # no ninja, a compiler that fails: oneDNN's layout instead
        warnings.warn(f"hf_eagle31: the fp32 rows kernel did not build ({error}); packing for oneDNN instead",
                      stacklevel=2)
        return False
    return True


def rows_linear(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """`x` times each of `weights` (fp32, `[N_i, K]`), the outputs side by side, plus `bias`: the kernel for 2 to
    `MAX_ROWS` rows, torch's for others."""
    if not 1 < x.numel() // x.shape[-1] <= MAX_ROWS:
        out = torch.cat([F.linear(x, weight) for weight in weights], dim=-1)
        return out if bias is None else out + bias
    return torch.ops.hf_eagle31_rows.linear(x, weights, bias)
