"""Choosing the speculative-decoding strategy per step (BEG-MAB bandit, baselines, a simulator) and
coordinating spot drafter training on idle rollout workers."""

from tlt_lightning.scheduling.bandit import (
    DEFAULT_BUCKET_THRESHOLDS,
    BEGMABStrategy,
    BucketedStrategy,
    Decision,
    StepCostModel,
    default_arms,
)
from tlt_lightning.scheduling.baselines import FixedStrategy, UCBStrategy
from tlt_lightning.scheduling.coordinator import (
    CoordinatorConfig,
    Segment,
    TrainWindow,
    WorkerCoordinator,
    WorkerState,
    idle_fraction_recovered,
    plot_timeline,
)
from tlt_lightning.scheduling.simulate import SimulatedSDEnvironment, run_bandit_benchmark

__all__ = [
    "DEFAULT_BUCKET_THRESHOLDS",
    "BEGMABStrategy",
    "BucketedStrategy",
    "CoordinatorConfig",
    "Decision",
    "FixedStrategy",
    "Segment",
    "SimulatedSDEnvironment",
    "StepCostModel",
    "TrainWindow",
    "UCBStrategy",
    "WorkerCoordinator",
    "WorkerState",
    "default_arms",
    "idle_fraction_recovered",
    "plot_timeline",
    "run_bandit_benchmark",
]
