"""Baselines with BEGMABStrategy's interface: one fixed arm, and sliding-window UCB1 per bucket."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from tlt_lightning.scheduling.bucketed import DEFAULT_BUCKET_THRESHOLDS, BucketedStrategy
from tlt_lightning.speculative import Arm, arm_key

__all__ = ["FixedStrategy", "UCBStrategy"]


class FixedStrategy(BucketedStrategy):
    """Always the same arm, at every batch size (e.g. "always chain4" or, with ``None``, "SD off").

    It logs and reports like the bandits, so benchmarks treat every strategy alike; every decision
    after the first is an ``"exploit"`` one.

    Example:
        >>> from tlt_lightning.speculative import DraftSpec
        >>> FixedStrategy(DraftSpec(4)).select(32)
        DraftSpec(num_steps=4, topk=1, num_draft_tokens=4, sampled=False, min_confidence=0.0, fork_depth=1)
    """

    def __init__(self, arm: Arm, *, max_history: int = 20_000) -> None:
        super().__init__([arm], (1,), max_history=max_history)
        self.arm = arm
        self._sums = [0.0]

    def _choose(self, b: int, candidates: Sequence[int]) -> tuple[int, str]:
        return 0, "exploit"

    def _observe(self, b: int, i: int, reward: float) -> None:
        self._sums[i] += reward

    def _value(self, b: int, i: int) -> float | None:
        return self._sums[i] / self._counts[b][i] if self._counts[b][i] else None

    def _extra_state(self) -> dict[str, Any]:
        return {"reward_sum": self._sums[0]}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        self._sums[0] = float(state.get("reward_sum", self._sums[0]))


class UCBStrategy(BucketedStrategy):
    """Sliding-window UCB1 per batch-size bucket (Garivier & Moulines' SW-UCB).

    Each bucket keeps its last ``window`` plays (arm, reward), whatever the arm. Untried arms go
    first. Then, with ``n_i`` the plays of arm ``i`` in the window, ``N`` the window length and
    ``mean_i`` their mean reward, it picks ``argmax mean_i / M + c * sqrt(ln N / n_i)``; an arm with
    no play left in the window (``n_i == 0``) is picked at once, logged as ``"explore"``.

    Normalisation: tokens/s scale with batch size, so rewards are divided by ``M``, the largest
    reward in the bucket's current window, which puts them in ``[0, 1]`` as UCB1 assumes and keeps
    ``c`` meaningful in every bucket. Because the window holds plays of all arms, each arm is
    retried at least once per ``window`` plays and stale statistics expire. Deterministic (ties go
    to the first arm), so it needs no seed. Other decisions are logged as ``"exploit"``.

    Args:
        arms: as for :class:`~tlt_lightning.scheduling.BEGMABStrategy` (``None``: default arms).
        bucket_thresholds: strictly increasing ints starting at 1.
        c: exploration weight (``>= 0``) on the normalised scale.
        window: plays kept per bucket (``>= 1``).
        max_history: decisions kept in ``history``.

    Example:
        >>> ucb = UCBStrategy(c=0.05)
        >>> arm = ucb.select(1)
        >>> ucb.update(1, arm, accepted_tokens=1.0, step_time=0.05)
    """

    def __init__(
        self,
        arms: Sequence[Arm] | Sequence[Sequence[Arm]] | None = None,
        bucket_thresholds: Sequence[int] = DEFAULT_BUCKET_THRESHOLDS,
        c: float = 0.05,
        window: int = 300,
        *,
        max_history: int = 20_000,
    ) -> None:
        super().__init__(arms, bucket_thresholds, max_history=max_history)
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c < math.inf:
            raise ValueError(f"c must be a finite number >= 0, got {c!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.c, self.window = float(c), window
        self._plays: list[deque[tuple[int, float]]] = [deque(maxlen=window) for _ in self.arms]

    def _window_stats(self, b: int) -> tuple[list[int], list[float]]:
        # Recomputed from the window on each call (cheap: <= window plays) rather than kept as running
        # sums, so a restored instance computes bit-identical scores and makes identical decisions.
        n, sums = [0] * len(self.arms[b]), [0.0] * len(self.arms[b])
        for i, r in self._plays[b]:
            n[i] += 1
            sums[i] += r
        return n, sums

    def _choose(self, b: int, candidates: Sequence[int]) -> tuple[int, str]:
        n, sums = self._window_stats(b)
        empty = next((i for i in candidates if n[i] == 0), None)
        if empty is not None:
            return empty, "explore"
        top = max(r for _, r in self._plays[b]) or 1.0
        log_n = math.log(len(self._plays[b]))

        def score(i: int) -> float:
            return sums[i] / n[i] / top + self.c * math.sqrt(log_n / n[i])

        return max(candidates, key=score), "exploit"

    def _observe(self, b: int, i: int, reward: float) -> None:
        self._plays[b].append((i, reward))

    def _value(self, b: int, i: int) -> float | None:
        n, sums = self._window_stats(b)
        return sums[i] / n[i] if n[i] else None

    def _extra_state(self) -> dict[str, Any]:
        return {
            "plays": {
                label: [[arm_key(self.arms[b][i]), r] for i, r in self._plays[b]]
                for b, label in enumerate(self.bucket_labels)
            }
        }

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        if "plays" not in state:
            return
        plays: list[deque[tuple[int, float]]] = [deque(maxlen=self.window) for _ in self.arms]
        for label, rows in state["plays"].items():
            b = self._bucket_index(label, "plays")
            for key, reward in rows:
                plays[b].append((self._index[b][self._arm_by_key(b, key, "plays")], float(reward)))
        self._plays = plays
