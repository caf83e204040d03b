"""BEGMABStrategy: a bucketed epsilon-greedy bandit that picks the speculative-decoding arm.

Speculative decoding pays when few requests are still running (the long tail) and can lose at
large batch, where verifying drafted tokens costs real compute. Which arm wins depends on the
batch size and on how good the drafter currently is, so it is learned online: one bandit per
batch-size bucket, reward = tokens per second, statistics over a sliding window so that it follows
the drafter (and the policy) as they change.

:class:`~tlt_lightning.scheduling.bucketed.BucketedStrategy` holds what every strategy shares
(bucketing, validation, the decision log, state, heat map); :class:`BEGMABStrategy` adds the
epsilon-greedy rule. Baselines with the same interface live in :mod:`tlt_lightning.scheduling.baselines`;
reproducible mode (:class:`~tlt_lightning.scheduling.step_cost.StepCostModel`) is described in
:mod:`tlt_lightning.scheduling.step_cost`.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from tlt_lightning.scheduling.bucketed import DEFAULT_BUCKET_THRESHOLDS, BucketedStrategy
from tlt_lightning.scheduling.step_cost import StepCostModel
from tlt_lightning.speculative import Arm, arm_key

__all__ = ["STATISTICS", "BEGMABStrategy"]

STATISTICS = {"mean": statistics.fmean, "median": statistics.median}
"""How :class:`BEGMABStrategy` rates an arm's window of rewards."""


