"""GRPOModule's grouped settings: optimisation (:class:`OptimConfig`) and speculative rollouts
(:class:`SpeculativeConfig`). Sampling is a :class:`~tlt_lightning.rollout.RolloutConfig`, the task a
:class:`~tlt_lightning.rl.TaskConfig`.

LightningCLI fills each group from its own YAML section::

    model:
      rollout: {max_new_tokens: 256, temperature: 1.0}
      optim: {lr: 1.0e-6, group_size: 8}
      speculative: {drafter_kind: eagle1, threshold: 32}
      task: {name: countdown}

Example:
    >>> OptimConfig(lr=1e-5, group_size=8).group_size
    8
    >>> OptimConfig(group_size=1)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: optim.group_size must be an int >= 2 (GRPO's advantage is a reward minus its group's mean:
    a group of 1 has advantage 0 everywhere and trains nothing; use 4-16), got 1
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from tlt_lightning.drafter.config import DRAFTER_KINDS
from tlt_lightning.drafter.location import DrafterLocation, drafter_location
from tlt_lightning.rl.grpo import AGGREGATIONS
from tlt_lightning.validation import check, is_int

__all__ = ["CROSSOVER_MODES", "OPTIMIZERS", "OptimConfig", "SpeculativeConfig", "as_config"]

CROSSOVER_MODES = ("auto", "measure", "off")
"""What :attr:`SpeculativeConfig.crossover` accepts."""

OPTIMIZERS = ("adamw", "adamw8bit")
"""What :attr:`OptimConfig.optimizer` accepts."""

C = TypeVar("C")


def as_config(value: C | Mapping[str, Any] | None, cls: type[C], name: str) -> C:
    """``value`` as a ``cls``: itself, ``cls(**value)`` for a mapping of its fields, ``cls()`` for ``None``.

    Raises:
        TypeError: ``value`` is something else; the message names the argument.
    """
    if value is None:
        return cls()
    if isinstance(value, Mapping):
        return cls(**value)
    if not isinstance(value, cls):
        raise TypeError(
            f"{name} must be a {cls.__name__}, a dict of its fields or None, got {type(value).__name__}"
        )
    return value


@dataclass(frozen=True)
class OptimConfig:
    """How GRPOModule turns a step's rollouts into one optimizer step (``model.optim`` in a config).

    Args:
        group_size: ``G``, rollouts per prompt.
        prompts_per_step: ``P``, prompts per optimizer step *per rank*.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        clip_eps: lower clip range of the importance ratio.
        clip_eps_high: upper clip range (DAPO clip-higher); default ``clip_eps``.
        kl_coef: weight of the k3 KL to a frozen copy of the initial policy; ``0`` loads no copy.
        scale_advantages: divide advantages by the group std (``False``: Dr. GRPO).
        aggregation: ``"token"`` (DAPO) or ``"sequence"`` loss aggregation.
        micro_batch_size: sequences per forward/backward (gradient accumulation inside the
            optimizer step); ``None``: all at once. The forward holds every layer's activations
            and ``[N, vocab]`` logits of its ``N`` completion tokens (SmolLM2: 49k vocabulary).
        micro_batch_tokens: at most this many padded tokens (rows x longest) per forward/backward:
            the step's sequences longest first, packed to the budget (a longer one alone), so one
            forward's activations are bounded whatever the lengths and little of it is padding
            (:func:`~tlt_lightning.rl.batch.micro_batches`); ``None``: by ``micro_batch_size`` only.
        sequence_multiple: each forward's sequences padded to a multiple of this many tokens (1: to
            their longest). oneDNN builds and caches a kernel for every matrix shape it meets; on a CPU
            with a bf16 policy, fewer distinct shapes mean fewer builds and a bounded cache.
        max_grad_norm: gradient clipping norm; ``None``: no clipping.
        gradient_checkpointing: recompute activations in backward (less memory, ~30% slower).
        optimizer: ``"adamw"`` (PyTorch's, fused on CPU and CUDA; fp32 moments, 8 bytes per parameter)
            or ``"adamw8bit"`` (torchao's ``AdamW8bit``, the ``efficiency`` extra: moments in 8 bits
            with a scale per 256 values, ~2 bytes per parameter: SmolLM2-135M's 1.03 GB -> ~0.27 GB;
            its step compiles with Inductor on first use and is slower than fused AdamW on a CPU:
            docs/efficiency.md). A bfloat16 policy (``model.dtype``) is updated with stochastic rounding
            by :class:`~tlt_lightning.rl.optimizers.AdamWBF16` or ``AdamW8bit``.
    """

    group_size: int = 4
    prompts_per_step: int = 4
    lr: float = 1e-6
    weight_decay: float = 0.0
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    scale_advantages: bool = True
    aggregation: str = "token"
    micro_batch_size: int | None = 8
    micro_batch_tokens: int | None = None
    sequence_multiple: int = 1
    max_grad_norm: float | None = 1.0
    gradient_checkpointing: bool = False
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        check(
            is_int(self.group_size) and self.group_size >= 2,
            "optim.group_size",
            self.group_size,
            "an int >= 2 (GRPO's advantage is a reward minus its group's mean: a group of 1 has "
            "advantage 0 everywhere and trains nothing; use 4-16)",
        )
        check(
            is_int(self.prompts_per_step) and self.prompts_per_step >= 1,
            "optim.prompts_per_step",
            self.prompts_per_step,
            "an int >= 1",
        )
        check(
            self.micro_batch_size is None or (is_int(self.micro_batch_size) and self.micro_batch_size >= 1),
            "optim.micro_batch_size",
            self.micro_batch_size,
            "an int >= 1 or None",
        )
        check(
            self.micro_batch_tokens is None
            or (is_int(self.micro_batch_tokens) and self.micro_batch_tokens >= 1),
            "optim.micro_batch_tokens",
            self.micro_batch_tokens,
            "an int >= 1 (padded tokens per forward, e.g. 2048) or None",
        )
        check(
            is_int(self.sequence_multiple) and self.sequence_multiple >= 1,
            "optim.sequence_multiple",
            self.sequence_multiple,
            "an int >= 1 (e.g. 32; 1: no padding)",
        )
        check(0 < self.lr < math.inf, "optim.lr", self.lr, "finite and > 0")
        check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, ">= 0")
        check(self.clip_eps >= 0, "optim.clip_eps", self.clip_eps, ">= 0")
        check(
            self.clip_eps_high is None or self.clip_eps_high >= 0,
            "optim.clip_eps_high",
            self.clip_eps_high,
            ">= 0 or None",
        )
        check(self.kl_coef >= 0, "optim.kl_coef", self.kl_coef, ">= 0")
        check(
            self.aggregation in AGGREGATIONS, "optim.aggregation", self.aggregation, f"one of {AGGREGATIONS}"
        )
        check(self.optimizer in OPTIMIZERS, "optim.optimizer", self.optimizer, f"one of {OPTIMIZERS}")
        check(
            self.max_grad_norm is None or self.max_grad_norm > 0,
            "optim.max_grad_norm",
            self.max_grad_norm,
            "> 0 or None",
        )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative rollouts of GRPOModule (``model.speculative`` in a config).

    Args:
        enabled: use speculative decoding whenever a drafter is attached (``False``: always plain
            decoding, e.g. for a baseline run).
        drafter_kind: ``"eagle1"``/``"eagle3"``: create a fresh drafter of that kind at setup when
            none is attached; ``None``: none (a callback may attach one).
        drafter_path: load the drafter from this :func:`~tlt_lightning.drafter.save_drafter`
            directory instead (e.g. a warmed-up one), or from a ``models:/`` or ``runs:/`` MLflow URI
            of one (:func:`~tlt_lightning.drafter.load_drafter`); relative to the config file that
            names it (:mod:`~tlt_lightning.drafter.location`), kept as a string.
        sd_steps: draft depth of the default strategy (always a chain of this many tokens).
        threshold: speculate only while fewer requests than this are active.
        crossover: where a bandit strategy may speculate below ``threshold``: ``"auto"`` measures the
            machine's step costs (plain and each arm, at the batch sizes below ``threshold``) once per
            machine where rollouts are compiled, and the strategy then tries an arm predicted to lose
            at the batch size at hand only as a rare probe (:mod:`tlt_lightning.rl.crossover`);
            ``"measure"`` does so on any decode path, ``"off"`` never (every arm is tried).
    """

    enabled: bool = True
    drafter_kind: str | None = None
    drafter_path: DrafterLocation | None = None
    sd_steps: int = 4
    threshold: int = 32
    crossover: str = "auto"

    def __post_init__(self) -> None:
        check(
            self.drafter_kind in (None, *DRAFTER_KINDS),
            "speculative.drafter_kind",
            self.drafter_kind,
            "'eagle1', 'eagle3' or None",
        )
        for name in ("sd_steps", "threshold"):
            value = getattr(self, name)
            check(is_int(value) and value >= 1, f"speculative.{name}", value, "an int >= 1")
        check(
            self.crossover in CROSSOVER_MODES, "speculative.crossover", self.crossover, str(CROSSOVER_MODES)
        )
        path = self.drafter_path
        check(
            path is None or isinstance(path, (str, os.PathLike)),
            "speculative.drafter_path",
            path,
            "a directory path, a models:/ or runs:/ URI, or None",
        )
        object.__setattr__(self, "drafter_path", drafter_location(path))  # a string (absolute once resolved)
