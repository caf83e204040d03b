"""SpotDrafterCallback: Lightning hooks over a :class:`~tlt_lightning.spot.SpotDrafter`.

The spot drafter (drafter training on idle rollout time, its buffer, publisher, checkpoints and
worker coordination) is a plain object; this callback builds it at fit start, registers it as a
rollout listener of the :class:`~tlt_lightning.rl.GRPOModule` (BUSY / IDLE / tail training around
each training step's rollout), calls its step verbs from the batch hooks with
``trainer.strategy.reduce`` as the cross-rank sum, and does the Lightning side: logging, run
parameters, MLflow registration of its checkpoints, the timeline and summary files.

With an :class:`~lightning.pytorch.loggers.MLFlowLogger`, rank 0 registers every checkpoint once it
is on disk as a version of a registered model (:func:`~tlt_lightning.tracking.log_drafter_version`)
at the next ``on_train_batch_end`` when the writer is idle, the rest at the end of fit: the rollouts
never wait for a write. Without one, MLflow is not imported.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from tlt_lightning.drafter import SpotTrainerConfig
from tlt_lightning.reports import draw_or_skip, write_json
from tlt_lightning.rl.module import GRPOModule
from tlt_lightning.scheduling import plot_timeline
from tlt_lightning.spot import SpotConfig, SpotDrafter, step_metrics, timeline_view
from tlt_lightning.tracking import (
    CheckpointRegistrar,
    MeanAcceptLength,
    drafter_model_name,
    log_artifact,
    mlflow_loggers,
    plot_accept_lengths,
    run_dir,
)

__all__ = ["SpotDrafterCallback"]


def _spot_attribute(name: str, before_fit: Any) -> property:
    return property(lambda self: before_fit if self.spot is None else getattr(self.spot, name))


class SpotDrafterCallback(L.Callback):
    """Spot-trains the drafter of a :class:`~tlt_lightning.rl.GRPOModule` on idle rollout time.

    ``Trainer(callbacks=[SpotDrafterCallback()])`` works with the defaults: if the module has no
    drafter, one is built for its target (or loaded from ``drafter_path``), the module's rollouts
    harvest its training data and draft with its newest published version. The settings are those
    of :class:`~tlt_lightning.spot.SpotConfig` and :class:`~tlt_lightning.drafter.SpotTrainerConfig`
    (more detail there), and:

    Args:
        lr: AdamW learning rate of the drafter (``> 0``).
        buffer_mb: memory bound of the rollout buffer in MiB (``> 0``); oldest rollouts are evicted.
        packing_budget: samples (tokens) packed into one drafter training step (``>= 2``).
        checkpoint_interval: save the drafter asynchronously every this many RL steps (rank 0,
            under ``<run dir>/drafter/checkpoints``); ``None``: only at the end of fit.
        min_idle_s: train in a tail only if it lasts at least this long (``>= 0`` seconds).
        max_steps_per_rollout: paid training between rollouts (single worker, or when no rank
            was idle): at most this many drafter steps (``>= 0``; ``None``: no step limit).
        max_seconds_per_rollout: paid training: at most this many seconds (``> 0`` or ``None``).
            At least one of the two must be set: paid training costs RL step time.
        kind: drafter kind built when the module has none, ``"eagle1"`` or ``"eagle3"``.
        draft_vocab_size: draft vocabulary of a built drafter (the first ids), capped at the
            target's vocabulary; ``None``: full vocabulary.
        drafter_path: load the drafter from this directory or ``models:/`` / ``runs:/`` URI
            (:func:`~tlt_lightning.drafter.load_drafter`) instead of building one.
        recency_decay: buffer sampling weight ``recency_decay ** age`` in policy steps, in ``(0, 1]``.
        weight_decay: AdamW weight decay (``>= 0``).
        max_grad_norm: drafter gradient clipping (``> 0`` or ``None``).
        save_buffer: also put the buffer's data into Lightning checkpoints (default): a resumed run
            trains the drafter on the same samples, so its rollouts match the uninterrupted run's
            (costs up to ``buffer_mb`` per checkpoint: 2.2 MiB after 2 steps of
            ``configs/grpo_smollm2.yaml``). ``False``: counters only; the rollouts then diverge.
        timeline: save a per-worker Gantt chart PNG per epoch and for the whole fit.
        seed: seeds a built drafter's weights (identical on every rank) and batch sampling.
        registered_model_name: with an ``MLFlowLogger``, each drafter checkpoint becomes a version
            of this registered model (tag ``rl_step``); ``None``:
            :func:`~tlt_lightning.tracking.drafter_model_name` of the module's ``model``.

    Logged after every RL step (identical on all ranks): :func:`~tlt_lightning.spot.step_metrics`
    and ``drafter/accept_length`` (mean tokens per speculative step of this rollout). Run
    parameters at fit start: :meth:`params`. Files (rank 0, under
    :func:`~tlt_lightning.tracking.run_dir`, also MLflow artifacts): ``drafter/checkpoints/step-XXXXXXXX/``,
    ``drafter/timeline/*.png``, ``drafter/summary.json``, ``drafter/accept_length.png``.

    Attributes:
        spot: the :class:`~tlt_lightning.spot.SpotDrafter` it drives (built at fit start); ``drafter``
            (after fit also ``module.drafter``), ``optimizer``, ``buffer``, ``coordinator``,
            ``publisher``, ``checkpointer``, ``spot_trainer``, the counters ``steps``, ``tail_steps``,
            ``paid_steps``, ``rl_steps``, ``local_stats`` and ``last_checkpoint`` are its.
        registered_steps: RL steps whose checkpoint is a registered-model version (checkpointed);
            ``registered_versions``: the ``ModelVersion`` objects this fit created.
        run_dir: the run's own output directory (set at fit start).

    Example:
        >>> # trainer = L.Trainer(max_steps=100, callbacks=[SpotDrafterCallback(lr=3e-4)])
        >>> # trainer.fit(GRPOModule(model="smollm2-135m"))
    """

    def __init__(
        self,
        lr: float = 3e-4,
        buffer_mb: float = 256.0,
        packing_budget: int = 1024,
        checkpoint_interval: int | None = 10,
        min_idle_s: float = 0.05,
        max_steps_per_rollout: int | None = 4,
        max_seconds_per_rollout: float | None = 2.0,
        kind: str = "eagle1",
        draft_vocab_size: int | None = 8192,
        drafter_path: str | os.PathLike | None = None,
        recency_decay: float = 0.5,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        save_buffer: bool = True,
        timeline: bool = True,
        seed: int = 0,
        registered_model_name: str | None = None,
    ) -> None:
        super().__init__()
        self.lr, self.buffer_mb, self.packing_budget = lr, buffer_mb, packing_budget
        self.checkpoint_interval, self.min_idle_s = checkpoint_interval, min_idle_s
        self.max_steps_per_rollout, self.max_seconds_per_rollout = max_steps_per_rollout, max_seconds_per_rollout
        self.kind, self.draft_vocab_size, self.drafter_path = kind, draft_vocab_size, drafter_path
        self.recency_decay, self.weight_decay, self.max_grad_norm = recency_decay, weight_decay, max_grad_norm
        self.seed = seed
        self.config()  # validates, naming the argument
        name = registered_model_name
        if not (name is None or (isinstance(name, str) and name.strip())):
            raise ValueError(f"registered_model_name must be a non-empty string or None, got {name!r}")
        self.save_buffer, self.timeline, self.registered_model_name = bool(save_buffer), bool(timeline), name
        # Built at fit start (no I/O here; nothing unpicklable before ddp_spawn pickles the callback).
        self.spot: SpotDrafter | None = None
        self._module: GRPOModule | None = None
        self._pending: dict[str, Any] | None = None
        self.registrar = CheckpointRegistrar(None)  # named at fit start: rank 0 with an MLFlowLogger
        self.run_dir: Path | None = None
        self.last_metrics: dict[str, float] = {}  # what the last RL step logged
        self._resumed = self._finished = False

    def config(self) -> SpotConfig:
        """The :class:`~tlt_lightning.spot.SpotConfig` of these arguments."""
        training = SpotTrainerConfig(
            lr=self.lr, packing_budget=self.packing_budget, max_steps_per_rollout=self.max_steps_per_rollout,
            max_seconds_per_rollout=self.max_seconds_per_rollout, weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm, seed=self.seed)
        return SpotConfig(training, buffer_mb=self.buffer_mb, recency_decay=self.recency_decay,
                          min_idle_s=self.min_idle_s, checkpoint_interval=self.checkpoint_interval, kind=self.kind,
                          draft_vocab_size=self.draft_vocab_size, drafter_path=self.drafter_path)

    drafter = _spot_attribute("drafter", None)
    optimizer = _spot_attribute("optimizer", None)
    buffer = _spot_attribute("buffer", None)
    coordinator = _spot_attribute("coordinator", None)
    publisher = _spot_attribute("publisher", None)
    checkpointer = _spot_attribute("checkpointer", None)
    spot_trainer = _spot_attribute("spot_trainer", None)
    last_checkpoint = _spot_attribute("last_checkpoint", None)
    local_stats = _spot_attribute("local_stats", {})
    steps, tail_steps = _spot_attribute("steps", 0), _spot_attribute("tail_steps", 0)
    paid_steps, rl_steps = _spot_attribute("paid_steps", 0), _spot_attribute("rl_steps", 0)

    @property
    def registered_steps(self) -> list[int]:
        return self.registrar.registered_steps

    @property
    def registered_versions(self) -> list[Any]:
        return self.registrar.versions

    # ------------------------------------------------------------------------------ fit start / end
    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not isinstance(pl_module, GRPOModule):
            raise TypeError(f"SpotDrafterCallback needs a GRPOModule, got {type(pl_module).__name__}")
        module = self._module = pl_module
        self._pending, pending = None, self._pending or {}
        self._resumed, self._finished = bool(pending), False
        self.run_dir = run_dir(trainer)  # on every rank: rank 0's directory, broadcast
        self.spot = spot = SpotDrafter(self.config(), module.policy_target, self.run_dir / "drafter" / "checkpoints",
                                       serving_target=module.rollout_target, drafter=module.drafter, state=pending)
        registry = trainer.is_global_zero and bool(mlflow_loggers(trainer))
        model = str(module.hparams.model)
        self.registrar = CheckpointRegistrar((self.registered_model_name or drafter_model_name(model))
                                             if registry else None, target_model=model)
        self._load_registrar(pending)
        layers = tuple(spot.drafter.config.rollout_feature_layers)
        if module.rollout_feature_layers and tuple(module.rollout_feature_layers) != layers:
            warnings.warn(f"SpotDrafterCallback replaces module.rollout_feature_layers "
                          f"{tuple(module.rollout_feature_layers)} with the drafter's {layers}", stacklevel=2)
        module.rollout_feature_layers = layers
        module.add_rollout_listener(spot)
        self.accept_length = MeanAcceptLength().to(module.device)
        self._epoch_start = time.time()
        self._accepts, self._accept_hist = [], torch.zeros(0, dtype=torch.long)
        for logger in trainer.loggers:  # run parameters (MLflow params, CSV hparams.yaml); rank 0 only
            logger.log_hyperparams(self.params())

    def params(self) -> dict[str, Any]:
        """The settings of this callback and of the drafter it trains, as run parameters ``drafter/<name>``.

        Logged at fit start through every logger's ``log_hyperparams`` (MLflow run params). The
        ``effective_*`` entries describe the drafter actually trained (built, loaded from
        ``drafter_path``, taken over from the module or restored from a checkpoint), which may
        differ from ``kind`` / ``draft_vocab_size``.
        """
        if self.spot is None:
            raise RuntimeError("SpotDrafterCallback.params() is known once fit has started (the drafter is built then)")
        settings = {**self.spot.params(), "save_buffer": self.save_buffer, "timeline": self.timeline,
                    "registered_model_name": self.registrar.name or self.registered_model_name}
        return {f"drafter/{name}": value for name, value in settings.items()}

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A resumed fit: the drafter saved at the step it resumes from may not have landed, or not
        # been registered, before the first fit stopped. The restored drafter is that very drafter
        # (weights, optimizer, counters): save it again, registered like any other save.
        step, last = trainer.global_step, self.last_checkpoint
        saved_there = last is not None and Path(last).name == f"step-{step:08d}"
        if (self._resumed and trainer.is_global_zero and step not in self.registered_steps
                and (saved_there or step in self.registrar.pending_steps)):
            self._save(step)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._module is None:
            return
        self._module.remove_rollout_listener(self.spot)
        self.spot.close()
        self._module.drafter = self.spot.drafter  # the trained weights, e.g. for export after fit
        self._module = None

    # ------------------------------------------------------------------------------ the RL step
    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        pl_module.drafter = self.spot.begin_step(trainer.global_step)  # this rollout's versioned copy

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        result = outputs["rollout"] if isinstance(outputs, Mapping) else pl_module.last_rollout
        total = self.spot.end_step(result, lambda t: trainer.strategy.reduce(t, reduce_op="sum"),
                                   device=pl_module.device)
        self._log(pl_module, result, total, trainer.world_size)
        self.registrar.register(trainer, self.checkpointer)  # what landed since the last step (never waits)
        if trainer.is_global_zero and self.spot.due(trainer.global_step):
            self._save(trainer.global_step)

    def _log(self, module: GRPOModule, result: Any, total: dict[str, float], world: int) -> None:
        # Every value is identical on all ranks (reduced by end_step): no sync_dist, no extra collective.
        self.accept_length.update(result.stats)
        accept = float(self.accept_length.compute())
        self.accept_length.reset()
        self._accepts.append((self.rl_steps, accept))
        counts = torch.bincount(result.stats.accept_lengths.cpu().long(), minlength=self._accept_hist.numel())
        counts[: self._accept_hist.numel()] += self._accept_hist
        self._accept_hist = counts
        metrics = {**step_metrics(total, world, self.publisher.version), "drafter/accept_length": accept}
        for name, value in metrics.items():
            module.log(name, value, on_step=True, on_epoch=False, prog_bar=name == "drafter/top1")
        self.last_metrics = metrics

    # ------------------------------------------------------------------------------ checkpoints
    def _save(self, rl_step: int) -> None:
        requested = time.time()
        path = self.spot.save(rl_step)  # returns at once
        if path is not None:
            self.registrar.request(rl_step, requested, path)

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None or self.spot is None:  # loaded, not applied yet
            return dict(self._pending or {})
        return {**self.spot.state_dict(buffer_data=self.save_buffer),
                "registered_steps": list(self.registered_steps),
                "registrar": self.registrar.state_dict()}  # also the saves not registered yet

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; missing keys keep their current values.

        Lightning restores callbacks before ``on_fit_start`` builds the drafter: the state is then
        kept and applied there (also for a callback reused for another fit). During a fit (a
        strategy that restores after setup) it is applied at once.
        """
        if self._module is None:
            self._pending = dict(state_dict)
        else:
            self.spot.load_state_dict(state_dict, publisher_too=True)
            self._load_registrar(state_dict)

    def _load_registrar(self, state: Mapping[str, Any]) -> None:
        self.registrar.load_state_dict(state.get("registrar", {}))
        if "registrar" not in state:  # a checkpoint from before the registrar had its own state
            steps = state.get("registered_steps", self.registered_steps)
            self.registrar.registered_steps = [int(s) for s in steps]

    # ------------------------------------------------------------------------------ timeline / end
    def _plot(self, trainer: L.Trainer, since: float | None, name: str, label: str) -> float:
        """Save (rank 0) the Gantt chart; returns the idle fraction recovered over the span."""
        shown, recovered, paid_per_worker = timeline_view(*self.spot.timeline(since))  # a collective
        if trainer.is_global_zero and shown:
            title = f"{label}: idle recovered {recovered:.0%}, paid training {paid_per_worker:.1f} s/worker"
            path = draw_or_skip(plot_timeline, shown, self.run_dir / "drafter" / "timeline" / name, title)
            if path is not None:  # None: no matplotlib (warned once), the fit goes on
                log_artifact(trainer, path, "drafter/timeline")
        return recovered

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.timeline:
            self._plot(trainer, self._epoch_start, f"epoch-{trainer.current_epoch:03d}.png",
                       f"epoch {trainer.current_epoch}")
        self._epoch_start = time.time()

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._finish(trainer)

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._finished:  # resumed from the last step: no training ran, Lightning skipped on_train_end
            self._finish(trainer)

    def _finish(self, trainer: L.Trainer) -> None:
        """End of fit: the final drafter saved, every save registered (rank 0), timeline and summary."""
        self._finished = True
        recovered = self._plot(trainer, None, "fit.png", "whole fit") if self.timeline else None
        if not trainer.is_global_zero:
            return
        spot = self.spot
        self._save(trainer.global_step)
        spot.checkpointer.wait()
        self.registrar.register(trainer, spot.checkpointer)
        summary = {**spot.summary(), "idle_fraction_recovered": recovered, "run_dir": str(self.run_dir)}
        path = write_json(self.run_dir / "drafter" / "summary.json", summary)
        log_artifact(trainer, path, "drafter")
        if self._accepts:
            steps, means = zip(*self._accepts)
            figure = draw_or_skip(plot_accept_lengths, steps, means, self._accept_hist.tolist(),
                                  path.parent / "accept_length.png")
            if figure is not None:
                log_artifact(trainer, figure, "drafter")
