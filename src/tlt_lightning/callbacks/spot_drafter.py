"""SpotDrafterCallback: Lightning glue over a :class:`~tlt_lightning.spot.SpotDrafter`.

The spot drafter (drafter training on idle rollout time, its buffer, publisher, checkpoints and
worker coordination) is a plain object. This callback builds it at fit start and registers it with
the :class:`~tlt_lightning.rl.GRPOModule` as a rollout listener: the module's training step is the
one channel that drives it (``begin_step`` hands the module this step's drafter, BUSY / IDLE / tail
training around the rollout, ``end_step`` after the policy update with ``trainer.strategy.reduce`` as
the cross-rank sum). The Lightning hooks keep what Lightning owns: setup and teardown, logging, run
parameters, Lightning checkpoints, the drafter's own checkpoints and their MLflow registration, the
timeline and summary files.

With an :class:`~lightning.pytorch.loggers.MLFlowLogger`, rank 0 registers every checkpoint once it
is on disk as a version of a registered model (:func:`~tlt_lightning.tracking.log_drafter_version`)
at the next ``on_train_batch_end`` when the writer is idle, the rest at the end of fit: the rollouts
never wait for a write. Without one, MLflow is not imported.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from tlt_lightning.reports import draw_or_skip, write_json
from tlt_lightning.rl.listeners import RolloutListener
from tlt_lightning.rl.module import GRPOModule
from tlt_lightning.rollout import RolloutResult
from tlt_lightning.spot import SpotConfig, SpotDrafter, plot_timeline, step_metrics, timeline_view
from tlt_lightning.tracking import (
    CheckpointRegistrar,
    MeanAcceptLength,
    drafter_model_name,
    log_artifact,
    mlflow_loggers,
    plot_accept_lengths,
    run_dir,
)
from tlt_lightning.validation import check, check_resumed_settings

__all__ = ["SpotDrafterCallback"]

_DEFAULT_CONFIG = SpotConfig()  # frozen: one shared instance is safe
_FIXED = {  # settings a resumed run cannot change: the drafter's weights come from the checkpoint
    "config.kind": "the checkpoint's drafter is of the old kind",
    "config.draft_vocab_size": "the checkpoint's drafter has the old vocabulary",
    "config.drafter_path": "the drafter's weights are the checkpoint's",
}


class _StepListener(RolloutListener):
    """The module's training-step events, handed to the :class:`SpotDrafter` (its only way in)."""

    def __init__(self, spot: SpotDrafter) -> None:
        self.spot = spot
        self.step: tuple[RolloutResult, dict[str, float]] | None = None  # the last step's rollout, sums

    def begin_step(self, module: GRPOModule) -> None:
        self.step = None
        module.drafter = self.spot.begin_step(module.global_step)  # this rollout's versioned copy

    def before_rollout(self) -> None:
        self.spot.before_rollout()

    def after_rollout(self, result: RolloutResult) -> None:
        self.spot.after_rollout(result)

    def end_step(self, module: GRPOModule, result: RolloutResult) -> None:
        reduce = module.trainer.strategy.reduce
        total = self.spot.end_step(result, lambda t: reduce(t, reduce_op="sum"), device=module.device)
        self.step = (result, total)


