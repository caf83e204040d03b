"""Choosing which blocks to checkpoint: the exact optimum (a DP), static every-other-block, a greedy.

Why no learned (RL) policy, although the source describes one: for a fixed model and batch shape
the choice is a small knapsack that :func:`plan_optimal` solves exactly in milliseconds (blocks x
a few states per block). A learned policy can at best match the optimum, needs episodes of real training steps
to learn from, and cannot be trusted with a hard memory budget; re-profile and re-plan when the
shapes change instead. :func:`plan_greedy` shows what the per-block cost-benefit ratio (the
policy's input in the source) achieves on its own.
"""

from __future__ import annotations

import logging
import math

from tlt_lightning.efficiency.activation_profile import ActivationCheckpointPlan, ActivationCheckpointProfile
from tlt_lightning.validation import check, is_int

__all__ = ["plan_greedy", "plan_optimal", "plan_static"]

log = logging.getLogger(__name__)


def _check_budget(profile: ActivationCheckpointProfile, memory_budget: int) -> None:
    budget = memory_budget
    check(is_int(budget) and budget > 0, "memory_budget", budget, "a positive int (bytes)")
    if memory_budget < profile.min_peak_bytes:
        raise ValueError(
            f"memory_budget={memory_budget} bytes is below the minimum possible peak "
            f"{profile.min_peak_bytes} bytes (every block checkpointed)"
        )


def plan_static(
    profile: ActivationCheckpointProfile | int, every: int = 2, offset: int = 0
) -> ActivationCheckpointPlan:
    """Checkpoint blocks ``offset, offset + every, ...``: the static baseline (every other block).

    Args:
        profile: a profile (for the predictions) or just the number of blocks (predictions 0).
    """
    check(is_int(every) and every >= 1, "every", every, "an int >= 1")
    check(is_int(offset) and 0 <= offset < every, "offset", offset, f"an int in [0, every={every})")
    n = profile if isinstance(profile, int) else len(profile)
    flags = [i % every == offset for i in range(n)]
    if isinstance(profile, int):
        return ActivationCheckpointPlan(tuple(flags), 0, 0.0, f"static/{every}")
    return profile.plan(flags, f"static/{every}")


class _TooManyStates(Exception):
    pass


