"""Choosing the speculative-decoding strategy per step (BEG-MAB bandit, baselines, a simulator) and
coordinating spot drafter training on idle rollout workers."""

from tlt_lightning.scheduling.bandit import BEGMABStrategy
from tlt_lightning.scheduling.baselines import FixedStrategy, UCBStrategy
from tlt_lightning.scheduling.bucketed import BucketedStrategy
from tlt_lightning.scheduling.coordinator import (
    CoordinatorConfig,
    Segment,
    WorkerCoordinator,
    WorkerState,
    idle_fraction_recovered,
    plot_timeline,
)
from tlt_lightning.scheduling.simulate import SimulatedSDEnvironment
from tlt_lightning.scheduling.step_cost import StepCostModel

__all__ = [
    "BEGMABStrategy",
    "BucketedStrategy",
    "CoordinatorConfig",
    "FixedStrategy",
    "Segment",
    "SimulatedSDEnvironment",
    "StepCostModel",
    "UCBStrategy",
    "WorkerCoordinator",
    "WorkerState",
    "idle_fraction_recovered",
    "plot_timeline",
]