class SpotDrafterCallback(L.Callback):
    """Spot-trains the drafter of a :class:`~tlt_lightning.rl.GRPOModule` on idle rollout time.

    ``Trainer(callbacks=[SpotDrafterCallback()])`` works with the defaults: if the module has no
    drafter, one is built for its target (or loaded from ``config.drafter_path``), the module's
    rollouts harvest its training data and draft with its newest published version.

    Args:
        config: what the spot drafter keeps, builds, trains and saves: a
            :class:`~tlt_lightning.spot.SpotConfig` (its optimizer, packing, paid budget and seed
            are ``config.training``, a :class:`~tlt_lightning.spot.SpotTrainerConfig`) or a dict of
            its fields (:meth:`~tlt_lightning.spot.SpotConfig.from_dict`). In a fit config:
            ``init_args: {config: {kind: eagle3, training: {max_steps_per_rollout: 4}}}``.
        save_buffer: also put the buffer's data into Lightning checkpoints (default): a resumed run
            trains the drafter on the same samples, so its rollouts match the uninterrupted run's
            (costs up to ``config.buffer_mb`` per checkpoint). ``False``: counters only; the
            rollouts then diverge.
        timeline: save a per-worker Gantt chart PNG per epoch and for the whole fit.
        registered_model_name: with an ``MLFlowLogger``, each drafter checkpoint becomes a version
            of this registered model (tag ``rl_step``); ``None``:
            :func:`~tlt_lightning.tracking.drafter_model_name` of the module's ``model``.

    Logged after every RL step (identical on all ranks): :func:`~tlt_lightning.spot.step_metrics`
    and ``drafter/accept_length`` (mean tokens per speculative step of this rollout, ``NaN`` when it
    did not speculate). Run
    parameters at fit start: :meth:`params`. Files (rank 0, under
    :func:`~tlt_lightning.tracking.run_dir`, also MLflow artifacts): ``drafter/checkpoints/step-XXXXXXXX/``,
    ``drafter/timeline/*.png``, ``drafter/summary.json``, ``drafter/accept_length.png``.

    Attributes:
        spot: the :class:`~tlt_lightning.spot.SpotDrafter` it drives (built at fit start, kept after
            it): ``spot.drafter`` (after fit also ``module.drafter``), ``spot.publisher``,
            ``spot.buffer``, the counters ``spot.steps``, ``spot.rl_steps``, ...
        registrar: the :class:`~tlt_lightning.tracking.CheckpointRegistrar` (``registered_steps``:
            RL steps whose checkpoint is a registered-model version; ``versions``: those this fit
            created).
        run_dir: the run's own output directory (set at fit start).
        last_metrics: what the last RL step logged.

    Example:
        >>> # trainer = L.Trainer(max_steps=100, callbacks=[SpotDrafterCallback({"training": {"lr": 3e-4}})])
        >>> # trainer.fit(GRPOModule(model="smollm2-135m"))
    """

    def __init__(
        self,
        config: SpotConfig = _DEFAULT_CONFIG,
        save_buffer: bool = True,
        timeline: bool = True,
        registered_model_name: str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(config, Mapping):
            config = SpotConfig.from_dict(config)
        if not isinstance(config, SpotConfig):
            raise TypeError(
                f"config must be a SpotConfig or a dict of its fields, got {type(config).__name__}"
            )
        name = registered_model_name
        check(
            name is None or (isinstance(name, str) and bool(name.strip())),
            "registered_model_name",
            name,
            "a non-empty string or None",
        )
        self.config = config
        self.save_buffer, self.timeline, self.registered_model_name = bool(save_buffer), bool(timeline), name
        # Built at fit start (no I/O here; nothing unpicklable before ddp_spawn pickles the callback).
        self.spot: SpotDrafter | None = None
        self._listener: _StepListener | None = None
        self._module: GRPOModule | None = None
        self._pending: dict[str, Any] | None = None
        self.registrar = CheckpointRegistrar(None)  # named at fit start: rank 0 with an MLFlowLogger
        self.run_dir: Path | None = None
        self.last_metrics: dict[str, float] = {}
        self._resumed = self._finished = False
        self.resume_overrides = "refuse"  # resumed with other settings: refused, or "apply" them

    # ------------------------------------------------------------------------------ fit start / end
    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not isinstance(pl_module, GRPOModule):
            raise TypeError(f"SpotDrafterCallback needs a GRPOModule, got {type(pl_module).__name__}")
        module = self._module = pl_module
        self._pending, pending = None, self._pending or {}
        self._resumed, self._finished = bool(pending), False
        self.run_dir = run_dir(trainer)  # on every rank: rank 0's directory, broadcast
        self.spot = spot = SpotDrafter(
            self.config,
            module.policy_target,
            self.run_dir / "drafter" / "checkpoints",
            serving_target=module.rollout_target,
            drafter=module.drafter,
            state=pending,
        )
        registry = trainer.is_global_zero and bool(mlflow_loggers(trainer))
        model = str(module.hparams.model)
        self.registrar = CheckpointRegistrar(
            (self.registered_model_name or drafter_model_name(model)) if registry else None,
            target_model=model,
        )
        self._load_registrar(pending)
        layers = tuple(spot.drafter.config.rollout_feature_layers)
        if module.rollout_feature_layers and tuple(module.rollout_feature_layers) != layers:
            warnings.warn(
                f"SpotDrafterCallback replaces module.rollout_feature_layers "
                f"{tuple(module.rollout_feature_layers)} with the drafter's {layers}",
                stacklevel=2,
            )
        module.rollout_feature_layers = layers
        self._listener = _StepListener(spot)
        module.add_rollout_listener(self._listener)
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
            raise RuntimeError(
                "SpotDrafterCallback.params() is known once fit has started (the drafter is built then)"
            )
        settings = {
            **self.spot.params(),
            "save_buffer": self.save_buffer,
            "timeline": self.timeline,
            "registered_model_name": self.registrar.name or self.registered_model_name,
        }
        return {f"drafter/{name}": value for name, value in settings.items()}

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A resumed fit: the drafter saved at the step it resumes from may not have landed, or not
        # been registered, before the first fit stopped. The restored drafter is that very drafter
        # (weights, optimizer, counters): save it again, registered like any other save.
        step, last = trainer.global_step, self.spot.last_checkpoint
        saved_there = last is not None and Path(last).name == f"step-{step:08d}"
        if (
            self._resumed
            and trainer.is_global_zero
            and step not in self.registrar.registered_steps
            and (saved_there or step in self.registrar.pending_steps)
        ):
            self._save(step)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._module is None:
            return
        self._module.remove_rollout_listener(self._listener)
        self.spot.close()
        self._module.drafter = self.spot.drafter  # the trained weights, e.g. for export after fit
        self._module = self._listener = None

    # ------------------------------------------------------------------------------ after each RL step
    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._listener.step is None:
            raise RuntimeError(
                f"{type(pl_module).__name__}.training_step did not tell its rollout listeners that the step "
                "ended: an overridden training_step must call the listeners as GRPOModule.training_step does"
            )
        result, total = self._listener.step
        self._log(pl_module, result, total, trainer.world_size)
        self.registrar.register(
            trainer, self.spot.checkpointer
        )  # what landed since the last step (never waits)
        if trainer.is_global_zero and self.spot.due(trainer.global_step):
            self._save(trainer.global_step)

    def _log(self, module: GRPOModule, result: RolloutResult, total: dict[str, float], world: int) -> None:
        # Every value is identical on all ranks (reduced by end_step): no sync_dist, no extra collective.
        self.accept_length.update(result.stats)
        accept = float(self.accept_length.compute())
        self.accept_length.reset()
        self._accepts.append((self.spot.rl_steps, accept))
        counts = torch.bincount(result.stats.accept_lengths.cpu().long(), minlength=self._accept_hist.numel())
        counts[: self._accept_hist.numel()] += self._accept_hist
        self._accept_hist = counts
        metrics = {**step_metrics(total, world, self.spot.publisher.version), "drafter/accept_length": accept}
        for name, value in metrics.items():
            module.log(name, value, on_step=True, on_epoch=False, prog_bar=name == "drafter/top1")
        self.last_metrics = metrics

    # ------------------------------------------------------------------------------ checkpoints
    def _save(self, rl_step: int) -> None:
        requested = time.time()
        path = self.spot.save(rl_step)  # returns at once
        if path is not None:
            self.registrar.request(rl_step, requested, path)

    def settings(self) -> dict[str, Any]:
        """What shapes the drafter's training (its ``config``), saved in every checkpoint and compared on
        resume (:func:`~tlt_lightning.validation.check_resumed_settings`)."""
        return {"config": asdict(self.config)}

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None or self.spot is None:  # loaded, not applied yet
            return dict(self._pending or {})
        return {
            "settings": self.settings(),
            **self.spot.state_dict(buffer_data=self.save_buffer),
            "registered_steps": list(self.registrar.registered_steps),
            "registrar": self.registrar.state_dict(),
        }  # also the saves not registered yet

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; missing keys keep their current values.

        Lightning restores callbacks before ``on_fit_start`` builds the drafter: the state is then
        kept and applied there (also for a callback reused for another fit). During a fit (a
        strategy that restores after setup) it is applied at once.

        Raises:
            ValueError: the checkpoint's :meth:`settings` differ and ``resume_overrides`` is not
                ``"apply"``, or the drafter's kind, vocabulary or source differ (its weights are the
                checkpoint's).
        """
        changed = check_resumed_settings(
            "SpotDrafterCallback", state_dict.get("settings"), self.settings(), self.resume_overrides, _FIXED
        )
        if changed and "optimizer" in state_dict:  # applied: the restored optimizer takes the new values
            state_dict = {**state_dict, "optimizer": copy.deepcopy(state_dict["optimizer"])}
            training = self.config.training
            for group in state_dict["optimizer"].get("param_groups", []):
                group["lr"], group["weight_decay"] = training.lr, training.weight_decay
        if self._module is None:
            self._pending = dict(state_dict)
        else:
            self.spot.load_state_dict(state_dict, publisher_too=True)
            self._load_registrar(state_dict)

    def _load_registrar(self, state: Mapping[str, Any]) -> None:
        self.registrar.load_state_dict(state.get("registrar", {}))
        if "registrar" not in state:  # a checkpoint from before the registrar had its own state
            steps = state.get("registered_steps", self.registrar.registered_steps)
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
            self._plot(
                trainer,
                self._epoch_start,
                f"epoch-{trainer.current_epoch:03d}.png",
                f"epoch {trainer.current_epoch}",
            )
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
            figure = draw_or_skip(
                plot_accept_lengths,
                steps,
                means,
                self._accept_hist.tolist(),
                path.parent / "accept_length.png",
            )
            if figure is not None:
                log_artifact(trainer, figure, "drafter")
