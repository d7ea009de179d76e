"""Runtime control of speculation: how far to draft, and whether drafting pays at all.

Neither can change the output: they only decide how many draft tokens are proposed, and the
verification step is lossless for any proposal (including none).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

logger = logging.getLogger("hf_eagle31")


def draft_depth(tree_depth: int, length: int, max_length: int) -> int:
    """How deep to draft after a sequence of `length` tokens: `tree_depth`, but no draft token at position
    `max_length - 1` or later (it could not be emitted), a position plain decoding never computes
    and a target with learned positions (GPT-2, OPT) may have no embedding for."""
    return min(tree_depth, max_length - length - 1)


@dataclass
class DepthController:
    """A PID controller of the tree depth (a chain's length) on the recent hit rate (accepted / proposed depth).

    Deep drafts are cheap when they are accepted and wasted when they are not: the controller
    deepens the draft while the hit rate stays above `setpoint` and makes it shallower when it drops,
    always within `[min_depth, max_depth]`. It is deterministic: the same acceptance history gives the
    same depths.
    """

    min_depth: int
    max_depth: int
    depth: float  # where the controller stands; drafts are `tree_depth` deep
    setpoint: float = 0.6
    kp: float = 2.0
    ki: float = 0.2
    kd: float = 0.5
    integral_limit: float = 3.0
    integral: float = 0.0
    previous_error: float = 0.0

    @property
    def tree_depth(self) -> int:
        return int(round(self.depth))

    def update(self, proposed: int, accepted: int) -> int:
        if proposed <= 0:
            return self.tree_depth
        error = accepted / proposed - self.setpoint
        self.integral = max(-self.integral_limit, min(self.integral_limit, self.integral + error))
        delta = self.kp * error + self.ki * self.integral + self.kd * (error - self.previous_error)
        self.previous_error = error
        self.depth = max(float(self.min_depth), min(float(self.max_depth), self.depth + delta))
        return self.tree_depth


@dataclass
class CollapseMonitor:
    """Falls back to plain decoding when speculation is measured to be slower, and probes again later.

    Every `check_every` speculative steps it compares tokens per second over the last `window`
    steps with the plain rate `1 / t_plain`, and loses the check when speculation is clearly
    slower (below `margin` of the plain rate) or when no draft token at all was accepted. The
    window is long because per-step acceptance is noisy: judged over 4 steps alone, a drafter that
    pays on average loses checks to short hard stretches and spends its gains on plain steps. Each
    fallback starts the window afresh, so a probe is judged on what the drafter does now; a
    collapsed drafter still loses its first check, after `check_every` steps. Until a plain step
    has been timed (a batch times one first: `plain_left`), `t_plain` is taken as the verify time
    of a speculative step, an upper bound that favours speculation. After a lost check it runs
    `backoff` plain steps, doubling the backoff after each losing probe (up to `max_backoff`) and
    halving it after a winning check, so the number of wasted draft steps grows only
    logarithmically with the output length. It warns once, after `warn_after` lost checks in a
    row: one is often just a hard stretch of text.
    """

    check_every: int = 4
    window: int = 16
    margin: float = 0.9
    initial_backoff: int = 8
    max_backoff: int = 256
    warn_after: int = 3  # losing checks in a row before one warning
    enabled: bool = True

    def __post_init__(self) -> None:
        self.backoff = self.initial_backoff
        self.plain_left = 0
        self.plain_time: float | None = None
        self.fallbacks = 0
        self.losing_streak = 0
        self.streak = [0.0, 0]  # tokens emitted and speculative steps in the checks of the losing streak
        self.warned = False
        self.recent: deque[tuple[float, float, float]] = deque(maxlen=self.window)  # (tokens, seconds, verify s)
        self.unchecked = 0

    def should_speculate(self) -> bool:
        return not self.enabled or self.plain_left == 0

    def record_plain(self, seconds: float) -> None:
        self.plain_left = max(self.plain_left - 1, 0)
        self.plain_time = seconds if self.plain_time is None else 0.8 * self.plain_time + 0.2 * seconds

    def record_speculative(self, emitted: float, seconds: float, verify_seconds: float) -> None:
        if not self.enabled:
            return
        self.recent.append((emitted, seconds, verify_seconds))
        self.unchecked += 1
        if self.unchecked >= self.check_every:
            self.unchecked = 0
            self._judge()

    def _judge(self) -> None:
        steps = len(self.recent)
        tokens, seconds, verify_seconds = (sum(column) for column in zip(*self.recent))
        plain_time = self.plain_time or verify_seconds / steps
        relative_rate = tokens / max(seconds, 1e-9) * plain_time
        nothing_accepted = tokens <= steps  # one token per step: never pays
        if not nothing_accepted and relative_rate >= self.margin:
            self.losing_streak, self.streak = 0, [0.0, 0]  # one good check may be a fluke: relax the backoff gradually
            self.backoff = max(self.initial_backoff, self.backoff // 2)
            return
        self.losing_streak += 1
        self.streak = [self.streak[0] + tokens, self.streak[1] + steps]
        if self.losing_streak == self.warn_after and not self.warned:  # a hard stretch of text is no news
            self.warned = True
            self._warn(relative_rate)
        self.fallbacks += 1
        self.plain_left = self.backoff
        self.backoff = min(2 * self.backoff, self.max_backoff)
        self.recent.clear()

    def _warn(self, relative_rate: float) -> None:
        """Say that speculation lost, and why as far as the losing checks tell: a drafter that none of their steps
        accepted anything of (a probe of a few steps accepting nothing on a hard stretch is no such sign), or one
        accepted too rarely for this device's verify cost."""
        tokens, steps = self.streak
        logger.warning(
            "EAGLE speculation was slower than plain decoding %d checks in a row (%.2f tokens per plain-step time, "
            "%.1f tokens a step over those checks); decoding plainly and probing again later. %s",
            self.losing_streak, relative_rate, tokens / steps,
            "Nothing was accepted: is this drafter trained for this target?" if tokens <= steps else
            "The drafter is accepted too rarely for this device's verify cost; a shorter draft (tune_drafter) or a "
            "better-trained drafter may pay.")
