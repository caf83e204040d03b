"""Where speculation pays on this machine: measured step costs against the drafter's acceptance.

A speculative step of arm ``a`` at ``B`` active requests emits ``E_a(alpha)`` tokens per request
(``alpha``: the probability the target accepts one drafted token) for ``t_a(B)`` seconds, plain decoding
one token for ``t_off(B)``; the arm pays where ``E_a(alpha) * t_off(B) / t_a(B) >= 1``. On a CPU the
verify is weight-bound at one row (drafted tokens ride along almost free) and compute-bound from a few
rows on (SmolLM2, one core, 7 rows: 3 queries cost 1.8x one), so the crossover moves with the machine:
:class:`StepCosts` holds ``t`` measured on it
(:func:`~tlt_lightning.rl.crossover.measure_step_costs`), and a strategy given them
(:meth:`~tlt_lightning.scheduling.BucketedStrategy.use_step_costs`) tries an arm predicted to lose at the
batch size at hand only as a rare probe. The bandit picks among the rest, and learns ``alpha`` from its steps.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tlt_lightning.speculative import Arm, DraftSpec, arm_key

__all__ = ["StepCosts", "estimate_accept", "expected_tokens", "paying_arms", "predicted_speedup"]


def _level_branching(arm: DraftSpec) -> list[int]:
    """Candidates the target may accept from at each draft level (optimistic for EAGLE-2 trees, which
    keep only their ``num_draft_tokens`` best nodes)."""
    if arm.is_chain:
        return [1] * arm.num_steps
    forks = arm.fork_depth if arm.sampled else arm.num_steps
    return [arm.topk if level < forks else 1 for level in range(arm.num_steps)]


def expected_tokens(arm: Arm, accept: float) -> float:
    """Tokens one request emits per step of ``arm`` when each draft is accepted with probability
    ``accept`` (independently): ``sum_l prod_{j<=l} a_j`` over levels ``0..depth``, ``a_j = 1 - (1 -
    accept) ** w_j`` with ``w_j`` candidates at level ``j``. Plain decoding (``None``) emits 1.

    Example:
        >>> round(expected_tokens(DraftSpec(2), 0.5), 3)
        1.75
        >>> expected_tokens(None, 0.9)
        1.0
    """
    if arm is None:
        return 1.0
    total, reach = 1.0, 1.0
    for width in _level_branching(arm):
        reach *= 1.0 - (1.0 - accept) ** width
        total += reach
    return total


def estimate_accept(
    observations: Iterable[tuple[Arm, float, int]], lo: float = 0.0, hi: float = 1.0
) -> float:
    """The ``alpha`` at which the arms' expected tokens match the observed ones (weighted by requests).

    Args:
        observations: ``(arm, mean tokens per request in the step, requests)`` of speculative steps.

    Returns:
        ``alpha`` in ``[lo, hi]`` solving ``sum_i n_i (E_{arm_i}(alpha) - t_i) = 0`` (bisection: ``E``
        grows with ``alpha``); ``nan`` without observations.

    Example:
        >>> round(estimate_accept([(DraftSpec(2), 1.75, 4)]), 3)
        0.5
    """
    steps = [(arm, float(t), n) for arm, t, n in observations if arm is not None and n > 0]
    if not steps:
        return math.nan

    def excess(alpha: float) -> float:
        return sum(n * (expected_tokens(arm, alpha) - t) for arm, t, n in steps)

    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class StepCosts:
    """Median seconds of one decode step by active requests and arm, measured on one machine.

    Args:
        seconds: ``{batch size: {arm_key: seconds}}`` (``"off"``: plain decoding); between measured batch
            sizes the cost is interpolated linearly, beyond them the nearest one's is used.
        context: cached positions per row the steps were measured at.
        machine: what they were measured on (:func:`~tlt_lightning.reports.machine_info` and the rollout
            settings): a stored table is reused only where this matches.

    Example:
        >>> costs = StepCosts({1: {"off": 0.020, "chain2": 0.030}, 7: {"off": 0.030, "chain2": 0.065}}, 480)
        >>> round(costs.step_seconds(4, DraftSpec(2)), 4)
        0.0475
    """

    seconds: Mapping[int, Mapping[str, float]]
    context: int
    machine: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        table = {int(b): {str(k): float(s) for k, s in row.items()} for b, row in self.seconds.items()}
        if not table or min(table) < 1:
            raise ValueError(f"StepCosts.seconds needs batch sizes >= 1, got {sorted(table)}")
        bad = [(b, k, s) for b, row in table.items() for k, s in row.items() if not 0 < s < math.inf]
        if bad:
            raise ValueError(f"StepCosts.seconds must be finite and > 0, got {bad[:3]}")
        object.__setattr__(self, "seconds", dict(sorted(table.items())))

    def step_seconds(self, batch_size: int, arm: Arm) -> float | None:
        """Seconds of one step of ``arm`` at ``batch_size`` requests; ``None``: the arm was not measured."""
        key = arm_key(arm)
        sizes = [b for b, row in self.seconds.items() if key in row]
        if not sizes:
            return None
        i = bisect.bisect_left(sizes, batch_size)
        if i == len(sizes) or sizes[i] == batch_size or i == 0:
            return self.seconds[sizes[min(i, len(sizes) - 1)]][key]
        b0, b1 = sizes[i - 1], sizes[i]
        s0, s1 = self.seconds[b0][key], self.seconds[b1][key]
        return s0 + (s1 - s0) * (batch_size - b0) / (b1 - b0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seconds": {str(b): row for b, row in self.seconds.items()},
            "context": self.context,
            "machine": dict(self.machine),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepCosts:
        return cls(data["seconds"], int(data["context"]), data.get("machine", {}))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # ranks may store the same table at once
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)  # a reader never sees half a table
        return path

    @classmethod
    def load(cls, path: str | Path) -> StepCosts:
        return cls.from_dict(json.loads(Path(path).read_text()))


def predicted_speedup(costs: StepCosts, batch_size: int, arm: Arm, accept: float) -> float | None:
    """``E_arm(accept) * t_off(B) / t_arm(B)``: the arm's tokens/s over plain decoding's; ``None``
    where either cost was not measured.

    Example:
        >>> costs = StepCosts({7: {"off": 0.030, "chain2": 0.065}}, 480)
        >>> round(predicted_speedup(costs, 7, DraftSpec(2), 0.64), 2)
        0.95
    """
    plain, spec = costs.step_seconds(batch_size, None), costs.step_seconds(batch_size, arm)
    if plain is None or spec is None:
        return None
    return expected_tokens(arm, accept) * plain / spec


def paying_arms(
    costs: StepCosts, arms: Iterable[Arm], batch_size: int, accept: float, margin: float = 1.0
) -> tuple[Arm, ...]:
    """The ``arms`` worth trying at ``batch_size``: plain decoding, those predicted at least ``margin``
    times plain's tokens/s, and those not measured (nothing is known against them).

    Example:
        >>> costs = StepCosts({1: {"off": 0.02, "chain2": 0.025}, 7: {"off": 0.03, "chain2": 0.065}}, 480)
        >>> [arm_key(a) for a in paying_arms(costs, [None, DraftSpec(2)], 7, accept=0.64)]
        ['off']
        >>> [arm_key(a) for a in paying_arms(costs, [None, DraftSpec(2)], 1, accept=0.64)]
        ['off', 'chain2']
    """
    kept = []
    for arm in arms:
        speedup = None if arm is None else predicted_speedup(costs, batch_size, arm, accept)
        if speedup is None or speedup >= margin:
            kept.append(arm)
    return tuple(kept)
