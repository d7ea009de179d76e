"""Hardware-aware speculation size: pick the draft shape that maximises tokens per second here.

Verifying n tokens costs t(n); on a GPU t(n) / t(1) stays near 1 up to dozens of tokens, on a
2-core CPU it grows quickly. The right chain length or tree size therefore depends on the device
as much as on the drafter. This module measures t(n) / t(1) for the target, the drafter's cost
per draft tree, and the acceptance the drafter actually achieves, then predicts

    speedup(draft shape) = tau(shape) * t_plain / (t_verify(shape) + t_draft(shape))

where t_plain is one step of plain decoding on the target's own weights (torch's default path),

for every candidate shape and picks the best. Candidates come in families of one `top_k` (1 is
a chain). One calibration run per family with its largest shape is enough: a tree's nodes carry
their score rank, and the best n ranks are exactly the tree a smaller `tree_total_tokens` would
have kept (see `drafting._select`), so each step's accepted path can be re-scored for every
smaller shape of the family. Each step also records how deep a smaller tree would have drafted (a tree
stops drafting where no node of a level can be kept: `drafting._viable_width`), so a shape's draft cost
is the mean over the calibrated steps of the trees it would have drafted, not a full tree's each step.

Verification may run on the CPU backend (hf_eagle31.backends.cpu), and whether that pays depends on the CPU: on
the 2-core AMD EPYC a packed fp32 forward of up to 16 tokens cost less than a plain step; on a
2-core Intel Xeon with AMX it costs 1.09-1.55 plain steps for 1-16 tokens in fp32, where torch's
own path costs 1.00-1.09 up to 3 tokens (and packed bf16 0.67-0.81). Packing also costs each call
~0.2 s for SmolLM2 in bf16. So tuning measures both paths, spreads a call's packing over
`CALL_TOKENS` tokens, and stores the faster path (`pack_weights`) with its shapes.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import torch
from transformers import DynamicCache, PreTrainedModel

from hf_eagle31.backends import backend_for
from hf_eagle31.compat import CACHE_KWARG
from hf_eagle31.drafting import DrafterState, DraftTree, Replay, draft_tree, drafting_width
from hf_eagle31.configuration import SpeculationSettings
from hf_eagle31.generation import (
    compiles_verify,
    drafting_dtype,
    eagle_verification,
    packs_weights,
    prepare_drafter,
    verify_mode,
)
from hf_eagle31.modeling import Eagle3DraftModel, Products
from hf_eagle31.verify_plan import VerifyPlan

VERIFY_SIZES = (*range(1, 14), 16, 24, 32, 48, 64)  # chains up to 12 drafts, trees up to 63
SAMPLING_TEMPERATURE = 1.0  # the temperature `sampling_shape` is calibrated at; it serves every sampling call
TUNING_ROUNDS = 3  # passes over the costs tuning measures (verify curve, plain step, drafts in turn); medians kept
CALL_TOKENS = 256  # new tokens of a typical call: what packing the weights once a call is spread over


def best_of(fn, repeats: int, before: Callable[[], object] | None = None) -> float:
    """The fastest of `repeats` calls of `fn`, each after an untimed call of `before` (if given)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the warm-up's queued kernels must not count
        started = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return min(times)


def _bushy_tree(n: int, depth: int, device) -> DraftTree:
    """A representative draft-tree shape: n nodes (root included) spread over `depth` levels."""
    parents, depths = [-1], [0]
    for node in range(1, n):
        level = 1 + (node - 1) * min(depth, n - 1) // (n - 1)
        parent = max(i for i in range(node) if depths[i] == level - 1)
        parents.append(parent)
        depths.append(level)
    zero = torch.zeros(n, dtype=torch.long, device=device)
    return DraftTree(zero, torch.tensor(parents, device=device), torch.tensor(depths, device=device))


