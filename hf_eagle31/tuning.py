"""Hardware-aware speculation size: pick the draft shape that maximises tokens per second here.

Verifying n tokens costs t(n); on a GPU t(n) / t(1) stays near 1 up to dozens of tokens, on a
2-core CPU it grows almost linearly. The right chain length or tree size therefore depends on the
device as much as on the drafter. This module measures t(n) / t(1) for the target, the drafter's
cost per draft level, and the acceptance the drafter actually achieves, then predicts

    speedup(draft shape) = tau(shape) * t(1) / (t_verify(shape) + t_draft(shape))

for every candidate shape and picks the best. One calibration run with the largest shape is
enough: a tree's nodes carry their score rank, and the best n ranks are exactly the tree a smaller
`tree_total_tokens` would have kept (see `drafting._select_tree`), so each step's accepted path can
be re-scored for every smaller shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from hf_eagle31.drafting import DrafterState, DraftTree, draft_tree
from hf_eagle31.generation import verify_attention_enabled
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.verification import verify_block


def _best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
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
    use_kernel: bool = False,
) -> dict[int, float]:
    """Seconds for one target forward verifying `n` tokens after a `context`-token prefix, for each n.

    Measured the way tree decoding verifies: EAGLE's attention function, a tree-shaped mask, the
    drafter's features captured; `use_kernel` times the Triton kernel instead of the exact path.
    """
    device = target.device
    prompt = torch.randint(3, target.config.get_text_config().vocab_size, (1, context), device=device)
    costs = {}
    with verify_attention_enabled(target):
        cache = DynamicCache(config=target.config)
        target(prompt, past_key_values=cache)
        for n in sizes:
            tree = _bushy_tree(n, depth, device)
            mask = tree.ancestor_mask()

            def forward():
                verify_block(target, cache, tree.tokens, context + tree.depths, mask, target_layer_ids, use_kernel)
                cache.crop(-n)

            forward()  # warm-up
            costs[n] = _best_of(forward, repeats)
    return costs


@torch.no_grad()
def draft_cost(drafter: Eagle3DraftModel, depth: int, top_k: int, context: int = 256, repeats: int = 5) -> float:
    """Seconds to draft one EAGLE-2 tree of `depth` levels (catch-up on one accepted token included)."""
    device = drafter.device
    width = 3 * drafter.config.target_hidden_size
    features = torch.randn(1, context, width, device=device, dtype=drafter.dtype)
    tokens = torch.randint(3, drafter.config.vocab_size, (1, context), device=device)
    state = DrafterState(drafter)
    state.push(features, tokens)
    state.catch_up()

    def one_tree():
        state.length -= 1
        state.push(features[:, -1:], tokens[:, -1:])
        draft_tree(state, tokens[0, -1:], depth, top_k, 10**6)

    one_tree()
    return _best_of(one_tree, repeats)


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


@dataclass
class TuningReport:
    verify_curve: dict[int, float]  # n -> seconds
    draft_seconds: dict[int, float]  # depth -> seconds per tree
    candidates: list[dict] = field(default_factory=list)  # shape, tau, predicted speedup
    choice: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "verify_cost_ratio": {n: t / self.verify_curve[1] for n, t in self.verify_curve.items()},
            "verify_seconds": self.verify_curve,
            "draft_seconds": self.draft_seconds,
            "candidates": self.candidates,
            "choice": self.choice,
        }


def choose_tree_shape(
    target: PreTrainedModel,
    drafter: Eagle3DraftModel,
    accepted_ranks: list[list[int]],
    top_k: int,
    max_depth: int,
    max_tokens: int,
    context: int = 256,
) -> TuningReport:
    """Pick `tree_depth` and `tree_total_tokens` (at this `top_k`) maximising the predicted speedup.

    `accepted_ranks` come from a calibration run at `max_depth`, `max_tokens` and `top_k` with
    dynamic speculation off (`drafter.speculation_stats.accepted_ranks`).
    """
    sizes = sorted({1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128} | {max_tokens + 1})
    sizes = [n for n in sizes if n <= max_tokens + 1]
    from hf_eagle31.generation import verify_with_kernel

    curve = verify_cost_curve(target, sizes, drafter.config.target_layer_ids, context=context,
                              use_kernel=verify_with_kernel(drafter, target))
    drafts = {d: draft_cost(drafter, d, top_k, context=context) for d in range(1, max_depth + 1)}
    report = TuningReport(curve, drafts)
    for depth in range(1, max_depth + 1):
        for total in sizes[1:]:
            nodes = total - 1
            if nodes < depth:
                continue
            tau = projected_tau(accepted_ranks, nodes, depth)
            seconds = curve[total] + drafts[depth]
            report.candidates.append(
                {"tree_depth": depth, "tree_total_tokens": nodes, "tau": tau, "speedup": tau * curve[1] / seconds}
            )
    report.choice = max(report.candidates, key=lambda c: c["speedup"])
    return report


def apply_choice(drafter: Eagle3DraftModel, report: TuningReport) -> None:
    """Store the chosen shape in the drafter's generation config (saved with `save_pretrained`)."""
    drafter.generation_config.tree_depth = report.choice["tree_depth"]
    drafter.generation_config.tree_total_tokens = report.choice["tree_total_tokens"]
