"""What speculation saved in a rollout: the budget of drafter training a single worker pays for.

A worker with no idle time (one process, or ranks that end their rollouts together) trains its
drafter on time the RL step pays (:meth:`~tlt_lightning.spot.SpotTrainer.train_paid`). That is an
investment, worth making only while speculation returns it. :class:`SavingsAccount` measures the
return: each speculative decode step against the plain step that would have emitted its tokens, the
plain step's seconds fit on the rollouts' own plain steps (:class:`PlainStepCost`, affine in the
active rows: a decode step reads every weight once, then does per-row work). Paid training then
draws on what speculation saved and stops when the account is empty: over a run, drafter training
costs at most ``share`` of the saving plus one drafter step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tlt_lightning.rollout.types import RolloutStats

__all__ = ["PlainStepCost", "SavingsAccount", "speculation_savings"]


@dataclass
class PlainStepCost:
    """Seconds of a plain decode step at ``b`` active rows, ``a + c * b`` by least squares over the
    plain steps observed (their mean while fewer than two batch sizes were seen).

    Example:
        >>> cost = PlainStepCost()
        >>> cost.observe([(1, 0.012), (3, 0.016), (5, 0.020)])
        >>> round(cost.seconds(2), 6), cost.seconds_known
        (0.014, True)
    """

    n: float = 0.0
    sum_b: float = 0.0
    sum_t: float = 0.0
    sum_bb: float = 0.0
    sum_bt: float = 0.0

    @property
    def seconds_known(self) -> bool:
        return self.n > 0

    def observe(self, steps: list[tuple[int, float]]) -> None:
        """Add plain steps, each ``(active rows, seconds)``."""
        for b, t in steps:
            self.n += 1
            self.sum_b, self.sum_t = self.sum_b + b, self.sum_t + t
            self.sum_bb, self.sum_bt = self.sum_bb + b * b, self.sum_bt + b * t

    def seconds(self, b: int) -> float:
        """The fitted seconds of one plain step at ``b`` rows (``> 0``); 0 before any observation."""
        if not self.n:
            return 0.0
        mean_b, mean_t = self.sum_b / self.n, self.sum_t / self.n
        var_b = self.sum_bb / self.n - mean_b**2
        if var_b <= 1e-9 * max(1.0, mean_b**2):  # one batch size so far
            return mean_t
        slope = (self.sum_bt / self.n - mean_b * mean_t) / var_b
        return max(mean_t + slope * (b - mean_b), 1e-3 * mean_t)

    def state_dict(self) -> dict[str, float]:
        return dict(vars(self))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, float(value))


def speculation_savings(stats: RolloutStats, cost: PlainStepCost) -> float:
    """Seconds the speculative decode steps of a rollout saved against plain decoding (``< 0``: lost).

    A speculative step at ``b`` rows that emitted ``k`` tokens replaced ``k / b`` plain steps (each
    emits one token a row) of ``cost.seconds(b)`` seconds; ``0`` while no plain step is known.
    """
    if not cost.seconds_known:
        return 0.0
    rows, times = stats.step_batch_sizes, stats.step_times
    return sum(
        stats.step_tokens[i] / rows[i] * cost.seconds(rows[i]) - times[i]
        for i, speculative in enumerate(stats.step_speculative)
        if speculative and rows[i] > 0
    )


@dataclass
class SavingsAccount:
    """What speculation saved, rollout after rollout, and the credit of paid drafter training:
    ``share`` of the savings, spent by the paid steps. A step starts while the credit is positive, so
    the balance stays above minus one drafter step.

    Args:
        share: the part of the savings paid drafter training may spend (``> 0``); ``None``: the
            savings are measured, the paid budget is the trainer's own (no credit kept).

    Example:
        >>> account = SavingsAccount(share=0.5)
        >>> account.cost.observe([(1, 0.010), (2, 0.012)])
        >>> stats = RolloutStats(step_batch_sizes=[1], step_times=[0.011], step_tokens=[3],
        ...                      step_speculative=[True])
        >>> round(account.deposit(stats), 6), round(account.budget_s(), 6)
        (0.019, 0.0095)
    """

    share: float | None = None
    credit: float = 0.0

    def __post_init__(self) -> None:
        self.cost = PlainStepCost()

    def deposit(self, stats: RolloutStats) -> float:
        """Learn the plain steps of a rollout, credit ``share`` of what its speculative steps saved
        (a loss is debited); returns the savings in seconds."""
        plain = zip(stats.step_batch_sizes, stats.step_times, stats.step_speculative)
        self.cost.observe([(b, t) for b, t, speculative in plain if not speculative])
        saved = speculation_savings(stats, self.cost)
        self.credit += (self.share or 0.0) * saved
        return saved

    def budget_s(self) -> float | None:
        """Seconds paid training may spend now (``<= 0``: none); ``None``: no bound from savings."""
        return None if self.share is None else self.credit

    def withdraw(self, seconds: float) -> None:
        """Paid training took ``seconds``."""
        if self.share is not None:
            self.credit -= seconds

    def state_dict(self) -> dict[str, Any]:
        return {"credit": self.credit, "cost": self.cost.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.credit = float(state.get("credit", self.credit))
        self.cost.load_state_dict(state.get("cost", {}))
