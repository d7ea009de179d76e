"""The memory roofline of a decoding step, measured in the run whose decodings it judges.

Why: a plain step of a small-batch decoder reads every weight of the target once and computes little beside, so
no plain decoding runs faster than (read bandwidth) / (weight bytes a step reads) tokens/s: the floor rate. A
plain decoding far below it is handicapped (its products do not stream the weights at the memory's rate), and a
speedup measured over it credits speculation with that handicap. A speedup is tau x t(plain step) / t(draft +
verify a block); a block reads the same weights as one step, so only a slow plain step lets it exceed tau.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from hf_eagle31.backends.cpu import pages, routes
from hf_eagle31.tuning import best_of

COUNTED = ("every parameter of the target but the input embedding table, of which a step reads one row (an LM head "
           "tied to it is read whole, counted once); not buffers, the attention cache or the drafter")


def last_level_cache_bytes(device: torch.device) -> int:
    """The largest cache of the device (CUDA's L2, the CPU's highest level as Linux reports it; 0 if unknown)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    return routes.last_level_cache()


@torch.no_grad()
def read_bandwidth(device: torch.device | str = "cpu", repeats: int = 10) -> float:
    """Bytes per second the device reads from memory on the threads torch computes with: the best of `repeats`
    sums over an fp32 buffer of several last-level caches (`routes.streamed_bytes`, as the CPU's routes time their
    products over), on 2 MiB pages where Linux puts it there (`pages.collapse`, as the products put the weights).

    A sum reads every byte once and computes next to nothing, as a decoding step streams its weights; the best
    of several, because a shared machine only ever slows a read down. On 2 MiB pages, because on 4 KiB ones the
    reads wait on the TLB and the prefetchers stop at every page: on a 2-core AMD EPYC VM a sum over 4 KiB pages read
    52-58 GB/s where the same sum over 2 MiB pages read 64-70, as fast as the rows kernel's one-row product streamed
    the same bytes; the floor of a 4 KiB probe was the page tables', not the memory's.
    """
    device = torch.device(device)
    buffer = torch.ones(routes.streamed_bytes(last_level_cache_bytes(device)) // 4, device=device)
    if device.type == "cpu":
        pages.collapse([buffer])
    return buffer.nbytes / best_of(buffer.sum, repeats)


def step_bytes(model: nn.Module) -> int:
    """Bytes of weights one plain decoding step of `model` reads (what `COUNTED` says)."""
    table = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is table
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not table or tied)


@dataclass(frozen=True)
class Roofline:
    """A step's weight bytes against the machine's read bandwidth: the fastest a plain step can go."""

    bandwidth: float  # bytes per second
    step_bytes: int
    dtype: str

    @classmethod
    def measure(cls, model: nn.Module, earlier: Iterable[float] = ()) -> Roofline:
        """The roofline at the fastest of this `read_bandwidth` and those measured `earlier` in the run.

        Why: a shared host's read bandwidth moves from one minute to the next (30 to 80 GB/s on one VM), and a floor
        probed at a slow moment would put a step timed at a fast one above it (a plain decoding at 1.06 of it)."""
        bandwidth = max([read_bandwidth(model.device), *earlier])
        return cls(bandwidth, step_bytes(model), str(model.dtype).removeprefix("torch."))

    @property
    def floor_seconds(self) -> float:
        """The least a plain step can take: its weights read once at the measured bandwidth."""
        return self.step_bytes / self.bandwidth

    @property
    def floor_rate(self) -> float:
        """Tokens per second of plain decoding at the floor."""
        return 1.0 / self.floor_seconds

    def of_floor(self, tokens_per_second: float, bandwidth: float | None = None) -> float:
        """A decoding's tokens/s over the floor rate (at `bandwidth`, this roofline's by default): about 1 at most for
        a plain one, above 1 only by speculating."""
        return tokens_per_second * self.step_bytes / (bandwidth or self.bandwidth)

    def describe(self) -> str:
        return (f"read bandwidth {self.bandwidth / 1e9:.1f} GB/s, {self.step_bytes / 1e6:.0f} MB of {self.dtype} "
                f"weights a step: floor {self.floor_seconds * 1000:.1f} ms/token, {self.floor_rate:.1f} tokens/s")

    def as_dict(self) -> dict:
        return {"bandwidth_bytes_per_second": self.bandwidth, "step_bytes": self.step_bytes, "counted": COUNTED,
                "dtype": self.dtype, "floor_seconds_per_token": self.floor_seconds,
                "floor_tokens_per_second": self.floor_rate}


def speedup_claim(speedup: float, tau: float, baseline: str, baseline_of_floor: float | None = None) -> str:
    """The speedup over the best plain decoding `baseline`, said as a result only where it does not exceed tau;
    above tau, a warning that the baseline is handicapped in its place (see the module's docstring)."""
    said = f"speedup over the best plain decoding ({baseline}): {speedup:.2f}x"
    if speedup <= tau:
        return said
    rate = "" if baseline_of_floor is None else f" ({baseline_of_floor:.0%} of the floor rate)"
    return (f"WARNING: {said} exceeds tau {tau:.2f}: the plain baseline runs below the memory's rate{rate}, "
            "so this is not a result")
