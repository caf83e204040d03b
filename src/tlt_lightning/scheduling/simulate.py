"""A simulated speculative-decoding environment with known best arms, and a strategy run on it.

The model is parametric and pure Python, so a run takes seconds and its answer is known:

* accepted tokens per request and step: a chain of depth ``d`` with per-token acceptance ``a``
  emits ``(1 - a**(d+1)) / (1 - a)`` tokens (diminishing returns in ``d``); a tree of width
  ``w = min(topk, num_draft_tokens / num_steps)`` acts as a chain with acceptance
  ``1 - (1 - a) ** (w ** tree_width_exponent)``; SD off emits exactly 1.
* step time: ``base_time + token_time * B * (1 + verified)`` for the target (a fixed memory-bound
  part plus compute growing with batch x verified tokens) ``+ num_steps * (draft_time +
  draft_token_time * B * topk)`` for the drafter. So SD wins at small batch and loses at large.
* noise: log-normal, multiplicative, on the tokens beyond the first (``noise``, mean one: the expected
  tokens are their mean) and on step time (``noise / 2``).
* at ``change_at`` the drafter gets worse (``acceptance`` -> ``acceptance_after_change``), which
  changes the best arm of some buckets.

:func:`run_strategy` drives one strategy on it; the bandit benchmark (``benchmarks/bandit.py`` in a
checkout) runs BEG-MAB, UCB and every fixed arm on the same batch sizes and noise.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tlt_lightning.scheduling.bucketed import BucketedStrategy, default_arms
from tlt_lightning.scheduling.step_cost import step_seconds
from tlt_lightning.speculative import Arm

__all__ = ["SimulatedSDEnvironment", "run_strategy"]


@dataclass
class SimulatedSDEnvironment:
    """Tokens/s of each arm at each batch size, with noise and a drafter that degrades mid-run.

    Args:
        batch_sizes: batch sizes drawn uniformly at random each step (one per default bucket).
        acceptance: drafter per-token acceptance before ``change_at``, in ``(0, 1)``.
        acceptance_after_change: acceptance from step ``change_at`` on, in ``(0, 1)``.
        change_at: step at which the drafter changes; ``None`` for never.
        noise: log-normal sigma of the accepted tokens (step time gets half), ``>= 0``.
        base_time, token_time, draft_time, draft_token_time: cost model, seconds (``>= 0``).
        tree_width_exponent: how much a tree's width helps acceptance, in ``(0, 1]``.
        seed: seeds the environment's own RNGs (batch sizes and noise are separate streams, so
            every strategy sees the same batch sizes and noise draws).

    Example:
        >>> from tlt_lightning.speculative import arm_key
        >>> env = SimulatedSDEnvironment(change_at=None)
        >>> arm_key(env.best_arm(1, step=0)), arm_key(env.best_arm(48, step=0))
        ('tree5x4/15', 'chain1')
    """

    batch_sizes: tuple[int, ...] = (1, 3, 12, 48)
    acceptance: float = 0.75
    acceptance_after_change: float = 0.45
    change_at: int | None = 4000
    noise: float = 0.1
    base_time: float = 0.04
    token_time: float = 0.0015
    draft_time: float = 0.006
    draft_token_time: float = 0.00005
    tree_width_exponent: float = 0.7
    seed: int = 0
    _batch_rng: random.Random = field(init=False, repr=False)
    _noise_rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(
            isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.batch_sizes
        ):
            raise ValueError(f"batch_sizes must be non-empty ints >= 1, got {self.batch_sizes!r}")
        for name in ("acceptance", "acceptance_after_change"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)!r}")
        if self.change_at is not None and self.change_at < 0:
            raise ValueError(f"change_at must be None or >= 0, got {self.change_at!r}")
        for name in ("noise", "base_time", "token_time", "draft_time", "draft_token_time"):
            if not 0.0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)!r}")
        if self.base_time == 0 and self.token_time == 0:
            raise ValueError("base_time and token_time cannot both be 0 (steps would take no time)")
        if not 0.0 < self.tree_width_exponent <= 1.0:
            raise ValueError(f"tree_width_exponent must be in (0, 1], got {self.tree_width_exponent!r}")
        self._batch_rng = random.Random(f"{self.seed}/batch")
        self._noise_rng = random.Random(f"{self.seed}/noise")

    def acceptance_at(self, step: int) -> float:
        changed = self.change_at is not None and step >= self.change_at
        return self.acceptance_after_change if changed else self.acceptance

    def expected_tokens(self, arm: Arm, step: int) -> float:
        """Mean tokens emitted per request in one step (noise-free)."""
        if arm is None:
            return 1.0
        width = min(arm.topk, arm.num_draft_tokens / arm.num_steps) ** self.tree_width_exponent
        a = 1.0 - (1.0 - self.acceptance_at(step)) ** width
        return (1.0 - a ** (arm.num_steps + 1)) / (1.0 - a)

    def expected_step_time(self, batch_size: int, arm: Arm) -> float:
        """Seconds of one step (noise-free)."""
        return step_seconds(
            self.base_time, self.token_time, self.draft_time, self.draft_token_time, batch_size, arm
        )

    def expected_reward(self, batch_size: int, arm: Arm, step: int) -> float:
        """Noise-free tokens/s: the expected tokens (the noisy ones' mean) over the noise-free step time."""
        return self.expected_tokens(arm, step) * batch_size / self.expected_step_time(batch_size, arm)

    def best_arm(self, batch_size: int, step: int, arms: Sequence[Arm] | None = None) -> Arm:
        """The arm with the highest expected reward (first one on ties)."""
        arms = default_arms() if arms is None else arms
        return max(arms, key=lambda arm: self.expected_reward(batch_size, arm, step))

    def sample_batch_size(self) -> int:
        return self._batch_rng.choice(self.batch_sizes)

    def observe(self, batch_size: int, arm: Arm, step: int) -> tuple[float, float]:
        """One noisy step: ``(accepted_tokens, step_time)``; always draws the same amount of noise."""
        z_tokens, z_time = self._noise_rng.gauss(0.0, 1.0), self._noise_rng.gauss(0.0, 1.0)
        tokens = self.expected_tokens(arm, step)
        if arm is not None:  # plain decoding emits exactly one token; a speculative step at least one
            tokens = 1.0 + (tokens - 1.0) * math.exp(self.noise * z_tokens - self.noise**2 / 2)
        seconds = self.expected_step_time(batch_size, arm) * math.exp(0.5 * self.noise * z_time)
        return tokens, seconds


def run_strategy(strategy: BucketedStrategy, env: SimulatedSDEnvironment, steps: int) -> list[dict[str, Any]]:
    """Run ``strategy`` for ``steps`` steps; per step: batch size, arm, mode, reward, oracle reward."""
    trace = []
    for t in range(steps):
        batch_size = env.sample_batch_size()
        arm = strategy.select(batch_size)
        tokens, seconds = env.observe(batch_size, arm, t)
        strategy.update(batch_size, arm, tokens, seconds)
        best = env.best_arm(batch_size, t)
        trace.append(
            {
                "step": t,
                "batch_size": batch_size,
                "arm": arm,
                "mode": strategy.last_decision.mode,
                "reward": tokens * batch_size / seconds,
                "best": best,
                "oracle": env.expected_reward(batch_size, best, t),
            }
        )
    return trace
