"""Predicting a draft shape's speed from measured costs and calibrated acceptance: pure functions, no model runs.

For every candidate shape

    speedup(draft shape) = tau(shape) * t_plain / (t_verify(shape) + t_draft(shape))

where t_plain is one step of plain decoding on the target's own weights (torch's default path), t_verify(shape)
one verify forward of the shape's tokens and t_draft(shape) drafting its tree (`hf_eagle31.tuning.measure`
times them). Candidates come in families of one `top_k` (1 is a chain). One calibration run per family with its
largest shape is enough: a tree's nodes carry their score rank, and the best n ranks are exactly the tree a
smaller `tree_total_tokens` would have kept (see `drafting._select`), so each step's accepted path can be
re-scored for every smaller shape of the family (`projected_tau`). Each step also records how deep a smaller
tree would have drafted (a tree stops drafting where no node of a level can be kept: `drafting._viable_width`),
so a shape's draft cost is the mean over the calibrated steps of the trees it would have drafted, not a full
tree's each step (`mean_draft_seconds`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hf_eagle31.drafting import drafting_width

CALL_TOKENS = 256  # new tokens of a typical call: what packing the weights once a call is spread over


@dataclass
class TuningReport:
    verify_curve: dict[int, float]  # n -> seconds
    draft_seconds: dict[int, dict[int, float]]  # drafting width -> depth -> seconds per tree
    plain_seconds: float  # one plain decoding step: the unit of every predicted speedup
    candidates: list[dict] = field(default_factory=list)  # shape, tau, predicted speedup
    calibration_ranks: dict[int, list[list[int]]] = field(default_factory=dict, repr=False)  # top_k -> ranks
    calibration_frontier_ranks: dict[int, list[list[int]]] = field(default_factory=dict, repr=False)  # the same
    batch_costs: dict = field(default_factory=dict)  # see `batch_costs`
    sampling: dict = field(default_factory=dict)  # see `sampling_tuning`
    cpu_backend: bool = False  # whether these costs are on the CPU backend: the path chosen
    pack_seconds: float = 0.0  # packing and unpacking the weights, once a call (0 on torch's default path)
    paths: dict = field(default_factory=dict)  # "cpu backend" / "default" -> that path's fastest candidate

    def best(self, chain: bool) -> dict:
        """The fastest predicted chain (top_k 1) or tree (top_k > 1); {} if there is none."""
        family = [c for c in self.candidates if (c["tree_top_k"] == 1) == chain]
        return max(family, key=lambda c: c["speedup"]) if family else {}

    @property
    def choice(self) -> dict:
        return max(self.candidates, key=lambda c: c["speedup"])

    def as_dict(self) -> dict:
        return {
            "verify_cost_ratio": {n: t / self.verify_curve[1] for n, t in self.verify_curve.items()},
            "verify_seconds": self.verify_curve,
            "draft_seconds": self.draft_seconds,
            "plain_seconds": self.plain_seconds,
            "candidates": self.candidates,
            "choice": self.choice,
            "best_chain": self.best(chain=True),
            "best_tree": self.best(chain=False),
            "calibration_ranks": self.calibration_ranks,
            "calibration_frontier_ranks": self.calibration_frontier_ranks,
            "batch_costs": self.batch_costs,
            "sampling": self.sampling,
            "cpu_backend": self.cpu_backend,
            "pack_seconds": self.pack_seconds,
            "paths": self.paths,
        }


def report_cpu_backend(report: dict) -> bool | None:
    """The verify path a saved report's costs were measured on (`TuningReport.cpu_backend`; "pack_weights" in a report
    saved before the setting was renamed), None in one saved before tuning chose the path."""
    return report.get("cpu_backend", report.get("pack_weights"))


def projected_tau(accepted_ranks: list[list[int]], total_tokens: int, depth: int) -> float:
    """Tokens per step had each step kept only its `total_tokens` best-ranked nodes, `depth` levels deep."""
    emitted = []
    for ranks in accepted_ranks:
        accepted = 0
        for rank in ranks:
            if rank >= total_tokens or accepted >= depth:
                break
            accepted += 1
        emitted.append(accepted + 1)
    return sum(emitted) / max(len(emitted), 1)


def non_decreasing(costs: dict[int, float]) -> dict[int, float]:
    """Each cost raised to the highest of those at smaller sizes: verifying more tokens or drafting more levels
    does the same work and more, so a size measured below a smaller one was a fast minute, not a cheaper size,
    and a shape must not be chosen for it."""
    highest, out = 0.0, {}
    for size in sorted(costs):
        highest = out[size] = max(highest, costs[size])
    return out


def rank_candidates(verify_seconds: dict[int, float], draft_seconds: dict[int, dict[int, float]],
                    ranks_by_top_k: dict[int, list[list[int]]], plain_seconds: float,
                    call_seconds: float = 0.0,
                    frontier_by_top_k: dict[int, list[list[int]]] | None = None) -> list[dict]:
    """Predicted tau and speedup of every shape the costs cover: verify time per block size, draft time per step
    (`mean_draft_seconds`) and `call_seconds` once a call of `CALL_TOKENS` tokens (packing), against
    `plain_seconds` per plain decoding step."""
    frontier_by_top_k = frontier_by_top_k or {}
    candidates = []
    depths = sorted({depth for per_depth in draft_seconds.values() for depth in per_depth})
    for top_k, ranks in ranks_by_top_k.items():
        for depth in depths:
            for total, verify in verify_seconds.items():
                nodes = total - 1
                if nodes < depth or (top_k == 1 and nodes != depth):
                    continue
                draft = mean_draft_seconds(draft_seconds, top_k, nodes, depth, frontier_by_top_k.get(top_k))
                if draft is None:
                    continue
                tau = projected_tau(ranks, nodes, depth)
                step = verify + draft + call_seconds * tau / CALL_TOKENS  # a call takes CALL_TOKENS / tau steps
                candidates.append({"tree_top_k": top_k, "tree_depth": depth, "tree_total_tokens": nodes, "tau": tau,
                                   "speedup": tau * plain_seconds / step})
    return candidates


def tree_draft_seconds(draft_seconds: dict[int, dict[int, float]], top_k: int, nodes: int, depth: int) -> float | None:
    """Seconds to draft a tree of `nodes` at `top_k`, from `draft_seconds[width][depth]`: timed at the width it
    drafts (`drafting_width`), or where that width was not timed (batched costs, older reports) at the nearest
    wider one, an upper bound. None if no width as wide was timed at this depth."""
    width = drafting_width(top_k, nodes)
    timed = [w for w, per_depth in draft_seconds.items() if w >= width and depth in per_depth]
    return draft_seconds[min(timed)][depth] if timed else None


def drafted_levels(frontier_ranks: list[int], nodes: int, depth: int) -> int:
    """Drafter forwards of a tree of `nodes`, `depth` levels deep, at a step with these calibrated frontier ranks:
    the catch-up, then each level while its best node ranks among the `nodes` best (`drafting._viable_width`)."""
    levels = 1
    for rank in frontier_ranks[: depth - 1]:
        if rank >= nodes:
            break
        levels += 1
    return levels


def mean_draft_seconds(draft_seconds: dict[int, dict[int, float]], top_k: int, nodes: int, depth: int,
                       frontier_ranks: list[list[int]] | None = None) -> float | None:
    """Seconds a step drafts a tree of `nodes` at `top_k`, `depth` deep: over calibrated steps, the mean cost of
    the levels each would have drafted (`drafted_levels`); without their frontier ranks (older reports), a full
    tree's every step."""
    if not frontier_ranks:
        return tree_draft_seconds(draft_seconds, top_k, nodes, depth)
    steps = Counter(drafted_levels(ranks, nodes, depth) for ranks in frontier_ranks)
    costs = {levels: tree_draft_seconds(draft_seconds, top_k, nodes, levels) for levels in steps}
    if None in costs.values():
        return None
    return sum(costs[levels] * count for levels, count in steps.items()) / len(frontier_ranks)


