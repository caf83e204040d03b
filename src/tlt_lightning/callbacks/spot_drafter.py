"""SpotDrafterCallback: train the drafter on idle rollout-worker time, keep it aligned with the policy.

Lightning glue over plain objects (:mod:`tlt_lightning.drafter`, :mod:`tlt_lightning.scheduling`):
a :class:`~tlt_lightning.drafter.SpotTrainer` (the drafter's AdamW optimizer, packed batches from a
:class:`~tlt_lightning.drafter.RolloutBuffer` of harvested features, local and paid drafter steps,
cross-rank averaging), a :class:`~tlt_lightning.scheduling.WorkerCoordinator` (BUSY / IDLE /
TRAINING), a :class:`~tlt_lightning.drafter.DrafterPublisher` and an
:class:`~tlt_lightning.drafter.AsyncCheckpointer`.

One RL step, per rank:

1. ``on_train_batch_start``: the rollout acquires the newest published drafter version
   (``module.drafter`` = that serving copy, held until the step ends: never half-updated weights).
2. Inside ``module.rollout`` (wrapped at fit start; the only point between a rank's own rollout and
   the first collective after it): BUSY while generating, then ``share_done`` (IDLE), the rollout
   goes into the buffer tagged with the policy step, and with several ranks the worker trains the
   drafter (TRAINING) until the *last* rank has finished its share, preempted between drafter
   steps. In-window steps are local: no collectives.
3. ``on_train_batch_end`` (after the policy update): the one sync point. If no rank trained in the
   tail (a single worker never can: there is no idle device; or perfectly balanced rollouts), every
   rank trains a *paid* bounded budget (``max_steps_per_rollout`` / ``max_seconds_per_rollout``),
   logged as ``drafter/paid_seconds`` and ``drafter/overhead_fraction``, never as recovered idle
   time. Then the ranks' drafters are made identical by a step-weighted average of weights and
   AdamW state (:meth:`~tlt_lightning.drafter.SpotTrainer.average`: one ``trainer.strategy.reduce``;
   a rank that did not train contributes nothing), the result is published (version + 1), logged,
   and every ``checkpoint_interval`` RL steps saved asynchronously by rank 0.

With an :class:`~lightning.pytorch.loggers.MLFlowLogger`, rank 0 registers every checkpoint once it
is on disk as a version of a registered model (:func:`~tlt_lightning.tracking.log_drafter_version`)
at the next ``on_train_batch_end`` when the writer is idle, the rest at the end of fit: the rollouts
never wait for a write. Without one, MLflow is not imported.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
import warnings
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from typing_extensions import override

from tlt_lightning.drafter import (
    DRAFTER_KINDS,
    AsyncCheckpointer,
    BufferConfig,
    Drafter,
    DrafterConfig,
    DrafterLease,
    DrafterPublisher,
    RolloutBuffer,
    SpotTrainer,
    SpotTrainerConfig,
    load_drafter,
)
from tlt_lightning.drafter.mlflow_uri import is_mlflow_uri
from tlt_lightning.rl.module import GRPOModule
from tlt_lightning.rollout.types import RolloutResult
from tlt_lightning.scheduling import (
    CoordinatorConfig,
    Segment,
    WorkerCoordinator,
    WorkerState,
    idle_fraction_recovered,
    plot_timeline,
)
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

# The per-step statistics every rank contributes to one summed reduce.
_STATS = ("tail_steps", "paid_steps", "loss", "top1", "tail_s", "idle_s", "paid_s", "step_s",
          "latency_sum", "latency_n", "buffer_mb", "buffer_tokens")  # fmt: skip


def _check(condition: bool, name: str, value: Any, allowed: str) -> None:
    if not condition:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _without(segment: Segment, cuts: list[Segment]) -> list[Segment]:
    """``segment`` minus the time spans of ``cuts`` (of the same worker)."""
    pieces = [(segment.start, segment.end)]
    for cut in cuts:
        if cut.worker != segment.worker:
            continue
        pieces = [
            piece
            for a, b in pieces
            for piece in ([(a, b)] if cut.end <= a or cut.start >= b else [(a, cut.start), (cut.end, b)])
            if piece[1] > piece[0]
        ]
    return [Segment(segment.worker, segment.state, a, b) for a, b in pieces]


class SpotDrafterCallback(L.Callback):
    """Spot-trains the drafter of a :class:`~tlt_lightning.rl.GRPOModule` on idle rollout time.

    ``Trainer(callbacks=[SpotDrafterCallback()])`` works with the defaults: if the module has no
    drafter, one is built for its target (or loaded from ``drafter_path``), the module's rollouts
    harvest its training data and draft with its newest published version.

    Args:
        lr: AdamW learning rate of the drafter (``> 0``).
        buffer_mb: memory bound of the rollout buffer in MiB (``> 0``); oldest rollouts are evicted.
        packing_budget: samples (tokens) packed into one drafter training step (``>= 2``).
        checkpoint_interval: save the drafter asynchronously every this many RL steps (rank 0,
            under ``<run dir>/drafter/checkpoints``); ``None``: only at the end of fit.
        min_idle_s: train in a tail only if it lasts at least this long after the worker's share
            (``>= 0`` seconds).
        max_steps_per_rollout: paid training between rollouts (single worker, or when no rank
            was idle): at most this many drafter steps (``>= 0``; ``None``: no step limit).
        max_seconds_per_rollout: paid training: at most this many seconds (``> 0`` or ``None``);
            a step the remaining time cannot hold (by the mean step so far) is not started. At
            least one of the two must be set: paid training costs RL step time.
        kind: drafter kind built when the module has none, ``"eagle1"`` or ``"eagle3"``.
        draft_vocab_size: draft vocabulary of a built drafter, capped at the target's vocabulary;
            the first ids (BPE ids are roughly ordered by merge frequency); ``None``: full vocabulary.
        drafter_path: load the drafter from this :func:`~tlt_lightning.drafter.save_drafter` (or
            async checkpoint) directory, or a ``models:/<name>/<version>`` / ``runs:/`` URI of one
            (:func:`~tlt_lightning.drafter.load_drafter`), instead of building one (e.g. a warmed-up drafter).
        recency_decay: buffer sampling weight ``recency_decay ** age`` in policy steps, in ``(0, 1]``.
        weight_decay: AdamW weight decay (``>= 0``).
        max_grad_norm: drafter gradient clipping (``> 0`` or ``None``).
        save_buffer: also put the buffer's data into Lightning checkpoints (default): a resumed
            run trains the drafter on the same samples, so its drafts, and with them the sampled
            rollouts, match the uninterrupted run's. Costs up to ``buffer_mb`` per checkpoint (the
            bf16 hidden-state features of recent responses, 1.1 KB per response token on
            SmolLM2-135M: measured 2.2 MiB after 2 steps of ``configs/grpo_smollm2.yaml``).
            ``False``: counters only; the drafter then trains on other data after a resume and the
            rollouts diverge.
        timeline: save a per-worker Gantt chart PNG per epoch and for the whole fit.
        seed: seeds a built drafter's weights (identical on every rank) and batch sampling.
        registered_model_name: with an ``MLFlowLogger``, each drafter checkpoint becomes a version of
            this registered model (tag ``rl_step``; load one with
            :func:`~tlt_lightning.tracking.load_drafter_from_mlflow`); ``None``:
            :func:`~tlt_lightning.tracking.drafter_model_name` of the module's ``model``, e.g.
            ``"tlt-drafter-smollm2-135m"``.

    Logged after every RL step (values summed or averaged over ranks, identical on all):
        ``drafter/loss``, ``drafter/top1`` (mean over this step's drafter steps, when there were
        any), ``drafter/version``, ``drafter/steps`` = ``tail_steps`` + ``paid_steps``,
        ``drafter/train_seconds`` (tail + paid), ``drafter/paid_seconds``, ``drafter/idle_seconds``
        (idle and not training), ``drafter/idle_fraction_recovered`` (tail training over idle +
        tail training time: ``0`` for a single worker, which has no idle time),
        ``drafter/overhead_fraction`` (paid seconds over the RL step without them),
        ``drafter/buffer_mb`` and ``drafter/buffer_tokens`` (per rank), ``drafter/accept_length``
        (mean tokens per speculative step of this rollout) and ``drafter/preemption_latency_s``.

    Run parameters (every logger's ``log_hyperparams``, at fit start): :meth:`params`, the settings
        above and the trained drafter's kind, draft vocabulary and feature layers, as ``drafter/<name>``.

    Files, under the run's own directory (:func:`~tlt_lightning.tracking.run_dir`: for
    ``tlt-lightning fit`` ``<default_root_dir>/<experiment id>/<run id>/``, beside Lightning's
    ``checkpoints/``), rank 0: ``drafter/checkpoints/step-XXXXXXXX/``, ``drafter/timeline/*.png``,
    ``drafter/summary.json`` and ``drafter/accept_length.png`` (also MLflow artifacts).

    Attributes:
        drafter: the trained drafter (after fit also ``module.drafter``); ``optimizer``,
            ``buffer``, ``coordinator``, ``publisher``, ``checkpointer``: the objects it drives;
            ``spot_trainer``: the :class:`~tlt_lightning.drafter.SpotTrainer` of ``drafter``.
        steps, tail_steps, paid_steps, rl_steps: counters over all ranks (checkpointed).
        registered_steps: RL steps whose checkpoint is a registered-model version (checkpointed: a
            resumed fit does not register a step twice); ``registered_versions``: the
            ``ModelVersion`` objects this fit created.
        local_stats: this rank's share of the last RL step.
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
        SpotTrainerConfig(  # validates the drafter training's own arguments
            lr=lr, packing_budget=packing_budget, max_steps_per_rollout=max_steps_per_rollout,
            max_seconds_per_rollout=max_seconds_per_rollout, weight_decay=weight_decay,
            max_grad_norm=max_grad_norm, seed=seed,
        )
        num, pos_int = _is_number, _is_int
        for name, value, ok, allowed in (
            ("buffer_mb", buffer_mb, num(buffer_mb) and buffer_mb > 0, "a finite number > 0 (MiB)"),
            ("checkpoint_interval", checkpoint_interval,
             checkpoint_interval is None or (pos_int(checkpoint_interval) and checkpoint_interval >= 1),
             "an int >= 1 or None"),
            ("min_idle_s", min_idle_s, num(min_idle_s) and min_idle_s >= 0, "a finite number >= 0"),
            ("kind", kind, kind in DRAFTER_KINDS, f"one of {DRAFTER_KINDS}"),
            ("draft_vocab_size", draft_vocab_size,
             draft_vocab_size is None or (pos_int(draft_vocab_size) and draft_vocab_size >= 1),
             "an int >= 1 or None"),
            ("drafter_path", drafter_path,
             drafter_path is None or isinstance(drafter_path, (str, os.PathLike)),
             "a directory path, a models:/ or runs:/ URI, or None"),
            ("recency_decay", recency_decay, num(recency_decay) and 0 < recency_decay <= 1, "in (0, 1]"),
            ("registered_model_name", registered_model_name,
             registered_model_name is None or (isinstance(registered_model_name, str)
                                               and bool(registered_model_name.strip())),
             "a non-empty string or None"),
        ):
            _check(ok, name, value, allowed)
        self.lr, self.buffer_mb, self.packing_budget = float(lr), float(buffer_mb), packing_budget
        self.checkpoint_interval, self.min_idle_s = checkpoint_interval, float(min_idle_s)
        self.max_steps_per_rollout = max_steps_per_rollout
        self.max_seconds_per_rollout = max_seconds_per_rollout
        self.kind, self.draft_vocab_size, self.drafter_path = kind, draft_vocab_size, drafter_path
        self.recency_decay, self.weight_decay = float(recency_decay), float(weight_decay)
        self.max_grad_norm = max_grad_norm
        self.save_buffer, self.timeline, self.seed = bool(save_buffer), bool(timeline), seed
        self.registered_model_name = registered_model_name
        # Built at fit start (no I/O here; nothing unpicklable before ddp_spawn pickles the callback).
        self.spot_trainer: SpotTrainer | None = None
        self.drafter: Drafter | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.buffer: RolloutBuffer | None = None
        self.coordinator: WorkerCoordinator | None = None
        self.publisher: DrafterPublisher | None = None
        self.checkpointer: AsyncCheckpointer | None = None
        self.accept_length: MeanAcceptLength | None = None
        self._module: GRPOModule | None = None
        self._pending: dict[str, Any] | None = None
        self._lease: DrafterLease | None = None
        self._paid: deque[Segment] = deque(maxlen=100_000)  # paid-training spans, for the timeline
        self.local_stats: dict[str, float] = {}  # this rank's share of the last RL step (see _STATS)
        self._armed = self._added = False
        self.steps = self.tail_steps = self.paid_steps = self.rl_steps = 0
        self.paid_seconds = 0.0
        self.last_checkpoint: str | None = None
        self.run_dir: Path | None = None  # this run's own directory (tracking.run_dir), set at fit start
        self.last_metrics: dict[str, float] = {}  # what the last RL step logged
        self._saved_at = -1
        self._accepts: list[tuple[int, float]] = []  # (RL step, mean accept length) of this fit
        self._accept_hist = torch.zeros(0, dtype=torch.long)  # request-steps per tokens emitted
        self.registrar = CheckpointRegistrar(None)  # named at fit start: rank 0 with an MLFlowLogger
        self._resumed = False  # this fit restored a Lightning checkpoint's state
        self._finished = False  # the end-of-fit save / registration / summary ran in this fit

    @property
    def registered_steps(self) -> list[int]:
        return self.registrar.registered_steps

    @property
    def registered_versions(self) -> list[Any]:
        return self.registrar.versions

    # ------------------------------------------------------------------------------ fit start
    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not isinstance(pl_module, GRPOModule):
            raise TypeError(f"SpotDrafterCallback needs a GRPOModule, got {type(pl_module).__name__}")
        module, target = pl_module, pl_module.policy_target
        self._module = module
        drafter = self._initial_drafter(module)
        self._pending, pending = None, self._pending or {}
        self._resumed, self._finished = bool(pending), False
        saved_config = pending.get("drafter_config")
        if saved_config is not None and DrafterConfig.from_dict(saved_config) != drafter.config:
            # The checkpoint's drafter wins (e.g. resumed with other callback arguments).
            drafter = Drafter(DrafterConfig.from_dict(saved_config), target, dtype=torch.float32)
        self.buffer = RolloutBuffer(BufferConfig(max_mb=self.buffer_mb, decay=self.recency_decay))
        self.coordinator = WorkerCoordinator(CoordinatorConfig(min_idle_s=self.min_idle_s))
        config = SpotTrainerConfig(
            lr=self.lr, packing_budget=self.packing_budget, max_steps_per_rollout=self.max_steps_per_rollout,
            max_seconds_per_rollout=self.max_seconds_per_rollout, weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm, seed=self.seed,
        )
        self.spot_trainer = SpotTrainer(drafter, target, self.buffer, config, rank=self.coordinator.rank)
        self.drafter, self.optimizer = drafter, self.spot_trainer.optimizer
        self.run_dir = run_dir(trainer)  # on every rank: rank 0's directory, broadcast
        self.checkpointer = AsyncCheckpointer(self.run_dir / "drafter" / "checkpoints")
        registry = trainer.is_global_zero and bool(mlflow_loggers(trainer))
        self.registrar = CheckpointRegistrar(  # its registered_steps are restored by _apply
            (self.registered_model_name or drafter_model_name(str(module.hparams.model))) if registry else None,
            target_model=str(module.hparams.model),
        )
        self._apply(pending, publisher_too=False)
        self.publisher = DrafterPublisher(self.drafter, serving_target=module.rollout_target)
        self.publisher.load_state_dict(pending.get("publisher", {}))
        self.accept_length = MeanAcceptLength().to(module.device)
        layers = tuple(self.drafter.config.rollout_feature_layers)
        if module.rollout_feature_layers and tuple(module.rollout_feature_layers) != layers:
            warnings.warn(f"SpotDrafterCallback replaces module.rollout_feature_layers "
                          f"{tuple(module.rollout_feature_layers)} with the drafter's {layers}", stacklevel=2)
        module.rollout_feature_layers = layers
        self._wrap_rollout(module)
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
        if self.drafter is None:
            raise RuntimeError("SpotDrafterCallback.params() is known once fit has started (the drafter is built then)")
        config = self.drafter.config
        settings = {
            "lr": self.lr, "buffer_mb": self.buffer_mb, "packing_budget": self.packing_budget,
            "checkpoint_interval": self.checkpoint_interval, "min_idle_s": self.min_idle_s,
            "max_steps_per_rollout": self.max_steps_per_rollout,
            "max_seconds_per_rollout": self.max_seconds_per_rollout, "kind": self.kind,
            "draft_vocab_size": self.draft_vocab_size,
            "drafter_path": None if self.drafter_path is None else os.fspath(self.drafter_path),
            "recency_decay": self.recency_decay, "weight_decay": self.weight_decay,
            "max_grad_norm": self.max_grad_norm, "save_buffer": self.save_buffer, "timeline": self.timeline,
            "seed": self.seed, "registered_model_name": self.registrar.name or self.registered_model_name,
            "effective_kind": config.kind, "effective_draft_vocab": config.draft_vocab,
            "feature_layers": list(config.rollout_feature_layers),
            "trainable_parameters": self.drafter.num_trainable_parameters(),
        }
        return {f"drafter/{name}": value for name, value in settings.items()}

    def _initial_drafter(self, module: GRPOModule) -> Drafter:
        """The drafter to train: in fp32 (bf16 drafter training diverges) on the policy's own target.

        Rollouts draft with published copies on ``module.rollout_target`` in its dtype.
        """
        target = module.policy_target
        if module.drafter is not None:
            if self.drafter_path is not None:
                raise ValueError(
                    f"drafter_path={str(self.drafter_path)!r} given to SpotDrafterCallback, but the module "
                    "already has a drafter (GRPOModule speculative.drafter_kind / drafter_path): pass only one"
                )
            if module.drafter.dtype == torch.float32 and module.rollout_target is target:
                return module.drafter
            return module.drafter.for_target(target, dtype=torch.float32)
        if self.drafter_path is not None:
            if not is_mlflow_uri(self.drafter_path) and not Path(self.drafter_path).is_dir():
                raise ValueError(f"drafter_path {str(self.drafter_path)!r} is not a drafter directory "
                                 "(nor a models:/ or runs:/ URI)")
            return load_drafter(self.drafter_path, target, dtype=torch.float32)
        vocab = target.info.vocab_size
        size = None if self.draft_vocab_size is None else min(self.draft_vocab_size, vocab)
        with torch.random.fork_rng(devices=[]):  # identical initial weights on every rank
            torch.manual_seed(self.seed)
            return Drafter(DrafterConfig.from_target(target, self.kind, size), target, dtype=torch.float32)

    def _wrap_rollout(self, module: GRPOModule) -> None:
        """Wrap ``module.rollout``: mark the end of this rank's share and train in the others' tail."""
        original = module.rollout

        @functools.wraps(original)
        def rollout(prompts, generator=None) -> RolloutResult:
            if not self._armed:  # a rollout outside the training step (evaluation, a second call)
                return original(prompts, generator)
            self._armed = False
            coord, spot = self.coordinator, self.spot_trainer
            coord.rollout_started()
            result = original(prompts, generator)
            coord.share_done()  # first: the others' preemption signal must not wait for our bookkeeping
            self.buffer.add(result.rollouts, step=spot.policy_step)
            self._added = True
            if coord.distributed:
                before = spot.steps
                window = coord.maybe_train(spot.train_one, has_data=lambda: len(self.buffer) > 0)
                self._step_stats["tail_steps"] += spot.steps - before
                if window.latency_s is not None:
                    self._step_stats["latency_sum"] += window.latency_s
                    self._step_stats["latency_n"] += 1
            coord.wait_rollout_end()
            return result

        module.rollout = rollout  # an instance attribute: removed again at teardown

    # ------------------------------------------------------------------------------ the RL step
    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._lease = self.publisher.acquire()
        pl_module.drafter = self._lease.drafter  # this rollout's consistent, versioned copy
        self.spot_trainer.begin_step(trainer.global_step)  # fresh batches, drawn for this policy step
        self._armed, self._added = True, False
        self._step_stats = dict.fromkeys(_STATS, 0.0)
        self._coord_base = (self.coordinator.train_seconds, self.coordinator.idle_seconds)
        self._step_start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        spot, coord = self.spot_trainer, self.coordinator
        result: RolloutResult = outputs["rollout"] if isinstance(outputs, Mapping) else pl_module.last_rollout
        if not self._added:  # training_step did not go through module.rollout
            self.buffer.add(result.rollouts, step=spot.policy_step)
        self._armed = False
        stats, strategy = self._step_stats, trainer.strategy
        stats["step_s"] = time.perf_counter() - self._step_start
        if trainer.world_size > 1:
            tail = strategy.reduce(torch.tensor(stats["tail_steps"], dtype=torch.float64,
                                                device=pl_module.device), reduce_op="sum")
            tail = float(tail)
        else:
            tail = stats["tail_steps"]
        paid = spot.train_paid() if tail == 0 else None
        if paid is not None:
            stats["paid_steps"] += paid.steps
            stats["paid_s"] += paid.seconds
            self.paid_seconds += paid.seconds
            self._paid.append(Segment(coord.rank, WorkerState.TRAINING, paid.start, paid.start + paid.seconds))
        stats["loss"], stats["top1"] = spot.loss_sum, spot.top1_sum
        stats["tail_s"] = coord.train_seconds - self._coord_base[0]
        stats["idle_s"] = coord.idle_seconds - self._coord_base[1]
        stats["buffer_mb"], stats["buffer_tokens"] = self.buffer.size_mb, float(self.buffer.num_tokens)
        self.local_stats = dict(stats)
        local = torch.tensor([stats[k] for k in _STATS], dtype=torch.float64, device=pl_module.device)
        total = dict(zip(_STATS, strategy.reduce(local.clone(), reduce_op="sum").tolist()))
        steps_here = stats["tail_steps"] + stats["paid_steps"]
        steps_all = total["tail_steps"] + total["paid_steps"]
        if steps_all > 0:
            if trainer.world_size > 1:
                spot.average(lambda flat: strategy.reduce(flat, reduce_op="sum"), steps_here / steps_all)
            self.publisher.publish(self.drafter)
        self.steps += int(steps_all)
        self.tail_steps += int(total["tail_steps"])
        self.paid_steps += int(total["paid_steps"])
        self.rl_steps += 1
        self._log(pl_module, result, total, steps_all, trainer.world_size)
        self.registrar.register(trainer, self.checkpointer)  # what landed since the last step (never waits)
        if (
            trainer.is_global_zero
            and self.checkpoint_interval is not None
            and trainer.global_step % self.checkpoint_interval == 0
        ):
            self._save(trainer.global_step)

    def _log(self, module: GRPOModule, result: RolloutResult, total: dict[str, float], steps: float,
             world: int) -> None:
        # Every value is identical on all ranks (reduced above): no sync_dist, no extra collective.
        self.accept_length.update(result.stats)
        accept = float(self.accept_length.compute())
        self.accept_length.reset()
        self._accepts.append((self.rl_steps, accept))
        counts = torch.bincount(result.stats.accept_lengths.cpu().long(), minlength=self._accept_hist.numel())
        counts[: self._accept_hist.numel()] += self._accept_hist
        self._accept_hist = counts
        idle_pool = total["tail_s"] + total["idle_s"]
        metrics = {
            "drafter/version": float(self.publisher.version),
            "drafter/steps": steps,
            "drafter/tail_steps": total["tail_steps"],
            "drafter/paid_steps": total["paid_steps"],
            "drafter/train_seconds": total["tail_s"] + total["paid_s"],
            "drafter/paid_seconds": total["paid_s"],
            "drafter/idle_seconds": total["idle_s"],
            "drafter/idle_fraction_recovered": total["tail_s"] / idle_pool if idle_pool > 0 else 0.0,
            "drafter/overhead_fraction": total["paid_s"] / max(1e-9, total["step_s"]),
            "drafter/buffer_mb": total["buffer_mb"] / world,
            "drafter/buffer_tokens": total["buffer_tokens"] / world,
            "drafter/accept_length": accept,
        }
        if steps > 0:
            metrics["drafter/loss"] = total["loss"] / steps
            metrics["drafter/top1"] = total["top1"] / steps
        if total["latency_n"] > 0:
            metrics["drafter/preemption_latency_s"] = total["latency_sum"] / total["latency_n"]
        for name, value in metrics.items():
            module.log(name, value, on_step=True, on_epoch=False, prog_bar=name == "drafter/top1")
        self.last_metrics = metrics

    # ------------------------------------------------------------------------------ checkpoints
    def _save(self, rl_step: int) -> None:
        if self._saved_at == rl_step:
            return
        extra = {"rl_step": rl_step, "drafter_steps": self.steps, "version": self.publisher.version}
        requested = time.time()
        self.checkpointer.save(self.drafter, self.optimizer, rl_step, extra)  # returns at once
        self._saved_at = rl_step
        self.last_checkpoint = str(self.checkpointer.directory / f"step-{rl_step:08d}")
        self.registrar.request(rl_step, requested, self.last_checkpoint)

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None or self.drafter is None:  # loaded, not applied yet
            return dict(self._pending or {})
        return {
            "format": 1,
            **self.spot_trainer.state_dict(),  # drafter_config, drafter, optimizer
            "buffer": self.buffer.state_dict(include_data=self.save_buffer),
            "coordinator": self.coordinator.state_dict(),
            "publisher": self.publisher.state_dict(),
            "checkpointer": self.checkpointer.state_dict(),
            "counters": {"steps": self.steps, "tail_steps": self.tail_steps, "paid_steps": self.paid_steps,
                         "rl_steps": self.rl_steps, "paid_seconds": self.paid_seconds},
            "last_checkpoint": self.last_checkpoint,
            "registered_steps": list(self.registered_steps),
            "registrar": self.registrar.state_dict(),  # also the saves not registered yet
        }

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
            self._apply(state_dict, publisher_too=True)

    def _apply(self, state: Mapping[str, Any], publisher_too: bool) -> None:
        self.spot_trainer.load_state_dict(state)  # drafter weights, optimizer
        if "buffer" in state:
            self.buffer.load_state_dict(state["buffer"])
        if "coordinator" in state:
            self.coordinator.load_state_dict(state["coordinator"])
        if "checkpointer" in state:
            self.checkpointer.load_state_dict(state["checkpointer"])
        if publisher_too and "publisher" in state:
            self.publisher.load_state_dict(state["publisher"])
            self.publisher.publish(self.drafter)
        counters = state.get("counters", {})
        for key in ("steps", "tail_steps", "paid_steps", "rl_steps"):
            setattr(self, key, int(counters.get(key, getattr(self, key))))
        self.paid_seconds = float(counters.get("paid_seconds", self.paid_seconds))
        self.last_checkpoint = state.get("last_checkpoint", self.last_checkpoint)
        self.registrar.load_state_dict(state.get("registrar", {}))
        if "registrar" not in state:  # a checkpoint from before the registrar had its own state
            steps = state.get("registered_steps", self.registered_steps)
            self.registrar.registered_steps = [int(s) for s in steps]

    # ------------------------------------------------------------------------------ timeline / end
    def _gather(self, since: float | None) -> tuple[list[Segment], list[Segment]]:
        """Every worker's coordinator segments and paid-training spans since ``since`` (a collective)."""
        coord = self.coordinator
        mine = (coord.timeline(since), [s for s in self._paid if since is None or s.end > since])
        if not coord.distributed:
            return mine
        everyone: list[Any] = [None] * coord.world_size
        dist.all_gather_object(everyone, tuple([tuple(s) for s in part] for part in mine))
        coord_segments, paid = (
            [Segment(w, WorkerState(st), a, b) for rank in everyone for (w, st, a, b) in rank[i]]
            for i in (0, 1)
        )
        return coord_segments, paid

    def _plot(self, trainer: L.Trainer, since: float | None, name: str, label: str) -> float:
        """Save (rank 0) the Gantt chart; returns the idle fraction recovered over the span."""
        segments, paid = self._gather(since)
        recovered = idle_fraction_recovered(segments)  # the coordinator's TRAINING is idle time only
        if trainer.is_global_zero and segments:
            # Paid training is drawn as TRAINING where the coordinator saw the worker BUSY.
            shown = [piece for s in segments for piece in _without(s, paid)] + paid
            per_worker = sum(s.end - s.start for s in paid) / max(1, len({s.worker for s in segments}))
            title = f"{label}: idle recovered {recovered:.0%}, paid training {per_worker:.1f} s/worker"
            path = plot_timeline(shown, self.run_dir / "drafter" / "timeline" / name, title)
            log_artifact(trainer, path, "drafter/timeline")
        return recovered

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.timeline:
            self._plot(trainer, self._epoch_start, f"epoch-{trainer.current_epoch:03d}.png",
                       f"epoch {trainer.current_epoch}")
        self._epoch_start = time.time()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A resumed fit: the drafter saved at the step it resumes from may not have landed, or not
        # been registered, before the first fit stopped. The restored drafter is that very drafter
        # (weights, optimizer, counters): save it again, registered like any other save.
        step = trainer.global_step
        last = self.last_checkpoint
        saved_there = last is not None and Path(last).name == f"step-{step:08d}"
        if (
            self._resumed and trainer.is_global_zero and step not in self.registered_steps
            and (saved_there or step in self.registrar.pending_steps)
        ):
            self._save(step)

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
        if trainer.is_global_zero:
            self._save(trainer.global_step)
            self.checkpointer.wait()
            self.registrar.register(trainer, self.checkpointer)
            summary = {"drafter_steps": self.steps, "tail_steps": self.tail_steps,
                       "paid_steps": self.paid_steps, "paid_seconds_rank0": self.paid_seconds,
                       "idle_fraction_recovered": recovered, "rl_steps": self.rl_steps,
                       "version": self.publisher.version, "checkpoint": self.last_checkpoint,
                       "run_dir": str(self.run_dir), "rank0": self.coordinator.stats()}
            path = self.run_dir / "drafter" / "summary.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(summary, indent=2) + "\n")
            log_artifact(trainer, path, "drafter")
            if self._accepts:
                steps, means = zip(*self._accepts)
                figure = plot_accept_lengths(steps, means, self._accept_hist.tolist(),
                                             path.parent / "accept_length.png")
                log_artifact(trainer, figure, "drafter")

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._module is None:
            return
        vars(self._module).pop("rollout", None)
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        self._module.drafter = self.drafter  # the trained weights, e.g. for export after fit
        if self.checkpointer is not None:
            self.checkpointer.wait()
        self._module = None