class BEGMABStrategy(BucketedStrategy):
    """Bucketed Epsilon-Greedy Multi-Armed Bandit (TLT's BEG-MAB) over speculative-decoding strategies.

    This is a *bandit* strategy that picks how to decode; it is **not** a Lightning ``Strategy``
    (ddp, fsdp, ...) and is not registered in Lightning's strategy registry.

    Per batch-size bucket it first tries every untried arm; afterwards, with probability
    ``epsilon`` it runs a random arm, otherwise the arm with the best mean reward over its last
    ``window`` rewards in that bucket. Reward = ``accepted_tokens * batch_size / step_time``
    (tokens/s). The window lets it follow a drafter (or policy) that changes during training.
    Randomness comes from its own ``random.Random(seed)``.

    The mean, not the median: a speculative step's tokens are skewed at small batch (at batch 1 and an
    acceptance of 0.5, half of a chain's steps emit one token and the rest two to seven), and what
    decides the rollout's speed is their mean. The median of such a window rates a chain at about one
    token per step, below plain decoding whatever its mean: in the long-tail job the median bandit ran
    plain decoding in most batch-1 steps while its chains emitted 1.8-2.0 tokens per step for about 1.3
    plain steps' time (docs/benchmarks.md, `e2e`). A stall pulls the mean down by its share of the
    window only. ``statistic="median"`` keeps the older rule.

    Exploring costs: on a CPU a random tree arm at batch 20 is several times slower than plain
    decoding. With ``epsilon_half_life`` a bucket's exploration probability decays with the
    decisions taken in it, ``epsilon_floor + (epsilon - epsilon_floor) * 0.5 ** (n / half_life)``,
    so well-known buckets explore less; the floor keeps the bandit able to notice a change of the
    best arm (more slowly, the lower it is).

    Args:
        arms: one sequence of arms for all buckets or one per bucket (``None``: :func:`default_arms`).
        bucket_thresholds: strictly increasing ints starting at 1 (default ``(1, 2, 5, 21)``:
            buckets ``1``, ``2-4``, ``5-20``, ``21+``).
        epsilon: exploration probability in ``[0, 1]`` (the initial one with a half-life).
        window: rewards kept per bucket and arm (``>= 1``).
        statistic: how an arm's window is rated, ``"mean"`` (its throughput) or ``"median"``.
        epsilon_half_life: decisions in a bucket after which its epsilon has decayed halfway to
            ``epsilon_floor`` (``>= 1``); ``None``: constant ``epsilon``.
        epsilon_floor: the exploration probability a decaying epsilon tends to, in ``[0, epsilon]``
            (used only with ``epsilon_half_life``).
        seed: seed of the bandit's own RNG.
        max_history: decisions kept in ``history``.
        per_request: compare arms on tokens per second per request (see :class:`BucketedStrategy`).
        cost_model: reproducible mode (see :class:`BucketedStrategy`): rewards from a
            :class:`StepCostModel` instead of wall time.

    Example:
        >>> bandit = BEGMABStrategy(seed=0)
        >>> arm = bandit.select(batch_size=3)
        >>> bandit.update(3, arm, accepted_tokens=2.5, step_time=0.05)
        >>> bandit.history[-1].reward
        150.0
    """

    def __init__(
        self,
        arms: Sequence[Arm] | Sequence[Sequence[Arm]] | None = None,
        bucket_thresholds: Sequence[int] = DEFAULT_BUCKET_THRESHOLDS,
        epsilon: float = 0.1,
        window: int = 300,
        seed: int = 0,
        *,
        statistic: str = "mean",
        epsilon_half_life: int | None = None,
        epsilon_floor: float = 0.01,
        max_history: int = 20_000,
        per_request: bool = False,
        cost_model: StepCostModel | None = None,
    ) -> None:
        super().__init__(
            arms, bucket_thresholds, max_history=max_history, per_request=per_request, cost_model=cost_model
        )
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be a number in [0, 1], got {epsilon!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        if epsilon_half_life is not None and (
            isinstance(epsilon_half_life, bool)
            or not isinstance(epsilon_half_life, int)
            or epsilon_half_life < 1
        ):
            raise ValueError(f"epsilon_half_life must be an int >= 1 or None, got {epsilon_half_life!r}")
        if epsilon_half_life is not None and (
            isinstance(epsilon_floor, bool)
            or not isinstance(epsilon_floor, (int, float))
            or not 0.0 <= epsilon_floor <= epsilon
        ):
            raise ValueError(
                f"epsilon_floor must be a number in [0, epsilon={epsilon}], got {epsilon_floor!r}"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {sorted(STATISTICS)}, got {statistic!r}")
        self.epsilon, self.window, self.seed, self.statistic = float(epsilon), window, seed, statistic
        self.epsilon_half_life, self.epsilon_floor = epsilon_half_life, float(epsilon_floor)
        self._rng = random.Random(seed)
        self._windows = [[deque(maxlen=window) for _ in bucket] for bucket in self.arms]
        self._rated: dict[tuple[int, int], float] = {}  # cache, invalidated on every new reward

    def epsilon_of(self, bucket: int) -> float:
        """The exploration probability of bucket index ``bucket`` now (decayed with its decisions)."""
        if self.epsilon_half_life is None:
            return self.epsilon
        n = sum(self._counts[bucket])
        return self.epsilon_floor + (self.epsilon - self.epsilon_floor) * 0.5 ** (n / self.epsilon_half_life)

    def _choose(self, b: int, candidates: Sequence[int]) -> tuple[int, str]:
        if self._rng.random() < self.epsilon_of(b):
            return candidates[self._rng.randrange(len(candidates))], "explore"
        return max(candidates, key=lambda i: self._rate(b, i)), "exploit"

    def _rate(self, b: int, i: int) -> float:
        if (b, i) not in self._rated:
            window = self._windows[b][i]
            self._rated[b, i] = STATISTICS[self.statistic](window) if window else -math.inf
        return self._rated[b, i]

    def _observe(self, b: int, i: int, reward: float) -> None:
        self._windows[b][i].append(reward)
        self._rated.pop((b, i), None)

    def _value(self, b: int, i: int) -> float | None:
        return self._rate(b, i) if self._windows[b][i] else None

    def _extra_state(self) -> dict[str, Any]:
        version, internal, gauss = self._rng.getstate()
        return {
            "windows": {
                label: {arm_key(a): list(w) for a, w in zip(arms, windows)}
                for label, arms, windows in zip(self.bucket_labels, self.arms, self._windows)
            },
            "rng_state": [version, list(internal), gauss],
        }

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        windows = self._windows
        if "windows" in state:
            windows = [[deque(maxlen=self.window) for _ in bucket] for bucket in self.arms]
            for b, i, rewards in self._iter_arm_table(state["windows"], "windows"):
                windows[b][i].extend(float(r) for r in rewards)
        rng = self._rng
        if "rng_state" in state:
            rng = random.Random()
            try:
                version, internal, gauss = state["rng_state"]
                rng.setstate((version, tuple(internal), gauss))
            except (TypeError, ValueError) as err:
                raise ValueError(f"state_dict rng_state is not a random.Random state: {err}") from err
        self._windows, self._rng = windows, rng
        self._rated.clear()