@torch.no_grad()
def verify_cost_curve(
    target: PreTrainedModel,
    sizes: list[int],
    target_layer_ids: list[int],
    context: int = 256,
    depth: int = 6,
    repeats: int = 5,
    mode: str = "batched",
    pack: bool = False,
    compiled: bool = False,
) -> dict[int, float]:
    """Seconds for one target forward verifying `n` tokens after a `context`-token prefix, for each n.

    Measured the way tree decoding verifies: EAGLE's attention function in `mode`, a tree-shaped
    mask, the drafter's features captured, on the CPU backend if `pack` (where it serves the target), compiled if
    `compiled` (`compile_verify`: the warm-up compiles).
    """
    device = target.device
    prompt = torch.randint(3, target.config.get_text_config().vocab_size, (1, context), device=device)
    costs = {}
    with eagle_verification(target):
        cache = DynamicCache(config=target.config)
        target(prompt, **{CACHE_KWARG: cache})
        _, verify = backend_for(target, pack).target_forwards(target, target_layer_ids, compiled)
        for n in sizes:
            tree = _bushy_tree(n, depth, device)
            plan = VerifyPlan.for_cache(tree.ancestor_mask()[None], cache, mode)

            def forward():
                verify(cache, plan, tree.tokens[None], context + tree.depths[None])
                cache.crop(-n)

            forward()  # warm-up
            costs[n] = best_of(forward, repeats)
    return costs


def target_step(target: PreTrainedModel) -> Callable[[], object]:
    """One plain forward of the target over one token: what `draft_cost` runs before each timed tree, as decoding
    drafts each tree after a verify forward has streamed the target's weights through the caches.

    Why: the drafter then reads its weights, code and data from memory, not from the caches a loop of trees keeps
    them in. SmolLM2's 3-level tree on 2 threads: 9.2 ms after a target forward, 7.1 ms in a loop; decoding's own
    drafts cost at least the first, and tuning on the second chose trees a level or two too deep and predicted 17%
    more speed than the benchmark then measured.
    """
    token = torch.full((1, 1), 3, device=target.device)
    return lambda: target(token, use_cache=False)


@torch.no_grad()
def draft_cost(drafter: Eagle3DraftModel, depth: int, top_k: int, context: int = 256, repeats: int = 5,
               batch_size: int = 1, before: Callable[[], object] | None = None,
               products: Products | None = None, static: bool = False, replay: Replay | None = None) -> float:
    """Seconds to draft one EAGLE-2 tree of `depth` levels in each of `batch_size` rows (catch-up on one accepted
    token per row included), each tree timed after an untimed call of `before` (`target_step`: as decoding drafts),
    on a backend's `products` for the drafter (None: its layers' own calls); `static` as `draft_tree`'s, replayed
    by `replay` (a backend's `draft_replay`)."""
    device = drafter.device
    width = 3 * drafter.config.target_hidden_size
    features = torch.randn(batch_size, context, width, device=device, dtype=drafter.dtype)
    tokens = torch.randint(3, drafter.config.vocab_size, (batch_size, context), device=device)
    state = DrafterState(drafter, batch_size, products, 2 * context + 64 * depth, replay)
    for row in range(batch_size):
        state.push(features[row : row + 1], tokens[row : row + 1], row)
    state.catch_up()

    def one_tree():
        state.length -= 1
        state.positions -= 1
        for row in range(batch_size):
            state.push(features[row : row + 1, -1:], tokens[row : row + 1, -1:], row)
        draft_tree(state, tokens[:, -1], depth, top_k, 10**6, static=static)

    one_tree()
    return best_of(one_tree, repeats, before)


def verify_paths(target: PreTrainedModel, drafter: Eagle3DraftModel) -> tuple[bool, ...]:
    """The verify paths tuning compares, as `pack_weights` values: the CPU backend where it serves the target (not
    under "exact" verification, which computes on the plain weights), and the default backend."""
    return (True, False) if backend_for(target, True).name != "default" and verify_mode(settings_of(drafter)) != "exact" \
        else (False,)


@torch.no_grad()
def packing_cost(target: PreTrainedModel, drafter: Eagle3DraftModel, repeats: int = 3) -> float:
    """Seconds a call spends making the CPU backend's products for the target and the drafter."""
    backend = backend_for(target, True)

    def pack():
        with eagle_verification(target):
            backend.target_forwards(target, drafter.config.target_layer_ids)
        backend.products(drafter)

    pack()  # warm-up: the rows kernel loads once a process
    return best_of(pack, repeats)


