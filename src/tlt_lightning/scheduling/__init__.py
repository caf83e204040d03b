"""Choosing the speculative-decoding strategy per step: BEG-MAB bandit, baselines, a simulator."""

from tlt_lightning.scheduling.bandit import (
    DEFAULT_BUCKET_THRESHOLDS,
    Arm,
    BEGMABStrategy,
    BucketedChooser,
    Decision,
    arm_key,
    default_arms,
)
from tlt_lightning.scheduling.baselines import FixedStrategy, UCBStrategy
from tlt_lightning.scheduling.simulate import SimulatedSDEnvironment, run_bandit_benchmark

__all__ = [
    "DEFAULT_BUCKET_THRESHOLDS",
    "Arm",
    "BEGMABStrategy",
    "BucketedChooser",
    "Decision",
    "FixedStrategy",
    "SimulatedSDEnvironment",
    "UCBStrategy",
    "arm_key",
    "default_arms",
    "run_bandit_benchmark",
]