def _knapsack(
    profile: ActivationCheckpointProfile, memory_budget: int, unit: int, max_states: int | None
) -> int | None:
    """The cheapest feasible checkpoint bitmask with sizes in ``unit``-byte units (rounded up), or None.

    State after each block: (held units, transient inputs kept alive as a bitmask) -> (recompute
    seconds, checkpoint bitmask). States that another state beats on both held bytes and seconds
    (same transient mask) are dropped: every later step adds the same bytes to both, so the
    dominated one can never lead to a better plan.
    """
    cap = memory_budget // unit

    def q(x: int) -> int:
        return -((-x) // unit)  # ceil, also for negative deltas (conservative)

    states: dict[tuple[int, int], tuple[float, int]] = {(0, 0): (0.0, 0)}
    for i, (gap, block) in enumerate(zip(profile.gaps, profile.blocks)):
        nxt: dict[tuple[int, int], tuple[float, int]] = {}
        needs = sum(1 << j for j in set(block.transient))
        for (held, paid), (cost, mask) in states.items():
            if held + q(gap.peak_bytes) > cap:
                continue
            held += q(gap.delta_bytes)
            if held + q(block.peak_bytes) > cap:
                continue
            new = needs & ~paid
            fresh = sum(size for j, size in enumerate(profile.transient_bytes) if new >> j & 1)
            for key, value in (
                ((held + q(block.held_bytes), paid), (cost, mask)),
                ((held + q(block.output_bytes + fresh), paid | needs), (cost + block.seconds, mask | 1 << i)),
            ):
                if key[0] <= cap and (key not in nxt or value[0] < nxt[key][0]):
                    nxt[key] = value
        states = {}  # per transient mask, by held bytes ascending: keep each strictly cheaper state
        best: dict[int, float] = {}
        for held, paid in sorted(nxt, key=lambda k: (k[1], k[0])):
            cost, mask = nxt[held, paid]
            if cost < best.get(paid, float("inf")):
                best[paid] = cost
                states[held, paid] = (cost, mask)
        if max_states is not None and len(states) > max_states:
            raise _TooManyStates
    tail = profile.gaps[-1]
    final = [
        (cost, held, mask)
        for (held, _), (cost, mask) in states.items()
        if held + q(tail.peak_bytes) <= cap and held + q(tail.delta_bytes) <= cap
    ]
    return min(final)[2] if final else None


def plan_optimal(
    profile: ActivationCheckpointProfile,
    memory_budget: int,
    resolution: int = 4096,
    max_states: int = 100_000,
) -> ActivationCheckpointPlan:
    """The plan with the least recompute time whose predicted peak fits ``memory_budget`` bytes.

    A DP over the blocks in execution order: a 0/1 knapsack whose capacity is checked at every
    block, not only at the end (see :meth:`ActivationCheckpointProfile.peak_bytes`). Exact in bytes: states
    are (bytes held so far, transient inputs kept) with the dominated ones pruned, which stays small
    for real models (blocks of one kind have the same sizes). Should it pass ``max_states`` (sizes
    all different), the bytes are counted in units of ``ceil(memory_budget / resolution)``, each size
    rounded up: the plan still fits, and is optimal up to that rounding.

    Raises:
        ValueError: ``memory_budget`` below :attr:`ActivationCheckpointProfile.min_peak_bytes`, or not a
            positive int; ``resolution`` or ``max_states`` below 1.

    Example:
        >>> from tlt_lightning.efficiency.activation_profile import BlockCost, Gap
        >>> blocks = (BlockCost(10, 1, 10, 1.0), BlockCost(10, 1, 10, 1.0), BlockCost(10, 1, 10, 1.0))
        >>> profile = ActivationCheckpointProfile(blocks, (Gap(0, 0),) * 4)
        >>> plan_optimal(profile, 21).checkpointed  # the last block's recomputation comes first
        (True, False, False)
    """
    _check_budget(profile, memory_budget)
    for name, value in (("resolution", resolution), ("max_states", max_states)):
        check(is_int(value) and value >= 1, name, value, "an int >= 1")
    try:
        mask = _knapsack(profile, memory_budget, 1, max_states)
    except _TooManyStates:
        log.info(
            "plan_optimal: more than %d states, counting bytes in 1/%d of the budget", max_states, resolution
        )
        mask = _knapsack(profile, memory_budget, max(1, math.ceil(memory_budget / resolution)), None)
    if mask is None:  # rounding ate the slack: every block checkpointed fits (checked above)
        return profile.plan([True] * len(profile), "optimal")
    plan = profile.plan([bool(mask >> i & 1) for i in range(len(profile))], "optimal")
    assert plan.peak_bytes <= memory_budget, (plan, memory_budget)
    return plan


def plan_greedy(profile: ActivationCheckpointProfile, memory_budget: int) -> ActivationCheckpointPlan:
    """Cost-benefit heuristic: checkpoint the block that lowers the peak most per second, until it fits.

    The per-layer "cost-benefit ratio" a learned policy would be fed; shown to compare with the DP.
    """
    _check_budget(profile, memory_budget)
    flags = [False] * len(profile)
    while profile.peak_bytes(flags) > memory_budget:
        now, best, best_ratio = profile.peak_bytes(flags), None, -1.0
        for i in (i for i, c in enumerate(flags) if not c):
            gain = now - profile.peak_bytes(flags[:i] + [True] + flags[i + 1 :])
            ratio = gain / max(profile.blocks[i].seconds, 1e-9)
            if gain > 0 and ratio > best_ratio:
                best, best_ratio = i, ratio
        if best is None:  # no single block lowers the peak: take the cheapest, the DP has no such gap
            best = min((i for i, c in enumerate(flags) if not c), key=lambda i: profile.blocks[i].seconds)
        flags[best] = True
    return profile.plan(flags, "greedy")
