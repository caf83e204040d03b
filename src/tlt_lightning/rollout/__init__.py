"""Rollout generation: the batched engine, its results, and speculative decoding on top of it."""

from tlt_lightning.rollout.engine import ActiveBatch, DecodeStep, Emission, PlainStep, RolloutBackend, RolloutEngine
from tlt_lightning.rollout.types import Rollout, RolloutConfig, RolloutResult, RolloutStats

__all__ = [
    "ActiveBatch",
    "DecodeStep",
    "Emission",
    "PlainStep",
    "Rollout",
    "RolloutBackend",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutResult",
    "RolloutStats",
]
