"""Lightning glue for :mod:`.sampler`, :mod:`.distill` and :mod:`.qat`: thin hooks over those objects.

* :class:`ImportanceSamplingCallback`: logs what the :class:`~.sampler.ImportanceSampler` chose,
  optionally trains a small proxy on each chosen batch (so its losses follow the learner's), and
  saves the sampler's random state with Lightning checkpoints.
* :class:`DistillationModule`: a LightningModule that trains a student against a frozen teacher
  with :func:`~.distill.distill_step` (the loss needs both models, so it is a module, not a callback).
* :class:`QATCallback`: INT4 fake quantization for the fit (:func:`~.qat.prepare_qat` at setup),
  real quantization at the end (:func:`~.qat.convert_qat`). With :class:`DistillationModule`
  this is QAT jointly with distillation.

Example:
    >>> module = DistillationModule(student, teacher, DistillConfig())  # doctest: +SKIP
    >>> trainer = L.Trainer(callbacks=[QATCallback(Int4QATConfig(), module="student")])  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from torch import nn
from typing_extensions import override

from tlt_lightning.efficiency.distill import DistillConfig, HierarchicalDistillation, distill_step
from tlt_lightning.efficiency.qat import Int4QATConfig, convert_qat, fake_quantized_modules, prepare_qat
from tlt_lightning.efficiency.sampler import ImportanceSampler, per_example_loss

__all__ = ["DistillationModule", "ImportanceSamplingCallback", "QATCallback"]


class ImportanceSamplingCallback(L.Callback):
    """Log the sampler's choices; optionally take a proxy optimizer step on every training batch.

    Args:
        sampler: the ``batch_sampler`` of the training ``DataLoader``.
        proxy: the scorer's small model, trained here on each batch the learner trains on (so the
            proxy's losses track what the learner has learnt); ``None``: the proxy stays fixed
            (e.g. a RHO-LOSS holdout model, or a scorer on the learner itself).
        proxy_optimizer: optimizer over ``proxy``'s parameters (default: AdamW, lr 1e-3).

    Logs ``sampler/candidate_score``, ``sampler/selected_score``, ``sampler/max_probability`` and,
    with a proxy, ``sampler/proxy_loss``. Batches must be dicts with ``input_ids`` and ``labels``
    (and optionally ``attention_mask``) when a proxy is trained.

    Example:
        >>> # L.Trainer(callbacks=[ImportanceSamplingCallback(loader.batch_sampler, proxy=proxy)])
    """

    def __init__(
        self,
        sampler: ImportanceSampler,
        proxy: nn.Module | None = None,
        proxy_optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(sampler, ImportanceSampler):
            raise TypeError(f"sampler must be an ImportanceSampler, got {type(sampler).__name__}")
        if proxy_optimizer is not None and proxy is None:
            raise ValueError("proxy_optimizer was given without a proxy to train")
        self.sampler, self.proxy = sampler, proxy
        if proxy is not None and proxy_optimizer is None:
            proxy_optimizer = torch.optim.AdamW(proxy.parameters(), lr=1e-3)
        self.proxy_optimizer = proxy_optimizer

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        logs = {}
        stats = self.sampler.last_stats
        if stats is not None:
            logs = {f"sampler/{k}": float(v) for k, v in stats._asdict().items()}
        if self.proxy is not None and self.proxy_optimizer is not None:
            logs["sampler/proxy_loss"] = proxy_step(self.proxy, self.proxy_optimizer, batch)
        if logs:
            pl_module.log_dict(logs, on_step=True, on_epoch=False)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state_dict.get("sampler", {}))


def proxy_step(
    proxy: nn.Module, optimizer: torch.optim.Optimizer, batch: Mapping[str, torch.Tensor]
) -> float:
    """One optimizer step of ``proxy`` on ``batch`` (token-mean cross-entropy); returns the loss."""
    proxy.train()
    device = next(proxy.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    out = proxy(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    logits = out if isinstance(out, torch.Tensor) else out.logits
    counts = (batch["labels"][:, 1:] != -100).sum(-1)
    loss = (per_example_loss(logits, batch["labels"]) * counts).sum() / counts.sum().clamp(min=1)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


class DistillationModule(L.LightningModule):
    """Train ``student`` against a frozen ``teacher`` with hierarchical (or logits-only) distillation.

    The teacher is used, not owned (as :class:`~tlt_lightning.rl.GRPOModule` keeps its reference
    model): it is not a registered submodule, so it is neither in ``state_dict()`` and Lightning
    checkpoints (it is an input, rebuilt by whoever builds the module) nor in ``parameters()`` and
    DDP's buckets and broadcasts; it still follows the module's ``.to()`` (device and dtype, so
    Lightning moves it with the student). Its parameters are frozen and it stays in eval mode. The
    optimizer covers the student and the distillation projections. Batches are dicts with
    ``input_ids``, optional ``attention_mask`` and ``labels``. Resume: build the module with the same
    teacher and pass ``ckpt_path``; checkpoints that still hold ``teacher.*`` weights load too (those
    keys are dropped).

    Args:
        student, teacher: HF causal LMs with the same vocabulary.
        config: layers, losses, temperature (``DistillConfig.logits_only()`` for plain KD).
        ce_weight: weight of the hard-label cross-entropy next to the distillation loss (>= 0).
        lr: AdamW learning rate.

    Example:
        >>> config = DistillConfig(hidden_loss="cosine")
        >>> module = DistillationModule(student, teacher, config)  # doctest: +SKIP
        >>> L.Trainer(max_steps=100).fit(module, loader)  # doctest: +SKIP
    """

    # Not submodules: out of state_dict, checkpoints, parameters() and DDP (see the class docstring).
    _UNREGISTERED = frozenset({"teacher"})

    def __init__(
        self,
        student: nn.Module,
        teacher: nn.Module,
        config: DistillConfig | None = None,
        ce_weight: float = 1.0,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0):
            raise ValueError(f"lr must be a number > 0, got {lr!r}")
        self.student, self.teacher = student, teacher
        self.distill = HierarchicalDistillation.from_models(student, teacher, config)
        self.ce_weight, self.lr = ce_weight, lr
        self.teacher.requires_grad_(False)
        self.student.train()
        self.teacher.eval()  # and it stays so: train() does not reach an unregistered module

    def __setattr__(self, name: str, value: Any) -> None:
        if name in DistillationModule._UNREGISTERED:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    @override
    def _apply(self, fn: Any, recurse: bool = True) -> DistillationModule:
        # .to()/.cuda()/.half() all end here: the teacher follows the student's device and dtype.
        super()._apply(fn, recurse)
        if recurse:
            self.teacher._apply(fn)
        return self

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Checkpoints from versions that registered the teacher: its weights are not ours to load.
        state = checkpoint.get("state_dict", {})
        for key in [k for k in state if k.startswith("teacher.")]:
            del state[key]

    @override
    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = distill_step(self.student, self.teacher, self.distill, batch, self.ce_weight)
        self.log_dict(
            {
                "distill/total": out.total,
                "distill/kl": out.kl,
                "distill/hidden": out.hidden,
                "distill/ce": out.ce,
            },
            on_step=True,
            on_epoch=False,
        )
        return out.total

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in [*self.student.parameters(), *self.distill.parameters()] if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr)


class QATCallback(L.Callback):
    """INT4 fake quantization of a submodule during the fit, converted to real INT4 at the end.

    Prepares at ``setup`` (before the optimizer exists; the parameters stay the same objects
    either way) and converts in ``on_fit_end`` when ``convert_at_end``.

    Args:
        config: group size, activations, skip patterns.
        module: attribute path of the part to quantize (e.g. ``"student"``, ``"policy"``);
            ``None``: the whole LightningModule.
        convert_at_end: quantize for real when the fit ends (``False``: leave it fake-quantized,
            e.g. to keep training later).

    Example:
        >>> # L.Trainer(callbacks=[QATCallback(Int4QATConfig(group_size=32), module="student")])
    """

    def __init__(
        self, config: Int4QATConfig | None = None, module: str | None = None, convert_at_end: bool = True
    ) -> None:
        super().__init__()
        self.config = config or Int4QATConfig()
        if not isinstance(self.config, Int4QATConfig):
            raise TypeError(f"config must be an Int4QATConfig, got {type(self.config).__name__}")
        self.module, self.convert_at_end = module, convert_at_end
        self.converted = False

    def _target(self, pl_module: L.LightningModule) -> nn.Module:
        if self.module is None:
            return pl_module
        try:
            return pl_module.get_submodule(self.module)
        except AttributeError as err:
            raise ValueError(
                f"module={self.module!r} is not a submodule of {type(pl_module).__name__}: {err}"
            ) from err

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        target = self._target(pl_module)
        if stage == "fit" and not fake_quantized_modules(target):
            prepare_qat(target, self.config)

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.convert_at_end:
            convert_qat(self._target(pl_module), self.config)
            self.converted = True
