"""Choosing the speculative-decoding strategy per step (BEG-MAB bandit, baselines, a simulator)."""

from tlt_lightning.scheduling.bandit import BEGMABStrategy
from tlt_lightning.scheduling.baselines import FixedStrategy, UCBStrategy
from tlt_lightning.scheduling.bucketed import BucketedStrategy
from tlt_lightning.scheduling.crossover import StepCosts
from tlt_lightning.scheduling.simulate import SimulatedSDEnvironment
from tlt_lightning.scheduling.step_cost import StepCostModel

__all__ = [
    "BEGMABStrategy",
    "BucketedStrategy",
    "FixedStrategy",
    "SimulatedSDEnvironment",
    "StepCosts",
    "StepCostModel",
    "UCBStrategy",
]
