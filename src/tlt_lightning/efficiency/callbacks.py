"""Lightning glue for the efficiency transforms: thin hooks over :mod:`.checkpoint`, :mod:`.precision` and
:mod:`.host_memory`.

Both work on any LightningModule; ``blocks`` / ``module`` name the part to transform (an attribute
path such as ``"policy"`` or module-name patterns), so the same callback serves the policy, the
drafter or a plain model. Both transform at ``on_fit_start`` or later, so modules built in
``configure_model`` (the :class:`~tlt_lightning.rl.GRPOModule` policy) are there. A module without
a ``forward`` of its own (GRPO, whose step generates before it trains) gives
:class:`ActivationCheckpointingCallback` a profiling forward: see :mod:`~tlt_lightning.efficiency.grpo`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from tlt_lightning.efficiency import host_memory
from tlt_lightning.efficiency.activation_checkpointing import (
    ActivationCheckpointHandle,
    ActivationCheckpointPlan,
    DynamicActivationCheckpointing,
    apply_activation_checkpointing,
    find_blocks,
    profile_blocks,
)
from tlt_lightning.efficiency.precision import LayerwisePrecision, PrecisionConfig, PrecisionHandle
from tlt_lightning.validation import check_resumed_settings

__all__ = ["ActivationCheckpointingCallback", "HostMemoryCallback", "LayerwisePrecisionCallback"]


def _training_step_loss(pl_module: L.LightningModule, batch: Any, batch_idx: int) -> torch.Tensor:
    out = pl_module.training_step(batch, batch_idx)
    return out["loss"] if isinstance(out, dict) else out


def _training_batch(pl_module: L.LightningModule, batch: Any) -> Any:
    return batch


def _submodule(pl_module: nn.Module, path: str | None, field: str) -> nn.Module:
    if path is None:
        return pl_module
    try:
        return pl_module.get_submodule(path)
    except AttributeError as err:
        raise ValueError(f"{field}={path!r} is not a submodule of {type(pl_module).__name__}: {err}") from err


class ActivationCheckpointingCallback(L.Callback):
    """Profile the blocks on the first training batch, plan under the budget, checkpoint, undo at the end.

    At the first ``on_train_batch_start`` the callback builds the profiling batch
    ``data = profile_batch_fn(pl_module, batch)`` once, outside the measurement, then runs
    ``forward_fn(pl_module, data)`` ``repeats + 1`` times (forward only, no optimizer step) to
    profile the blocks, plans with
    :class:`~tlt_lightning.efficiency.activation_checkpointing.DynamicActivationCheckpointing` and
    checkpoints the chosen blocks for the rest of the fit (removed at ``teardown``). Logs
    ``checkpoint/blocks``, ``checkpoint/predicted_peak_mib`` and ``checkpoint/budget_mib``. The plan is
    saved with Lightning checkpoints and reused on resume without profiling again. Models must be
    called with ``use_cache=False`` in training (a KV cache would be written again by the
    recomputation).

    Args:
        memory_budget: peak activation bytes (see :mod:`~tlt_lightning.efficiency.memory`), or ``None``
            with ``budget_fraction``.
        budget_fraction: the budget as a fraction in (0, 1] of the peak without checkpointing.
        blocks: module-name patterns of the candidate blocks (see
            :func:`~tlt_lightning.efficiency.activation_checkpointing.find_blocks`), relative to the
            LightningModule; ``None``: the children of its longest ``nn.ModuleList``.
        forward_fn: ``(pl_module, data) -> scalar loss``, one training forward on the profiling
            batch, calling each block exactly once; default: the module's ``training_step``, which
            must then only compute the loss (automatic optimization). A module with manual
            optimization (its step runs the optimizer; a GRPO step also generates rollouts first)
            must give one, e.g. :func:`~tlt_lightning.efficiency.grpo.grpo_policy_loss`.
        profile_batch_fn: ``(pl_module, batch) -> data``, run once before profiling, outside the
            measurement: what ``forward_fn`` profiles on; default: the first training batch itself.
            E.g. :func:`~tlt_lightning.efficiency.grpo.grpo_profile_batch` turns a GRPO batch of
            prompt indices into the largest micro-batch of sequences the step can train on.
        repeats: timed profiling runs.

    Example:
        >>> # L.Trainer(callbacks=[
        >>> #     ActivationCheckpointingCallback(budget_fraction=0.6, blocks="model.model.layers.*")
        >>> # ])
        >>> # on a GRPOModule (no forward): profile its policy's training forward on the worst-case
        >>> # micro-batch
        >>> # ActivationCheckpointingCallback(budget_fraction=0.6, blocks="policy.model.layers.*",
        >>> #                              forward_fn=grpo_policy_loss, profile_batch_fn=grpo_profile_batch)
    """

    def __init__(
        self,
        memory_budget: int | None = None,
        budget_fraction: float | None = None,
        blocks: str | Sequence[str] | None = None,
        forward_fn: Callable[[L.LightningModule, Any], torch.Tensor] | None = None,
        repeats: int = 2,
        profile_batch_fn: Callable[[L.LightningModule, Any], Any] | None = None,
    ) -> None:
        super().__init__()
        self.policy = DynamicActivationCheckpointing(memory_budget, budget_fraction, repeats=repeats)
        for name, fn in (("forward_fn", forward_fn), ("profile_batch_fn", profile_batch_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable (pl_module, batch) -> ..., got {type(fn).__name__}")
        self.blocks = blocks
        self.forward_fn = forward_fn
        self.profile_batch_fn = profile_batch_fn or _training_batch
        self.plan: ActivationCheckpointPlan | None = None
        self._loaded: tuple[bool, ...] | None = None
        self._handle: ActivationCheckpointHandle | None = None
        self.resume_overrides = "refuse"  # resumed with another budget: refused, or "apply" it (plan again)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._handle is not None:
            return
        blocks = find_blocks(pl_module, self.blocks)
        if self._loaded is not None and len(self._loaded) == len(blocks):
            self._handle = apply_activation_checkpointing(blocks, self._loaded)
            return
        if self.forward_fn is None and not pl_module.automatic_optimization:
            raise ValueError(
                f"forward_fn=None profiles training_step, but {type(pl_module).__name__} uses manual "
                "optimization (its training_step would step the optimizer while profiling): pass forward_fn "
                "(and profile_batch_fn), e.g. forward_fn=grpo_policy_loss, "
                "profile_batch_fn=grpo_profile_batch from tlt_lightning.efficiency for a GRPOModule"
            )
        data = self.profile_batch_fn(pl_module, batch)
        if self.forward_fn is None:
            forward = functools.partial(_training_step_loss, pl_module, data, batch_idx)
        else:
            forward = functools.partial(self.forward_fn, pl_module, data)
        profile = profile_blocks(blocks, forward, self.policy.repeats)
        self.plan = self.policy.plan(profile)
        self._handle = apply_activation_checkpointing(blocks, self.plan)
        pl_module.log_dict(
            {
                "checkpoint/blocks": float(len(self.plan.indices)),
                "checkpoint/predicted_peak_mib": self.plan.peak_bytes / 2**20,
                "checkpoint/budget_mib": self.policy.budget_bytes(profile) / 2**20,
            },
            on_step=True,
            on_epoch=False,
        )

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def settings(self) -> dict[str, Any]:
        """The budget and the candidate blocks, saved with the plan and compared on resume."""
        blocks = self.blocks if self.blocks is None or isinstance(self.blocks, str) else list(self.blocks)
        budget = self.policy
        return {
            "memory_budget": budget.memory_budget,
            "budget_fraction": budget.budget_fraction,
            "blocks": blocks,
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        flags = self.plan.checkpointed if self.plan is not None else self._loaded
        return {"checkpointed": list(flags), "settings": self.settings()} if flags is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Reuse the saved plan; with other settings applied (``resume_overrides="apply"``) plan again.

        Raises:
            ValueError: the saved :meth:`settings` differ and ``resume_overrides`` is not ``"apply"``.
        """
        saved = state_dict.get("settings")
        changed = check_resumed_settings(type(self).__name__, saved, self.settings(), self.resume_overrides)
        if "checkpointed" in state_dict and not changed:
            self._loaded = tuple(bool(c) for c in state_dict["checkpointed"])


