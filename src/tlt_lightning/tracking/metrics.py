"""torchmetrics ``Metric``s over rollout stats: they accumulate across rollouts and sync across ranks.

Example:
    >>> from tlt_lightning.rollout import RolloutStats
    >>> metric = MeanAcceptLength()
    >>> metric.update(RolloutStats(accept_lengths=torch.tensor([3, 5, 1])))
    >>> float(metric.compute())
    3.0
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

from tlt_lightning.rollout.types import RolloutStats

__all__ = ["AcceptanceRate", "MeanAcceptLength", "RolloutTokensPerSecond"]


class MeanAcceptLength(Metric):
    """Mean tokens emitted per request per speculative step; ``NaN`` when no speculative step ran.

    Never ``0``, a value no speculative step can take: a logged ``NaN`` (a rollout that did not
    speculate) is a gap in a run's history and drops out of averages, where a ``0`` would skew them.
    (Lightning logs a value every step once logged, so a step that logged nothing would repeat the last.)
    """

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("emitted", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("steps", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, stats: RolloutStats) -> None:
        self.emitted += stats.accept_lengths.sum().to(self.emitted)
        self.steps += stats.accept_lengths.numel()

    def compute(self) -> torch.Tensor:
        if self.steps == 0:
            return torch.tensor(float("nan"), dtype=self.emitted.dtype, device=self.emitted.device)
        return self.emitted / self.steps


class AcceptanceRate(Metric):
    """Accepted drafts over drafted depth: ``sum(accept_length - 1) / sum(depth)``.

    For a chain the depth is the number of drafted tokens (fewer than ``num_steps`` when a
    ``min_confidence`` chain stopped early); for a tree, the number of levels (the longest path
    that could be accepted).
    """

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("accepted", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("drafted", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, stats: RolloutStats) -> None:
        self.drafted += float(sum(d * n for d, n in zip(stats.step_draft_depths, stats.step_batch_sizes)))
        self.accepted += (stats.accept_lengths - 1).clamp(min=0).sum().to(self.accepted)

    def compute(self) -> torch.Tensor:
        return self.accepted / self.drafted.clamp(min=1)


class RolloutTokensPerSecond(Metric):
    """Generated tokens over wall-clock rollout seconds, pooled over rollouts (and ranks)."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("tokens", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("seconds", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, stats: RolloutStats) -> None:
        self.tokens += stats.generated_tokens
        self.seconds += stats.total_time

    def compute(self) -> torch.Tensor:
        return self.tokens / self.seconds.clamp(min=1e-9)
