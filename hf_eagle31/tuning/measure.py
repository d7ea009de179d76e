"""Measuring what a draft shape costs on this device, and the acceptance the drafter achieves: runs the models.

Verifying n tokens costs t(n); on a GPU t(n) / t(1) stays near 1 up to dozens of tokens, on a
CPU it grows quickly. The right chain length or tree size therefore depends on the device
as much as on the drafter. This module measures t(n) / t(1) for the target (`verify_cost_curve`), the
drafter's cost per draft tree (`draft_cost`) and the acceptance the drafter actually achieves (`calibrate`),
and `choose_tree_shape` ranks every candidate on them (`hf_eagle31.tuning.predict`).

Verification may run on the CPU backend (hf_eagle31.backends.cpu), and whether that pays depends on the CPU: on
one a packed forward of a few tokens costs less than a plain step, on another more than torch's own path for the
same tokens (docs/benchmarks.md). Packing the weights also costs each call a fixed time. So tuning measures both
paths, spreads a call's packing over `CALL_TOKENS` tokens, and stores the faster path (`cpu_backend`) with its
shapes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from statistics import median

import torch
from transformers import DynamicCache, PreTrainedModel

from hf_eagle31.backends import backend_for
from hf_eagle31.compat import CACHE_KWARG
from hf_eagle31.configuration import SpeculationSettings
from hf_eagle31.drafting import DrafterState, DraftForward, DraftTree, Replay, draft_tree
from hf_eagle31.generation import checked_verify_mode, compiles_verify, eagle_verification, on_cpu_backend
from hf_eagle31.modeling import Eagle3DraftModel, Products
from hf_eagle31.tuning.predict import TuningReport, non_decreasing, rank_candidates
from hf_eagle31.verify_plan import VerifyPlan

VERIFY_SIZES = (*range(1, 14), 16, 24, 32, 48, 64)  # chains up to 12 drafts, trees up to 63
TUNING_ROUNDS = 3  # passes over the costs tuning measures (verify curve, plain step, drafts in turn); medians kept


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
    cpu_backend: bool = False,
    compiled: bool = False,
) -> dict[int, float]:
    """Seconds for one target forward verifying `n` tokens after a `context`-token prefix, for each n.

    Measured the way tree decoding verifies: EAGLE's attention function in `mode`, a tree-shaped
    mask, the drafter's features captured, on the CPU backend if `cpu_backend` (where it serves the target), compiled if
    `compiled` (`compile_verify`: the warm-up compiles).
    """
    device = target.device
    prompt = torch.randint(3, target.config.get_text_config().vocab_size, (1, context), device=device)
    costs = {}
    with eagle_verification(target):
        cache = DynamicCache(config=target.config)
        target(prompt, **{CACHE_KWARG: cache})
        verify = backend_for(target, cpu_backend).target_forwards(target, target_layer_ids, compiled).verify
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
    them in, so a tree costs more after a target forward than in a loop. Decoding's own drafts cost at least the
    first; timed the second way, tuning chose trees too deep and predicted more speed than the benchmark then
    measured (docs/benchmarks.md).
    """
    token = torch.full((1, 1), 3, device=target.device)
    return lambda: target(token, use_cache=False)


@torch.no_grad()
def draft_cost(drafter: Eagle3DraftModel, depth: int, top_k: int, context: int = 256, repeats: int = 5,
               batch_size: int = 1, before: Callable[[], object] | None = None,
               products: Products | None = None, static: bool = False, replay: Replay | None = None,
               forward: DraftForward | None = None) -> float:
    """Seconds to draft one EAGLE-2 tree of `depth` levels in each of `batch_size` rows (catch-up on one accepted
    token per row included), each tree timed after an untimed call of `before` (`target_step`: as decoding drafts),
    on a backend's `products` for the drafter (None: its layers' own calls) or its whole `forward` (`draft_forward`);
    `static` as `draft_tree`'s, replayed by `replay` (a backend's `draft_replay`)."""
    device = drafter.device
    width = 3 * drafter.config.target_hidden_size
    features = torch.randn(batch_size, context, width, device=device, dtype=drafter.dtype)
    tokens = torch.randint(3, drafter.config.vocab_size, (batch_size, context), device=device)
    state = DrafterState(drafter, batch_size, products, 2 * context + 64 * depth, replay, forward)
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


def settings_of(drafter: Eagle3DraftModel) -> SpeculationSettings:
    """The drafter's speculation settings, read and checked as every call reads them."""
    return SpeculationSettings.of(drafter.generation_config)


