"""A fixed-shape draft replayed as a CUDA graph (`drafting.Replay`): captured once per shape and buffers, then each
step one `replay()` launches every kernel of every level and the tree's selection.

Why: a CUDA drafter is bound by launches, not arithmetic (an eager drafter forward spends little of its time
computing, and a depth-6 tree is six of them and the selection), and a graph launches them all at once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable

import torch


class GraphReplay:
    """One call's captured drafts. A capture reads the drafter state's buffers as they are when captured; a key
    names the shape and the buffers' version (`DraftCache.version`), so a draft after rows left or the cache grew
    is captured anew (and the stale captures are dropped)."""

    def __init__(self, warmups: int = 2):
        self.warmups = warmups
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, tuple, tuple]] = {}
        self.failed = False

    def __call__(self, draft: Callable[..., tuple], key: Hashable, inputs: tuple[torch.Tensor, ...]) -> tuple:
        if self.failed:
            return draft(*inputs)
        if key not in self.graphs:
            self.graphs = {old: entry for old, entry in self.graphs.items() if old[0] == key[0]}
            try:
                self.graphs[key] = self.capture(draft, inputs)
            except RuntimeError as error:  # an op CUDA cannot capture: the same draft, launched eagerly
                warnings.warn(f"the draft could not be captured as a CUDA graph ({str(error).splitlines()[0]}); "
                              "this call drafts eagerly (draft_mode='narrowed' skips the capture)", stacklevel=3)
                self.failed = True
                return draft(*inputs)
        graph, static_inputs, outputs = self.graphs[key]
        for buffer, value in zip(static_inputs, inputs):
            buffer.copy_(value)
        graph.replay()
        return tuple(None if out is None else out.clone() for out in outputs)  # the next replay overwrites them

    def capture(self, draft: Callable[..., tuple], inputs: tuple[torch.Tensor, ...]):
        static_inputs = tuple(value.clone() for value in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the capture (lazy inits, cuBLAS workspaces); writes only
            for _ in range(self.warmups):  # cache slots past the real entries, which the next draft overwrites
                draft(*static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = draft(*static_inputs)
        return graph, static_inputs, outputs