BATCH_SIZES = (2, 4, 8, 16)
BATCH_BLOCK_SIZES = (*range(1, 10), 12, 16)  # tokens per row of a batched verify block, the root included


@torch.no_grad()
def batch_costs(target: PreTrainedModel, drafter: Eagle3DraftModel, top_ks: list[int], max_depth: int,
                batch_sizes: tuple[int, ...] = BATCH_SIZES, context: int = 256, repeats: int = 3,
                pack: bool | None = None) -> dict:
    """Seconds per batched verify forward (B rows of n tokens) and per batched draft, run as batched decoding runs them,
    on packed weights if `pack` (None: as the drafter's `pack_weights` says).

    Measured, not scaled from one row: on a CPU a batch makes the target's step compute-bound, so
    the extra tokens of a draft cost more than they do for one row.
    """
    device, vocab = target.device, target.config.get_text_config().vocab_size
    verify, draft, plain = {}, {}, {}
    pack = packs_weights(settings_of(drafter)) if pack is None else pack

    def block_cost(cache: DynamicCache, batch: int, n: int, verify) -> float:
        tokens = torch.randint(3, vocab, (batch, n), device=device)
        positions = (context + torch.arange(n, device=device)).expand(batch, n)
        plan = VerifyPlan.for_cache(torch.ones(n, n, dtype=torch.bool, device=device).tril().expand(batch, n, n), cache)

        def forward():
            verify(cache, plan, tokens, positions)
            cache.crop(-n)

        forward()  # warm-up
        return best_of(forward, repeats)

    after_target = target_step(target)  # before each timed draft, as decoding drafts after a verify forward
    layer_ids, backend = drafter.config.target_layer_ids, backend_for(target, pack)
    with eagle_verification(target):
        _, plain_verify = backend_for(target, False).target_forwards(target, layer_ids)
        for batch in batch_sizes:
            cache = DynamicCache(config=target.config)
            target(torch.randint(3, vocab, (batch, context), device=device), **{CACHE_KWARG: cache})
            plain[batch] = block_cost(cache, batch, 1, plain_verify)  # the target's own weights: a plain step
            # as decoding does: this backend's verify forward and products
            _, verify_on = backend.target_forwards(target, layer_ids, compiles_verify(settings_of(drafter), pack))
            verify[batch] = {n: block_cost(cache, batch, n, verify_on) for n in BATCH_BLOCK_SIZES}
            products = backend.products(drafter)
            draft[batch] = {k: {d: draft_cost(drafter, d, k, context, repeats, batch, after_target, products)
                                for d in range(1, max_depth + 1)} for k in top_ks}
    return {"verify_seconds": verify, "draft_seconds": draft, "plain_seconds": plain}


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


@contextlib.contextmanager
def speculation_settings(drafter: Eagle3DraftModel, **settings):
    """Set drafter generation-config fields for the block, then restore them."""
    config = drafter.generation_config
    saved = {name: getattr(config, name, None) for name in settings}
    config.update(**settings)
    try:
        yield
    finally:
        config.update(**saved)


def calibrate(target: PreTrainedModel, drafter: Eagle3DraftModel, prompts: list[torch.Tensor], max_new_tokens: int,
              top_k: int, depth: int, total_tokens: int,
              temperature: float | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """Accepted ranks and frontier ranks (how deep a smaller tree drafts) per step from decoding with the family's
    largest shape, speculation held fixed: greedy, or sampled at `temperature` (seeded per prompt).

    Why a smaller shape's acceptance can be read off these ranks when sampling too: the walk accepts a node when
    the target's own sample is one of its children (a sampled chain: when its draft passes min(1, p/q)), which a
    pruned tree holding that node would accept alike."""
    ranks, frontier_ranks = [], []
    sampling = {"do_sample": False} if temperature is None else {"do_sample": True, "temperature": temperature}
    with speculation_settings(drafter, speculation_mode="tree", dynamic_speculation=False, collapse_fallback=False,
                              tree_top_k=top_k, tree_depth=depth, tree_total_tokens=total_tokens,
                              batch_shapes=None, sampling_shape=None):
        for seed, prompt in enumerate(prompts):
            prompt = prompt.to(target.device)  # unpadded: a pad id inside the text is not padding
            if temperature is not None:
                torch.manual_seed(seed)  # the same draws in every calibration of this drafter
            target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                            assistant_model=drafter, **sampling)
            ranks += drafter.speculation_stats.accepted_ranks
            frontier_ranks += drafter.speculation_stats.frontier_ranks
    return ranks, frontier_ranks


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
    pack_weights: bool = False  # whether these costs are on packed weights: the path chosen
    pack_seconds: float = 0.0  # packing and unpacking the weights, once a call (0 on torch's default path)
    paths: dict = field(default_factory=dict)  # "packed" / "default" -> that path's fastest candidate

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
            "pack_weights": self.pack_weights,
            "pack_seconds": self.pack_seconds,
            "paths": self.paths,
        }


