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
from collections.abc import Callable
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
    speedup: float | None = None  # over the target's best plain decoding in this run (`best_plain`)
    speedup_default: float | None = None  # over plain `generate` at default settings (the first method)
    identical_prompts: int | None = None  # how many prompts' outputs equal the baseline's (None: not compared)
    step_seconds: float | None = None  # the EAGLE loop's drafting, verifying and plain steps (no prefill, packing)
    first_token_seconds: float | None = None  # each prompt's call for one new token (`first_token_seconds`), summed
    bandwidth: float | None = None  # bytes/s: the faster read bandwidth probed right before its calls and after them

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

    def decode_tokens_per_second(self, prompts: int) -> float | None:
        """The tokens after each prompt's first over the time after it: the rate of the decoding steps alone, the
        one the roofline's floor bounds (a step reads the weights once; the first token is the prefill's, which
        computes rather than streams). None where the first tokens were not timed."""
        if self.first_token_seconds is None or self.seconds <= self.first_token_seconds:
            return None
        return (self.new_tokens - prompts) / (self.seconds - self.first_token_seconds)


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
    """Target forwards, counted at the LM head: every forward runs it once, EAGLE's lean verify forward
    (backends/cpu/lean.py) too, which a hook on the model itself would turn off."""
    calls = [0]
    head = model.get_output_embeddings()
    counted = model if head is None else head
    handle = counted.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
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
    temperature: float = 0.0,
    probe: Callable[[], float] | None = None,
) -> tuple[MethodResult, list[torch.Tensor]]:
    """Decode every prompt with `method` (greedy, or sampled at `temperature` with a fixed seed per prompt);
    greedy outputs are compared with `reference` outputs when given; `probe`: the read bandwidth, measured right
    before the method's timed calls and after them (`MethodResult.bandwidth`)."""
    if method.drafter is None:
        return _run_method(target, prompts, method, max_new_tokens, reference, progress, temperature, probe)
    with speculation_settings(method.drafter, **method.speculation):
        return _run_method(target, prompts, method, max_new_tokens, reference, progress, temperature, probe)


SHAPE = ("speculation_mode", "num_assistant_tokens", "tree_top_k", "tree_depth", "tree_total_tokens")


def _run_method(target, prompts, method, max_new_tokens, reference, progress, temperature=0.0, probe=None):
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    kwargs = {**sampling, "max_new_tokens": max_new_tokens, **method.generate_kwargs}
    timed_generate(target, prompts[0], 0, {**kwargs, "max_new_tokens": min(8, max_new_tokens)})  # warm-up
    before = probe() if probe is not None else None
    first = first_token_seconds(target, prompts, kwargs)
    outputs, seconds, reached, accepted, steps = [], 0.0, [], [], 0.0
    with peak_memory(target.device) as memory, count_forwards(target) as forwards:
        for number, prompt in enumerate(tqdm(prompts, desc=method.name, leave=False, disable=not progress)):
            out, taken = timed_generate(target, prompt, number, kwargs)
            seconds += taken
            outputs.append(out)
            if method.drafter is not None:
                stats = method.drafter.speculation_stats
                reached = _add(reached, stats.reached)
                accepted = _add(accepted, stats.accepted)
                steps += stats.draft_seconds + stats.verify_seconds + stats.plain_seconds
    bandwidth = None if probe is None else max(before, probe())
    new_tokens = sum(o.shape[1] - p.shape[1] for o, p in zip(outputs, prompts))
    matches = None if reference is None or temperature > 0 else [torch.equal(o, r) for o, r in zip(outputs, reference)]
    used = method.drafter.generation_config if method.drafter is not None else None
    result = MethodResult(
        name=method.name,
        new_tokens=new_tokens,
        seconds=seconds,
        target_forwards=forwards[0],
        peak_memory_bytes=memory["bytes"],
        identical_to_target=None if matches is None else all(matches),
        identical_prompts=None if matches is None else sum(matches),
        step_seconds=steps if method.drafter is not None else None,
        first_token_seconds=first,
        bandwidth=bandwidth,
        reached=reached,
        accepted=accepted,
        speculation={name: getattr(used, name, None) for name in SHAPE} if used is not None else {},
    )
    return result, outputs