class LayerwisePrecisionCallback(L.Callback):
    """Apply :class:`~tlt_lightning.efficiency.precision.LayerwisePrecision` for the fit; fp16: per-group
    scalers.

    Use with the Trainer's default ``precision="32-true"``: this callback does the autocast per
    group. It transforms at ``on_fit_start``: after ``configure_model`` (a GRPO policy exists by
    then) and after the strategy moved the model, so the fp16 scalers live where the gradients do.
    With fp16 it unscales each group's gradients in ``on_before_optimizer_step``, before they are
    clipped: Lightning clips after that hook in automatic optimization, and
    :class:`~tlt_lightning.rl.GRPOModule` (manual optimization) clips in its own
    ``on_before_optimizer_step``, which Lightning calls after the callbacks'. On an overflow it
    drops every gradient (the optimizer step then changes nothing) and lowers only the
    overflowing groups' scales. Logs ``precision/scale/{group}`` and ``precision/skipped_steps``.
    Scales are saved with Lightning checkpoints.

    Args:
        config: the groups and dtype (default: attention and MLP in bf16).
        module: attribute path of the part to transform (e.g. ``"policy"``); ``None``: the whole
            LightningModule.

    Example:
        >>> # L.Trainer(callbacks=[LayerwisePrecisionCallback(PrecisionConfig(compute_dtype="float16"))])
        >>> # L.Trainer(callbacks=[LayerwisePrecisionCallback(module="policy")]).fit(grpo_module)
    """

    def __init__(self, config: PrecisionConfig | None = None, module: str | None = None) -> None:
        super().__init__()
        self.transform = LayerwisePrecision(config)
        self.module = module
        self.handle: PrecisionHandle | None = None
        self.skipped_steps = 0
        self._pending: dict[str, Any] = {}
        self.resume_overrides = "refuse"  # resumed with other groups or dtype: refused, or "apply" them

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.handle is None:
            self.handle = self.transform.apply(_submodule(pl_module, self.module, "module"))
            for name, state in self._pending.get("scalers", {}).items():
                if name in self.handle.scalers:
                    self.handle.scalers[name].load_state_dict(state)

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.handle is None or not self.handle.scalers:
            return
        if not self.handle.unscale_():
            self.skipped_steps += 1
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None  # optimizers skip parameters without a gradient
        self.handle.update()
        logs = {f"precision/scale/{k}": v for k, v in self.handle.scales().items()}
        logs["precision/skipped_steps"] = float(self.skipped_steps)
        pl_module.log_dict(logs, on_step=True, on_epoch=False)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.handle is not None:
            self._pending = self.state_dict()
            self.handle.remove()
            self.handle = None

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.handle is None:
            return dict(self._pending)
        return {
            "scalers": {k: s.state_dict() for k, s in self.handle.scalers.items()},
            "skipped_steps": self.skipped_steps,
            "settings": self.settings(),
        }

    def settings(self) -> dict[str, Any]:
        """The precision config and the transformed part, saved with the scales and compared on resume."""
        return {"config": asdict(self.transform.config), "module": self.module}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scales (of the groups that still exist when other settings are applied).

        Raises:
            ValueError: the saved :meth:`settings` differ and ``resume_overrides`` is not ``"apply"``.
        """
        saved = state_dict.get("settings")
        check_resumed_settings(type(self).__name__, saved, self.settings(), self.resume_overrides)
        self.skipped_steps = int(state_dict.get("skipped_steps", self.skipped_steps))
        self._pending = dict(state_dict)
        if self.handle is not None:
            for name, state in state_dict.get("scalers", {}).items():
                if name in self.handle.scalers:
                    self.handle.scalers[name].load_state_dict(state)


class HostMemoryCallback(L.Callback):
    """Keep a CPU fit's resident memory near what its tensors need (glibc; see :mod:`.host_memory`).

    At setup (in every rank's process) it fixes glibc's mmap threshold, so activations and logits
    larger than ``mmap_threshold`` bytes are mapped on their own and returned when freed; after each
    training step it returns the heaps' free pages (``trim``). Logs ``memory/rss_mb``, the rank's
    resident memory after the step. Where the C library is not glibc it warns once and does nothing.

    Args:
        mmap_threshold: bytes (``<= 32 MiB``); ``None`` leaves glibc's adaptive threshold.
        trim: ``malloc_trim(0)`` after every training step.

    Example:
        >>> # L.Trainer(callbacks=[HostMemoryCallback()])   # or in a fit config's trainer.callbacks
    """

    def __init__(self, mmap_threshold: int | None = 128 * 1024, trim: bool = True) -> None:
        super().__init__()
        if mmap_threshold is not None:
            host_memory.check_mmap_threshold(mmap_threshold)
        self.mmap_threshold, self.trim = mmap_threshold, trim

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if host_memory.glibc() is None:
            rank_zero_warn("HostMemoryCallback does nothing here: the C library is not glibc")
        elif self.mmap_threshold is not None:
            host_memory.set_mmap_threshold(self.mmap_threshold)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.trim:
            host_memory.trim()
        rss = host_memory.rss_mb()
        if rss is not None:
            pl_module.log("memory/rss_mb", rss, on_step=True, on_epoch=False, sync_dist=False)