def verify_paths(target: PreTrainedModel, settings: SpeculationSettings) -> tuple[bool, ...]:
    """The verify paths tuning compares, as `cpu_backend` values: the CPU backend where it serves the target (not
    under "exact" verification, which computes on the plain weights), and the default backend."""
    return (True, False) if backend_for(target, True).name != "default" and settings.verify_mode != "exact" \
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
                cpu_backend: bool | None = None) -> dict:
    """Seconds per batched verify forward (B rows of n tokens) and per batched draft, run as batched decoding runs them,
    on the CPU backend if `cpu_backend` (None: as the drafter's `cpu_backend` says).

    Measured, not scaled from one row: on a CPU a batch makes the target's step compute-bound, so
    the extra tokens of a draft cost more than they do for one row.
    """
    device, vocab = target.device, target.config.get_text_config().vocab_size
    verify, draft, plain = {}, {}, {}
    settings = settings_of(drafter)
    cpu_backend = on_cpu_backend(settings) if cpu_backend is None else cpu_backend
    compiled = compiles_verify(settings, cpu_backend)

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
    layer_ids, backend = drafter.config.target_layer_ids, backend_for(target, cpu_backend)
    with eagle_verification(target):
        plain_verify = backend_for(target, False).target_forwards(target, layer_ids).verify
        for batch in batch_sizes:
            cache = DynamicCache(config=target.config)
            target(torch.randint(3, vocab, (batch, context), device=device), **{CACHE_KWARG: cache})
            plain[batch] = block_cost(cache, batch, 1, plain_verify)  # the target's own weights: a plain step
            # as decoding does: this backend's verify forward and products
            verify_on = backend.target_forwards(target, layer_ids, compiled).verify
            verify[batch] = {n: block_cost(cache, batch, n, verify_on) for n in BATCH_BLOCK_SIZES}
            products = backend.products(drafter)
            forward = backend.draft_forward(drafter, products)
            draft[batch] = {k: {d: draft_cost(drafter, d, k, context, repeats, batch, after_target, products,
                                              forward=forward)
                                for d in range(1, max_depth + 1)} for k in top_ks}
    return {"verify_seconds": verify, "draft_seconds": draft, "plain_seconds": plain}


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


def calibrate_families(target: PreTrainedModel, drafter: Eagle3DraftModel, prompts: list[torch.Tensor],
                       max_new_tokens: int, top_ks, max_depth: int, max_tokens: int,
                       temperature: float | None = None
                       ) -> tuple[dict[int, list[list[int]]], dict[int, list[list[int]]]]:
    """`calibrate` each family (top_k) at its largest shape: a chain of `max_depth`, a tree of `max_tokens`; the
    accepted ranks and the frontier ranks by top_k."""
    runs = {k: calibrate(target, drafter, prompts, max_new_tokens, k, max_depth, max_depth if k == 1 else max_tokens,
                         temperature) for k in top_ks}
    return {k: run[0] for k, run in runs.items()}, {k: run[1] for k, run in runs.items()}


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
    settings = settings_of(drafter)
    mode = checked_verify_mode(settings)
    paths = verify_paths(target, settings)
    layer_ids = drafter.config.target_layer_ids
    # Why passes: a shared CPU drifts in speed over seconds, both ways (a neighbour's load comes and goes), so each
    # cost is its median over passes in different minutes: one pass's slow or fast minute at one size does not bend
    # the curve (a best over passes once priced one size far below its neighbours, and a shape of that size was
    # chosen on it); the costs in turn in each pass.
    after_target = target_step(target)  # before each timed draft, as decoding drafts after a verify forward
    passes = []
    for _ in range(TUNING_ROUNDS):
        curves, drafts = {}, {}
        for cpu_backend in paths:
            curves[cpu_backend] = verify_cost_curve(target, sizes, layer_ids, context=context, mode=mode,
                                                    cpu_backend=cpu_backend,
                                                    compiled=compiles_verify(settings, cpu_backend))
            backend = backend_for(target, cpu_backend)
            products, replay = backend.products(drafter), backend.draft_replay(drafter)
            forward = backend.draft_forward(drafter, products)
            # every width a candidate drafts (a family's smaller trees are narrower); narrowed, and static where the
            # device replays a static draft (a static draft that is not replayed drafts the same levels, never fewer)
            for static in (False, True) if replay is not None else (False,):
                drafts[cpu_backend, static] = {w: {d: draft_cost(drafter, d, w, context=context, before=after_target,
                                                          products=products, static=static, replay=replay,
                                                          forward=forward)
                                            for d in range(1, max_depth + 1)}
                                        for w in range(1, max(ranks_by_top_k) + 1)}
        passes.append((curves, drafts, packing_cost(target, drafter) if True in paths else 0.0))
    plain = median(p[0][False][1] for p in passes)  # the default path's one-token forward: a plain step
    reports = []
    for cpu_backend, static in passes[0][1]:
        curve = non_decreasing({n: median(p[0][cpu_backend][n] for p in passes) for n in sizes})
        drafts = {k: non_decreasing({d: median(p[1][cpu_backend, static][k][d] for p in passes) for d in depths})
                  for k, depths in passes[0][1][cpu_backend, static].items()}
        per_call = median(p[2] for p in passes) if cpu_backend else 0.0
        candidates = rank_candidates(curve, drafts, ranks_by_top_k, plain, per_call,
                                     None if static else frontier_by_top_k)  # a static draft drafts every level
        if (cpu_backend, True) in passes[0][1]:
            for candidate in candidates:
                candidate["draft_mode"] = "static" if static else "narrowed"
        reports.append(TuningReport(curve, drafts, plain, candidates, ranks_by_top_k, frontier_by_top_k or {},
                                    cpu_backend=cpu_backend, pack_seconds=per_call))
    paths_best = {("cpu backend" if report.cpu_backend else "default") + (f", {report.choice['draft_mode']}"
                                                                       if "draft_mode" in report.choice else ""):
                  report.choice for report in reports}
    best = max(reports, key=lambda report: report.choice["speedup"])
    best.paths = paths_best
    return best