def timed_generate(target: PreTrainedModel, prompt: torch.Tensor, number: int, kwargs: dict
                   ) -> tuple[torch.Tensor, float]:
    """`target.generate` on the `number`-th prompt and the seconds it took. Seeded by `number`: sampling methods draw
    with the same seed per prompt. The prompts are unpadded: a mask of ones keeps transformers from reading a pad id
    inside the text as padding."""
    torch.manual_seed(number)
    started = time.perf_counter()
    out = target.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - started


def first_token_seconds(target: PreTrainedModel, prompts: list[torch.Tensor], kwargs: dict) -> float:
    """Seconds to each prompt's first new token, summed: a call for one token each (the prefill and whatever a call
    sets up), timed apart from the measured calls so that their rate after the first token can be told apart."""
    return sum(timed_generate(target, prompt, number, {**kwargs, "max_new_tokens": 1})[1]
               for number, prompt in enumerate(prompts))


def _add(total: list[int], more: list[int]) -> list[int]:
    width = max(len(total), len(more))
    return [(total[i] if i < len(total) else 0) + (more[i] if i < len(more) else 0) for i in range(width)]


def run_all(
    target: PreTrainedModel, prompts: list[torch.Tensor], methods: list[Method], max_new_tokens: int,
    progress: bool = True, temperature: float = 0.0, probe: Callable[[], float] | None = None,
) -> list[MethodResult]:
    """Run `methods` in order; the first is the baseline every speedup and output is compared with."""
    results, reference = [], None
    for method in tqdm(methods, desc="methods", disable=not progress):
        result, outputs = run_method(target, prompts, method, max_new_tokens, reference, progress, temperature,
                                     probe)
        reference = reference or outputs
        results.append(result)
    _speedups(results)
    return results


PLAIN = "target alone"  # the methods named so decode without speculation: the baselines


def best_plain(results: list[MethodResult]) -> MethodResult:
    """The fastest plain decoding of the run (default `generate`, `fast_decoding`): what a speedup is over."""
    return max((r for r in results if r.name.startswith(PLAIN)), key=lambda r: r.tokens_per_second,
               default=results[0])


def _speedups(results: list[MethodResult]) -> None:
    best = best_plain(results)
    for result in results:
        result.speedup = result.tokens_per_second / best.tokens_per_second
        result.speedup_default = result.tokens_per_second / results[0].tokens_per_second


def combine(runs: list[list[MethodResult]]) -> list[MethodResult]:
    """One result per method over several runs of the same methods (datasets): counts and times summed."""
    combined = []
    for same in zip(*runs):
        memory = [r.peak_memory_bytes for r in same if r.peak_memory_bytes is not None]
        identical, matches = [r.identical_to_target for r in same], [r.identical_prompts for r in same]
        steps, firsts = [r.step_seconds for r in same], [r.first_token_seconds for r in same]
        bandwidths = [r.bandwidth for r in same]
        reached, accepted = [], []
        for r in same:
            reached, accepted = _add(reached, r.reached), _add(accepted, r.accepted)
        combined.append(MethodResult(
            name=same[0].name, new_tokens=sum(r.new_tokens for r in same), seconds=sum(r.seconds for r in same),
            target_forwards=sum(r.target_forwards for r in same), peak_memory_bytes=max(memory) if memory else None,
            identical_to_target=None if None in identical else all(identical),
            identical_prompts=None if None in matches else sum(matches), reached=reached, accepted=accepted,
            speculation=same[0].speculation, step_seconds=None if None in steps else sum(steps),
            first_token_seconds=None if None in firsts else sum(firsts),
            bandwidth=None if None in bandwidths else max(bandwidths),
        ))
    _speedups(combined)
    return combined
