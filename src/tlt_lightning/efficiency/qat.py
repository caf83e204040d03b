"""INT4 quantization-aware training through torchao, to train jointly with distillation.

``prepare_qat`` swaps the chosen ``nn.Linear`` modules for torchao's ``FakeQuantizedLinear``
(same parameters: an optimizer built before or after keeps working); the forward pass then rounds
the weights to the INT4 grid (symmetric, per group of ``group_size`` input features) with a
straight-through gradient, so training sees the deployment error. Train the student under it
against a higher-precision teacher (:func:`~tlt_lightning.efficiency.distill.distill_step`), then
``convert_qat`` swaps back and quantizes for real (torchao tensor subclasses holding INT4 values).
``quantize_ptq`` is the post-training baseline: the same quantization with no training under it.

Weights: ``IntxWeightOnlyConfig(torch.int4, PerGroup(group_size))`` (``activations="none"``) or
``Int8DynamicActivationIntxWeightConfig`` (``"int8"``: int8 dynamic per-token activations too);
both run on CPU and exist in torchao 0.15 and newer. ``Int4WeightOnlyConfig`` needs CUDA packing
and ``Int8DynamicActivationInt4WeightConfig`` is gone in 0.18, so neither is used. The converted
weights are stored unpacked (one INT4 value per int8): this measures accuracy, not size or speed.

torchao is optional: ``pip install 'torchao==0.15.0'`` (the version torchtune 0.6.1 needs).

Example:
    >>> config = Int4QATConfig(group_size=32)
    >>> student = prepare_qat(student, config)  # doctest: +SKIP
    >>> # train: distill_step(student, teacher, distill, batch).total.backward()
    >>> student = convert_qat(student, config)  # doctest: +SKIP
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from tlt_lightning.validation import MissingExtraError, check, is_int

__all__ = [
    "Int4QATConfig",
    "convert_qat",
    "fake_quantized_modules",
    "prepare_qat",
    "quantize_ptq",
    "quantized_modules",
]


def _torchao() -> Any:
    try:
        from torchao import quantization
    except ImportError as err:  # optional: say how to get it
        raise MissingExtraError(
            "INT4 QAT needs torchao: pip install 'torchao==0.15.0' (torchtune 0.6.1's pin)"
        ) from err
    return quantization


@dataclass(frozen=True)
class Int4QATConfig:
    """Which linear modules get INT4 weights, and how.

    Args:
        group_size: input features sharing one scale (>= 1; must divide every quantized module's
            ``in_features``); ``None``: one scale per output channel (a whole weight row). Smaller
            groups: less error, more scales.
        activations: ``"none"`` (INT4 weight-only) or ``"int8"`` (int8 dynamic per-token
            activations as well).
        skip: ``fnmatch`` patterns of module names left in full precision (default: the LM head,
            which tied models share with the embedding).

    Example:
        >>> type(Int4QATConfig(group_size=64).base_config()).__name__
        'IntxWeightOnlyConfig'
    """

    group_size: int | None = 32
    activations: Literal["none", "int8"] = "none"
    skip: tuple[str, ...] = ("*lm_head",)

    def __post_init__(self) -> None:
        g = self.group_size
        check(
            g is None or (is_int(g) and g >= 1), "group_size", g, "an int >= 1 or None (per output channel)"
        )
        check(self.activations in ("none", "int8"), "activations", self.activations, "'none' or 'int8'")
        skip = (self.skip,) if isinstance(self.skip, str) else tuple(self.skip)
        if not all(isinstance(p, str) and p for p in skip):
            raise ValueError(f"skip must be non-empty module-name patterns, got {skip!r}")
        object.__setattr__(self, "skip", skip)

    def base_config(self) -> Any:
        """The torchao post-training config this QAT targets (a fresh object each call)."""
        q = _torchao()
        from torchao.quantization.granularity import PerAxis, PerGroup

        granularity = PerAxis(0) if self.group_size is None else PerGroup(self.group_size)
        if self.activations == "int8":
            return q.Int8DynamicActivationIntxWeightConfig(
                weight_dtype=torch.int4, weight_granularity=granularity
            )
        return q.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=granularity)

    def selects(self, name: str) -> bool:
        """Whether the module named ``name`` is quantized (not matched by ``skip``)."""
        return not any(fnmatch.fnmatchcase(name, p) for p in self.skip)


def _check_config(config: Int4QATConfig | None) -> Int4QATConfig:
    config = config or Int4QATConfig()
    if not isinstance(config, Int4QATConfig):
        raise TypeError(f"config must be an Int4QATConfig, got {type(config).__name__}")
    return config


def _targets(model: nn.Module, config: Int4QATConfig, kind: type[nn.Module]) -> list[str]:
    return [n for n, m in model.named_modules() if n and type(m) is kind and config.selects(n)]


def _filter(names: list[str]) -> Callable[[nn.Module, str], bool]:
    chosen = set(names)
    return lambda module, fqn: fqn in chosen


def fake_quantized_modules(model: nn.Module) -> list[str]:
    """Names of the modules ``prepare_qat`` swapped in (torchao ``FakeQuantizedLinear``)."""
    from torchao.quantization.qat import FakeQuantizedLinear

    return [n for n, m in model.named_modules() if isinstance(m, FakeQuantizedLinear)]


def quantized_modules(model: nn.Module) -> list[str]:
    """Names of the linear modules whose weight is a torchao quantized tensor (after convert or PTQ)."""
    from torchao.utils import TorchAOBaseTensor

    out = []
    for n, m in model.named_modules():
        weight = getattr(m, "weight", None)
        if isinstance(m, nn.Linear) and isinstance(weight, TorchAOBaseTensor):
            out.append(n)
        elif isinstance(m, nn.Linear) and weight is not None and hasattr(weight, "original_weight_tensor"):
            out.append(n)  # activation-quantized wrapper around a quantized weight
    return out


def _check_groups(model: nn.Module, names: list[str], config: Int4QATConfig) -> None:
    if not names:
        raise ValueError(
            f"no nn.Linear of {type(model).__name__} is left to quantize after skip={list(config.skip)}"
        )
    if config.group_size is None:
        return
    bad = [n for n in names if model.get_submodule(n).in_features % config.group_size]
    if bad:
        widths = sorted({model.get_submodule(n).in_features for n in bad})
        raise ValueError(
            f"group_size={config.group_size} does not divide in_features {widths} of {bad[:3]}"
            f"{' ...' if len(bad) > 3 else ''}: pick a divisor or add them to skip"
        )


def prepare_qat(model: nn.Module, config: Int4QATConfig | None = None) -> nn.Module:
    """Insert INT4 fake quantization into ``model`` in place (torchao ``QATConfig(step="prepare")``).

    Args:
        model: any module; every ``nn.Linear`` not matched by ``config.skip`` is prepared.
        config: group size, activations, skip patterns.

    Returns:
        ``model`` (changed in place; its parameters are the same objects as before).

    Raises:
        ValueError: nothing to quantize, ``group_size`` does not divide a module's width, or the
            model is already prepared.
    """
    config = _check_config(config)
    q = _torchao()
    from torchao.quantization.qat import QATConfig

    if fake_quantized_modules(model):
        raise ValueError(f"{type(model).__name__} is already prepared for QAT (convert it first)")
    names = _targets(model, config, nn.Linear)
    _check_groups(model, names, config)
    q.quantize_(model, QATConfig(config.base_config(), step="prepare"), filter_fn=_filter(names))
    return model


def convert_qat(model: nn.Module, config: Int4QATConfig | None = None) -> nn.Module:
    """Replace the fake-quantized modules by really quantized ones (``QATConfig(step="convert")``).

    Use the config given to :func:`prepare_qat`. Returns ``model`` (changed in place).

    Raises:
        ValueError: ``model`` has no fake-quantized module (not prepared).
    """
    config = _check_config(config)
    q = _torchao()
    from torchao.quantization.qat import QATConfig

    names = fake_quantized_modules(model)
    if not names:
        raise ValueError(f"{type(model).__name__} has no fake-quantized module: call prepare_qat first")
    q.quantize_(model, QATConfig(config.base_config(), step="convert"), filter_fn=_filter(names))
    return model


def quantize_ptq(model: nn.Module, config: Int4QATConfig | None = None) -> nn.Module:
    """Post-training INT4 quantization in place, the same scheme as :func:`convert_qat` (the baseline).

    Raises:
        ValueError: nothing to quantize, or ``group_size`` does not divide a module's width.
    """
    config = _check_config(config)
    q = _torchao()
    names = _targets(model, config, nn.Linear)
    _check_groups(model, names, config)
    q.quantize_(model, config.base_config(), filter_fn=_filter(names))
    return model