def sampling_tuning(report: dict, ranks_by_top_k: dict[int, list[list[int]]], temperature: float,
                    frontier_by_top_k: dict[int, list[list[int]]] | None = None) -> dict:
    """The candidates predicted from a report's costs with the acceptance of sampling at `temperature`, and the
    fastest of them (`shape`, which `apply_choice` stores as `sampling_shape`).

    Why a second calibration: a sampled walk accepts a child with the target's probability of it, not when it is
    the argmax, so sampling accepts fewer tokens deeper down and a shallower shape wins (docs/benchmarks.md). The
    costs are the same.
    """
    verify = {int(n): t for n, t in report["verify_seconds"].items()}  # keys are strings once through JSON
    drafts = {int(k): {int(d): t for d, t in depths.items()} for k, depths in report["draft_seconds"].items()}
    candidates = rank_candidates(verify, drafts, ranks_by_top_k, report["plain_seconds"],
                                 report.get("pack_seconds", 0.0), frontier_by_top_k)
    fastest = max(candidates, key=lambda c: c["speedup"])
    return {"temperature": temperature, "calibration_ranks": ranks_by_top_k,
            "calibration_frontier_ranks": frontier_by_top_k or {}, "candidates": candidates,
            "shape": {**fastest, "temperature": temperature}}


def batch_shapes(report: dict) -> dict[str, dict]:
    """The shape predicted fastest at each batch size, from the batched costs measured by `batch_costs` and the
    acceptance calibrated for one row.

    A batch waits for its slowest row, so measured gains (`hf-eagle31 bench --batch-sizes`) come out
    lower than predicted. A batch size where no shape is predicted to beat plain decoding keeps its
    best shape with its `speedup` below 1, and batched decoding then decodes plainly.
    """
    shapes = {}
    costs = report["batch_costs"]
    for batch, verify in costs["verify_seconds"].items():  # keys are strings once a report went through JSON
        verify = {int(n): t for n, t in verify.items()}
        plain = costs.get("plain_seconds", {}).get(batch, verify[1])  # reports before plain steps were timed
        drafts = {int(w): {int(d): t for d, t in depths.items()} for w, depths in costs["draft_seconds"][batch].items()}
        best = None
        for c in report["candidates"]:
            top_k, depth, n = c["tree_top_k"], c["tree_depth"], c["tree_total_tokens"] + 1
            draft = tree_draft_seconds(drafts, top_k, n - 1, depth)
            if n not in verify or draft is None:
                continue
            speedup = c["tau"] * plain / (verify[n] + draft)
            if best is None or speedup > best["speedup"]:
                best = {"tree_top_k": top_k, "tree_depth": depth, "tree_total_tokens": n - 1, "speedup": speedup}
        shapes[str(batch)] = best
    return shapes
