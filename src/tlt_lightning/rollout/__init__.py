"""Rollout generation: the batched engine, its results, and speculative decoding on top of it.

A drafter plugs into speculative decoding through the :class:`DraftModel` protocol.

vLLM as a rollout backend with the same ``generate`` is :mod:`tlt_lightning.vllm`.
"""

from tlt_lightning.rollout.drafting import DraftModel
from tlt_lightning.rollout.engine import RolloutBackend, RolloutEngine
from tlt_lightning.rollout.io import load_rollouts, save_rollouts
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.rollout.speculative_step import SpeculativeStep
from tlt_lightning.rollout.types import Rollout, RolloutConfig, RolloutResult, RolloutStats

__all__ = [
    "DraftModel",
    "Rollout",
    "RolloutBackend",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutResult",
    "RolloutStats",
    "SpeculativeRolloutLoop",
    "SpeculativeStep",
    "load_rollouts",
    "save_rollouts",
]
