"""StepCostModel: a modelled cost of one decode step, for reproducible strategies.

The bandit's reward divides by the step's *wall time*, so two runs with the same seed on the same
machine choose differently (timing noise moves the medians), and different arms consume the sampling
generator differently: the rollouts, and then the training, diverge. With a ``cost_model`` a strategy
ignores the measured time and divides by the modelled cost of the step instead; its decisions are then
a function of the seed, the step counts and the accepted tokens alone, so a run is bit-identical to its
repetition and to its resumption.
"""

from __future__ import annotations

import dataclasses
import math

from tlt_lightning.speculative import Arm

__all__ = ["StepCostModel", "step_seconds"]


def step_seconds(
    base_time: float, token_time: float, draft_time: float, draft_token_time: float, batch_size: int, arm: Arm
) -> float:
    """The cost formula of :class:`StepCostModel` (and of the simulator): one target forward over the
    batch's verified tokens plus ``arm.num_steps`` drafter forwards; ``arm`` ``None`` is plain decoding."""
    verified = 0 if arm is None else arm.num_draft_tokens
    target = base_time + token_time * batch_size * (1 + verified)
    if arm is None:
        return target
    return target + arm.num_steps * (draft_time + draft_token_time * batch_size * arm.topk)


@dataclasses.dataclass(frozen=True)
class StepCostModel:
    """A modelled cost of one decode step, in seconds: what a reproducible strategy divides by.

    ``base_time + token_time * batch_size * (1 + verified)`` for the target's forward (``verified``:
    the arm's drafted tokens, 0 with SD off), plus ``num_steps * (draft_time + draft_token_time *
    batch_size * topk)`` for the drafter's passes. The defaults are the simulator's
    (:class:`~tlt_lightning.scheduling.SimulatedSDEnvironment`): a memory-bound step whose cost grows
    slowly with the tokens it verifies, so deep drafts pay at small batch and lose at large batch.
    Only the ratios between arms matter to the bandit; fit them to a machine with
    ``python -m benchmarks strategies`` (a checkout) when the default ranking is wrong for it.

    Args:
        base_time: fixed cost of a target forward (``> 0``).
        token_time: cost per token the target processes (``>= 0``).
        draft_time: fixed cost of one drafter forward (``>= 0``).
        draft_token_time: cost per token and branch of a drafter forward (``>= 0``).

    Example:
        >>> from tlt_lightning.speculative import DraftSpec
        >>> model = StepCostModel()
        >>> round(model.step_time(1, None), 4), round(model.step_time(1, DraftSpec(4)), 4)
        (0.0415, 0.0717)
    """

    base_time: float = 0.04
    token_time: float = 0.0015
    draft_time: float = 0.006
    draft_token_time: float = 0.00005

    def __post_init__(self) -> None:
        for name in ("base_time", "token_time", "draft_time", "draft_token_time"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(
                    f"StepCostModel.{name} must be a finite number >= 0 (seconds), got {value!r}"
                )
        if self.base_time <= 0:
            raise ValueError(
                "StepCostModel.base_time must be > 0 (a step that costs nothing has no reward), "
                f"got {self.base_time!r}"
            )

    def step_time(self, batch_size: int, arm: Arm) -> float:
        """The modelled seconds of one step of ``batch_size`` requests with ``arm``."""
        return step_seconds(
            self.base_time, self.token_time, self.draft_time, self.draft_token_time, batch_size, arm
        )
