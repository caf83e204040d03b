"""GRPO rollouts on vLLM (``GRPOModule(rollout_backend="vllm")``): one engine per fit, refreshed every step.

The engine is built at the first rollout (so a drafter attached by a callback at fit start is
served too), from copies of the policy and drafter in a scratch directory; at the first rollout of
every later optimizer step, :meth:`~tlt_lightning.vllm.VLLMRolloutBackend.refresh_weights` loads
the policy's (and the drafter's) current weights in place, and each result records the weight
version it ran on. vLLM returns no hidden states: when the rollouts must carry drafter features
(a spot-trained drafter), one teacher-forced forward of the rollout target computes them
(:func:`~tlt_lightning.drafter.features.target_features`).

On a CPU vLLM lives in its own environment (``make setup-vllm``), which also holds this package and
the dependencies it can share with vLLM: ``.venv-vllm/bin/tlt-lightning fit ...`` runs there.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tlt_lightning.models.target import TargetModel
from tlt_lightning.rollout.types import RolloutConfig, RolloutResult

__all__ = ["VLLMRollouts", "check_vllm_settings"]

_OWNED = ("model", "drafter")  # written by VLLMRollouts itself


def check_vllm_settings(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate ``GRPOModule(vllm=...)``: :class:`~tlt_lightning.vllm.VLLMBackendConfig` fields but
    ``model`` / ``drafter`` (the module serves its own policy and drafter). No vLLM needed.

    Raises:
        ValueError / TypeError: an unknown or invalid field, naming it.
    """
    from tlt_lightning.vllm.backend import VLLMBackendConfig

    settings = dict(settings or {})
    fields = {f.name for f in dataclasses.fields(VLLMBackendConfig)} - set(_OWNED)
    unknown = sorted(set(settings) - fields)
    if unknown:
        raise ValueError(
            f"vllm: unknown settings {unknown}; allowed: {sorted(fields)} "
            "(model and drafter are the module's)"
        )
    VLLMBackendConfig(model=".", **settings)  # validates each value, naming the field
    return settings


class VLLMRollouts:
    """The vLLM engine of one fit.

    Args:
        settings: :class:`~tlt_lightning.vllm.VLLMBackendConfig` fields (see :func:`check_vllm_settings`).
    """

    def __init__(self, settings: Mapping[str, Any] | None = None) -> None:
        self.settings = check_vllm_settings(settings)
        self.backend: Any | None = None
        self.workdir: Path | None = None
        self.step: int | None = None  # the optimizer step whose weights the engine serves

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        config: RolloutConfig,
        *,
        policy: nn.Module,
        drafter: nn.Module | None,
        target: TargetModel,
        step: int,
        generator: torch.Generator | None = None,
        progress: bool = False,
    ) -> RolloutResult:
        """Rollouts of ``prompts`` on the weights of optimizer step ``step``.

        Args:
            prompts: ``B`` prompts, token ids.
            config: sampling settings; its ``feature_layers`` are computed by a forward of ``target``.
            policy: the transformers model vLLM serves (saved once, then refreshed in place).
            drafter: the drafter to serve (``None``: plain decoding); fixed at the first call.
            target: the adapter of ``policy`` (drafter features).
            step: the optimizer step; a new one refreshes the engine's weights first.
            generator: seeds the requests where the device allows it (see the backend).
            progress: vLLM's progress bar.
        """
        from tlt_lightning.drafter.features import target_features
        from tlt_lightning.vllm.backend import VLLMRolloutBackend

        served = dataclasses.replace(config, feature_layers=())
        if self.backend is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="tlt-vllm-"))
            self.backend = VLLMRolloutBackend.from_policy(
                policy, self.workdir, drafter=drafter, rollout=served, **self.settings
            )
        elif step != self.step:
            self.backend.refresh_weights(target=policy, drafter=drafter if self.backend.speculative else None)
        self.step = step
        self.backend.config = served
        result = self.backend.generate(prompts, generator=generator, progress=progress)
        if config.feature_layers:
            rollouts = target_features(target, result.rollouts, tuple(config.feature_layers))
            result = RolloutResult(rollouts, result.stats)
        return result

    def close(self) -> None:
        """Shut the engine down and remove its scratch copies."""
        self.backend = None  # vLLM shuts its engine processes down when the LLM is collected
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        self.step = None
