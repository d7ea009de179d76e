"""Run decoding methods on the same prompts in one process and measure them the same way.

Every method is timed over the same prompts with the same `max_new_tokens`, after one untimed
warm-up generation. "tau" is counted uniformly for all methods from the target's forward calls
(a forward hook): new tokens after the first, per target forward after the prefill, so the target
alone scores 1.0 and any speculative method scores what it saves.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.tuning import speculation_settings


@dataclass
class Method:
    """One way of decoding: extra `generate` kwargs, and speculation settings for an EAGLE drafter."""

    name: str
    generate_kwargs: dict = field(default_factory=dict)
    speculation: dict = field(default_factory=dict)

    @property
    def drafter(self) -> Eagle3DraftModel | None:
        drafter = self.generate_kwargs.get("assistant_model")
        return drafter if isinstance(drafter, Eagle3DraftModel) else None


@dataclass
class MethodResult:
    name: str
    new_tokens: int
    seconds: float
    target_forwards: int
    peak_memory_bytes: int | None
    identical_to_target: bool | None
    reached: list[int] = field(default_factory=list)  # draft tokens whose path survived to their depth, per depth
    accepted: list[int] = field(default_factory=list)  # of those, how many were accepted
    speculation: dict = field(default_factory=dict)
    speedup: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds

    @property
    def acceptance_per_depth(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached)]

    def acceptance_from(self, depth: int) -> float | None:
        """Acceptance pooled over every draft token at `depth` (1-based) or deeper; None if none got there."""
        reached = sum(self.reached[depth - 1 :])
        return sum(self.accepted[depth - 1 :]) / reached if reached else None

    def tau(self, prompts: int) -> float:
        return (self.new_tokens - prompts) / max(self.target_forwards - prompts, 1)


@contextmanager
def peak_memory(device: torch.device):
    """Peak memory during the block: CUDA's allocator peak, or the process RSS peak sampled on CPU (Linux)."""
    result: dict[str, int | None] = {"bytes": None}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize()
        result["bytes"] = torch.cuda.max_memory_allocated(device)
        return
    if not os.path.exists("/proc/self/statm"):
        yield result
        return
    page = os.sysconf("SC_PAGE_SIZE")
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            with open("/proc/self/statm") as statm:
                peak[0] = max(peak[0], int(statm.read().split()[1]) * page)
            stop.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield result
    finally:
        stop.set()
        sampler.join()
        result["bytes"] = peak[0]


@contextmanager
def count_forwards(model: PreTrainedModel):
    calls = [0]
    handle = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        yield calls
    finally:
        handle.remove()


def run_method(
    target: PreTrainedModel,
    prompts: list[torch.Tensor],
    method: Method,
    max_new_tokens: int,
    reference: list[torch.Tensor] | None = None,
    progress: bool = True,
) -> tuple[MethodResult, list[torch.Tensor]]:
    """Greedy-decode every prompt with `method`; compare with `reference` outputs when given."""
    if method.drafter is None:
        return _run_method(target, prompts, method, max_new_tokens, reference, progress)
    with speculation_settings(method.drafter, **method.speculation):
        return _run_method(target, prompts, method, max_new_tokens, reference, progress)


def _run_method(target, prompts, method, max_new_tokens, reference, progress):
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, **method.generate_kwargs)
    target.generate(prompts[0], **{**kwargs, "max_new_tokens": min(8, max_new_tokens)})  # warm-up
    outputs, seconds, reached, accepted = [], 0.0, [], []
    with peak_memory(target.device) as memory, count_forwards(target) as forwards:
        for prompt in tqdm(prompts, desc=method.name, leave=False, disable=not progress):
            started = time.perf_counter()
            out = target.generate(prompt, **kwargs)
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            seconds += time.perf_counter() - started
            outputs.append(out)
            if method.drafter is not None:
                stats = method.drafter.speculation_stats
                reached = _add(reached, stats.reached)
                accepted = _add(accepted, stats.accepted)
    new_tokens = sum(o.shape[1] - p.shape[1] for o, p in zip(outputs, prompts))
    identical = None if reference is None else all(torch.equal(o, r) for o, r in zip(outputs, reference))
    result = MethodResult(
        name=method.name,
        new_tokens=new_tokens,
        seconds=seconds,
        target_forwards=forwards[0],
        peak_memory_bytes=memory["bytes"],
        identical_to_target=identical,
        reached=reached,
        accepted=accepted,
        speculation=dict(method.speculation),
    )
    return result, outputs


def _add(total: list[int], more: list[int]) -> list[int]:
    width = max(len(total), len(more))
    return [(total[i] if i < len(total) else 0) + (more[i] if i < len(more) else 0) for i in range(width)]


def run_all(
    target: PreTrainedModel, prompts: list[torch.Tensor], methods: list[Method], max_new_tokens: int,
    progress: bool = True,
) -> list[MethodResult]:
    """Run `methods` in order; the first is the baseline every speedup and output is compared with."""
    results, reference = [], None
    for method in tqdm(methods, desc="methods", disable=not progress):
        result, outputs = run_method(target, prompts, method, max_new_tokens, reference, progress)
        reference = reference or outputs
        results.append(result)
    for result in results:
        result.speedup = result.tokens_per_second / results[0].tokens_per_second
    return results