def choose_tree_shape(
    target: PreTrainedModel,
    drafter: Eagle3DraftModel,
    ranks_by_top_k: dict[int, list[list[int]]],
    max_depth: int,
    max_tokens: int,
    context: int = 256,
    frontier_by_top_k: dict[int, list[list[int]]] | None = None,
) -> TuningReport:
    """Predict the speedup of every candidate shape on each verify path (`verify_paths`) from this device's costs
    and the measured acceptance; the report of the path whose best shape is fastest.

    `ranks_by_top_k[k]` and `frontier_by_top_k[k]` come from a calibration run at top_k `k`, `max_depth` levels
    and `max_tokens` tokens (a chain of `max_depth` for k = 1), see `calibrate`.
    """
    sizes = [n for n in VERIFY_SIZES if n <= max_tokens + 1]
    mode = verify_mode(settings_of(drafter))
    paths = verify_paths(target, drafter)
    layer_ids = drafter.config.target_layer_ids
    # Why passes: a shared CPU drifts in speed over seconds, both ways (a neighbour's load comes and goes), so each
    # cost is its median over passes in different minutes: one pass's slow or fast minute at one size does not bend
    # the curve (a best over passes once priced 13 tokens at 1.10 plain steps between 1.31 and 1.40 on the Xeon, and
    # a 12-deep tree was chosen on it); the costs in turn in each pass.
    after_target = target_step(target)  # before each timed draft, as decoding drafts after a verify forward
    passes = []
    for _ in range(TUNING_ROUNDS):
        curves, drafts = {}, {}
        for pack in paths:
            curves[pack] = verify_cost_curve(target, sizes, layer_ids, context=context, mode=mode, pack=pack,
                                             compiled=compiles_verify(settings_of(drafter), pack))
            backend = backend_for(target, pack)
            products, replay = backend.products(drafter), backend.draft_replay(drafter)
            # every width a candidate drafts (a family's smaller trees are narrower); narrowed, and static where the
            # device replays a static draft (a static draft that is not replayed drafts the same levels, never fewer)
            for static in (False, True) if replay is not None else (False,):
                drafts[pack, static] = {w: {d: draft_cost(drafter, d, w, context=context, before=after_target,
                                                          products=products, static=static, replay=replay)
                                            for d in range(1, max_depth + 1)}
                                        for w in range(1, max(ranks_by_top_k) + 1)}
        passes.append((curves, drafts, packing_cost(target, drafter) if True in paths else 0.0))
    plain = median(p[0][False][1] for p in passes)  # the default path's one-token forward: a plain step
    reports = []
    for pack, static in passes[0][1]:
        curve = non_decreasing({n: median(p[0][pack][n] for p in passes) for n in sizes})
        drafts = {k: non_decreasing({d: median(p[1][pack, static][k][d] for p in passes) for d in depths})
                  for k, depths in passes[0][1][pack, static].items()}
        per_call = median(p[2] for p in passes) if pack else 0.0
        candidates = rank_candidates(curve, drafts, ranks_by_top_k, plain, per_call,
                                     None if static else frontier_by_top_k)  # a static draft drafts every level
        if (pack, True) in passes[0][1]:
            for candidate in candidates:
                candidate["draft_mode"] = "static" if static else "narrowed"
        reports.append(TuningReport(curve, drafts, plain, candidates, ranks_by_top_k, frontier_by_top_k or {},
                                    pack_weights=pack, pack_seconds=per_call))
    paths_best = {("packed" if report.pack_weights else "default") + (f", {report.choice['draft_mode']}"
                                                                        if "draft_mode" in report.choice else ""):
                  report.choice for report in reports}
    best = max(reports, key=lambda report: report.choice["speedup"])
    best.paths = paths_best
    return best


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


