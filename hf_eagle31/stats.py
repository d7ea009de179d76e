"""What one speculative `generate()` call did, readable afterwards as `drafter.speculation_stats`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculationStats:
    """Counters of one generate() call.

    `tau` is the mean number of tokens emitted per speculative target forward (accepted draft tokens
    plus the target's own bonus token). `acceptance_per_depth[d]` is the rate at which the draft
    token at depth `d + 1` was accepted, given that every shallower draft token on its path was.
    A batched call counts each row's step as one forward (so `tau` is the mean over rows and steps)
    and keeps each row's own counters in `per_row`.
    """

    mode: str = "chain"
    speculative_forwards: int = 0
    speculative_tokens: int = 0
    plain_steps: int = 0
    fallbacks: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    plain_seconds: float = 0.0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    accepted_ranks: list[list[int]] = field(default_factory=list, repr=False)
    frontier_ranks: list[list[int]] = field(default_factory=list, repr=False)  # each step's tree's (drafting.py)
    per_row: list["SpeculationStats"] = field(default_factory=list, repr=False)  # batched calls: one per prompt

    def record_step(
        self, proposed_depth: int, accepted_depth: int, emitted: int, forwards: int = 1, ranks: list[int] | None = None,
        frontier_ranks: list[int] | None = None,
    ) -> None:
        """Record one speculative step: a path `proposed_depth` deep was drafted, `accepted_depth` accepted.

        `ranks` are the score ranks of the accepted draft tokens (their position along a chain), `frontier_ranks`
        the tree's (how deep a smaller tree would have drafted); `hf_eagle31.tuning` uses both to evaluate smaller
        drafts from the same run.
        """
        self.accepted_ranks.append(list(range(accepted_depth)) if ranks is None else ranks)
        self.frontier_ranks.append(frontier_ranks or [])
        self.speculative_forwards += forwards
        self.speculative_tokens += emitted
        grow = proposed_depth - len(self.reached)
        if grow > 0:
            self.reached += [0] * grow
            self.accepted += [0] * grow
        for depth in range(min(accepted_depth + 1, proposed_depth)):
            self.reached[depth] += 1
            self.accepted[depth] += depth < accepted_depth

    @property
    def tau(self) -> float:
        return self.speculative_tokens / max(self.speculative_forwards, 1)

    @property
    def acceptance_per_depth(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached)]

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "tau": self.tau,
            "acceptance_per_depth": self.acceptance_per_depth,
            "speculative_forwards": self.speculative_forwards,
            "speculative_tokens": self.speculative_tokens,
            "plain_steps": self.plain_steps,
            "fallbacks": self.fallbacks,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "plain_seconds": self.plain_seconds,
            **({"per_row_tau": [row.tau for row in self.per_row]} if self.per_row else {}),
        }