def calibrate_families(target: PreTrainedModel, drafter: Eagle3DraftModel, prompts: list[torch.Tensor],
                       max_new_tokens: int, top_ks, max_depth: int, max_tokens: int,
                       temperature: float | None = None
                       ) -> tuple[dict[int, list[list[int]]], dict[int, list[list[int]]]]:
    """`calibrate` each family (top_k) at its largest shape: a chain of `max_depth`, a tree of `max_tokens`; the
    accepted ranks and the frontier ranks by top_k."""
    runs = {k: calibrate(target, drafter, prompts, max_new_tokens, k, max_depth, max_depth if k == 1 else max_tokens,
                         temperature) for k in top_ks}
    return {k: run[0] for k, run in runs.items()}, {k: run[1] for k, run in runs.items()}


def sampling_tuning(report: dict, ranks_by_top_k: dict[int, list[list[int]]], temperature: float,
                    frontier_by_top_k: dict[int, list[list[int]]] | None = None) -> dict:
    """The candidates predicted from a report's costs with the acceptance of sampling at `temperature`, and the
    fastest of them (`shape`, which `apply_choice` stores as `sampling_shape`).

    Why a second calibration: a sampled walk accepts a child with the target's probability of it, not when it is
    the argmax, so sampling accepts fewer tokens deeper down and a shallower shape wins (on the 2-core CPU the
    greedy-tuned tree of 5 ran 1.81x at temperature 1.0 where a chain of 3 ran 1.95x). The costs are the same.
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


def apply_choice(drafter: Eagle3DraftModel, report: TuningReport | dict) -> None:
    """Store the best chain length, the best tree, the faster mode and the verify path they were measured on
    (`pack_weights`) in the drafter's generation config, the shape predicted fastest for each batch size
    (`batch_shapes`) and for sampling (`sampling_shape`).

    `report` may also be a saved `TuningReport.as_dict()` (a resumed benchmark reuses its tuning).
    Where the device replays static drafts, tuning timed both drafting modes and the faster one is stored
    (`draft_mode`). Dynamic speculation is switched off: the shapes were chosen for the acceptance measured at a
    fixed depth, and on the demo pair the PID controller, shortening drafts after each miss, cost 8%
    of the tuned chain's speed (2.63x instead of 2.85x over the target alone, same prompts).
    """
    if isinstance(report, TuningReport):
        report = report.as_dict()
    chain, tree, choice = report["best_chain"], report["best_tree"], report["choice"]
    config = drafter.generation_config
    if chain:
        config.num_assistant_tokens = chain["tree_depth"]
    if tree:
        config.update(tree_top_k=tree["tree_top_k"], tree_depth=tree["tree_depth"],
                      tree_total_tokens=tree["tree_total_tokens"])
    config.max_speculation_depth = max(chain.get("tree_depth", 1), tree.get("tree_depth", 1))
    config.speculation_mode = "chain" if choice["tree_top_k"] == 1 else "tree"
    config.dynamic_speculation = False
    if "pack_weights" in report:  # a report from before tuning chose the path: measured packed where it could, kept
        config.pack_weights = report["pack_weights"]
    if "draft_mode" in choice:  # timed both ways where the device replays static drafts
        config.draft_mode = choice["draft_mode"]
    config.batch_shapes = batch_shapes(report) if report.get("batch_costs") else None
    config.sampling_shape = (report.get("sampling") or {}).get("shape")
    settings_of(drafter)  # what was stored is checked as every call checks it


def settings_of(drafter: Eagle3DraftModel) -> SpeculationSettings:
    return SpeculationSettings.of(drafter.generation_config)


BATCH_MAX_DEPTH = 8  # deeper drafts never paid at a batch size above one here


def tune_drafter(target: PreTrainedModel, drafter: Eagle3DraftModel, prompts: list[torch.Tensor],
                 max_new_tokens: int = 96, top_ks: tuple[int, ...] = (1, 3, 10), max_depth: int = 12,
                 max_tokens: int = 64, batch_sizes: tuple[int, ...] = BATCH_SIZES,
                 sampling_temperature: float | None = SAMPLING_TEMPERATURE) -> TuningReport:
    """Calibrate on `prompts` (token ids), measure this device's costs, choose a shape and apply it; the same for
    each of `batch_sizes` (their shapes go to `batch_shapes`) and, calibrated again sampling at
    `sampling_temperature` (None: not), for sampling (`sampling_shape`)."""
    ranks, frontier = calibrate_families(target, drafter, prompts, max_new_tokens, top_ks, max_depth, max_tokens)
    report = choose_tree_shape(target, drafter, ranks, max_depth, max_tokens, frontier_by_top_k=frontier)
    if batch_sizes:
        report.batch_costs = batch_costs(target, drafter, list(top_ks), min(max_depth, BATCH_MAX_DEPTH), batch_sizes,
                                         pack=report.pack_weights)
    if sampling_temperature is not None:  # the same costs, the acceptance of sampling
        report.sampling = tune_sampling(target, drafter, report.as_dict(), prompts, max_new_tokens,
                                        sampling_temperature)["sampling"]
    apply_choice(drafter, report)
    return report


def _families(report: dict) -> list[int]:
    """The top_k values a saved report calibrated."""
    return sorted({c["tree_top_k"] for c in report["candidates"]})


def tune_batch_sizes(target: PreTrainedModel, drafter: Eagle3DraftModel, report: dict,
                     batch_sizes: tuple[int, ...] = BATCH_SIZES) -> dict:
    """Add batched costs to a saved tuning report (its calibrated acceptance kept) and store `batch_shapes`."""
    report = {**report, "batch_costs": batch_costs(target, drafter, _families(report), BATCH_MAX_DEPTH, batch_sizes,
                                                   pack=report.get("pack_weights"))}  # None: the drafter's setting
    drafter.generation_config.batch_shapes = batch_shapes(report)
    return report


def tune_sampling(target: PreTrainedModel, drafter: Eagle3DraftModel, report: dict, prompts: list[torch.Tensor],
                  max_new_tokens: int = 96, temperature: float = SAMPLING_TEMPERATURE) -> dict:
    """Add the acceptance of sampling at `temperature` to a saved tuning report (its costs kept: nothing is timed,
    so it may run on a busy machine) and store `sampling_shape`."""
    depths = report["draft_seconds"]
    top_ks = _families(report)
    max_depth = max(int(d) for d in depths[next(iter(depths))])
    max_tokens = max(int(n) for n in report["verify_seconds"]) - 1
    sampled, frontier = calibrate_families(target, drafter, prompts, max_new_tokens, top_ks, max_depth, max_tokens,
                                           temperature)
    report = {**report, "sampling": sampling_tuning(report, sampled, temperature, frontier)}
    drafter.generation_config.sampling_shape = report["sampling"]["shape"]
    return report


def retune_folder(target: PreTrainedModel, folder: Path, prompts: list[torch.Tensor], sampling_only: bool = False) -> dict:
    """Re-tune a saved drafter's shapes on this machine, in place (`generation_config.json`, `tuning.json`), as
    decoding runs it (drafting dtype, the target's embedding). The costs are timings: a quiet machine's job, unless
    `sampling_only`, which keeps the saved costs and greedy shapes and calibrates the shape for sampling alone."""
    drafter = Eagle3DraftModel.from_pretrained(folder, dtype=drafting_dtype(target)).eval()
    prepare_drafter(target, drafter)
    if sampling_only:
        report = tune_sampling(target, drafter, json.loads((folder / "tuning.json").read_text()), prompts)
    else:
        report = tune_drafter(target, drafter, prompts).as_dict()
    drafter.generation_config.save_pretrained(folder)
    (folder / "tuning.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report
