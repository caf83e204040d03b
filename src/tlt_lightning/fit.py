"""``tlt-lightning fit``: GRPO training from a YAML config, through Lightning's ``LightningCLI``.

    tlt-lightning --threads 1 fit --config configs/grpo_smollm2.yaml
    tlt-lightning fit --config configs/grpo_smollm2.yaml --model.optim.lr=3e-5 --trainer.max_steps=30
    tlt-lightning fit --config configs/grpo_smollm2.yaml --print_config     # the resolved config

The module is :class:`~tlt_lightning.rl.GRPOModule`: its constructor arguments are the ``model:``
section (``--model.x=...``), Lightning's ``Trainer`` arguments the ``trainer:`` section
(``--trainer.x=...``). jsonargparse checks both against the signatures, so a misspelt key stops
the run before anything loads, naming the key. ``--ckpt_path`` resumes a run; module settings that
differ from the checkpoint's are refused, listed as ``old -> new``, unless ``--resume_overrides``
says to apply them (``apply``) or to keep the checkpoint's (``checkpoint``); see :mod:`tlt_lightning.resume`.

Tracking goes through :func:`~tlt_lightning.tracking.tracking_logger`, a logger factory the configs name as
``trainer.logger``: an MLflow run in a local sqlite store by default (any tracking URI with
``--trainer.logger.init_args.tracking_uri=...``), or a CSV logger with a one-line warning where
MLflow is not installed. Lightning's own ``--trainer.logger=MLFlowLogger`` without a ``tracking_uri``
logs to the same sqlite store (Lightning's default, the ``./mlruns`` file store, is refused by MLflow 3).
Everything a run writes goes to its own directory, ``<default_root_dir>/<experiment id>/<run id>/``
with MLflow (:func:`~tlt_lightning.tracking.run_dir`): Lightning's ``checkpoints/``, the resolved
``config.yaml`` (also the run's artifact), the callbacks' ``drafter/``, ``bandit/`` and ``drift/``
outputs.

Without a logger (``--trainer.logger=false``) the run's directory is ``<default_root_dir>/version_<N>/``,
checkpoints included, so that two fits never share a ``last.ckpt``.

``--ckpt_path PATH`` resumes a run: into the same MLflow run (every checkpoint names its run), which
is marked ``FINISHED`` when the resumed fit ends, with the resumed fit's config saved beside the
first as ``config-resume-<n>.yaml``. ``--ckpt_path=last`` resumes the newest ``last.ckpt`` under
``default_root_dir``, and refuses when there is none.

SIGTERM (a scheduler's preemption) or SIGINT (Ctrl+C) stops the fit at the end of the current step
(:class:`~tlt_lightning.callbacks.CheckpointOnSignal`): ``last.ckpt`` is saved, the MLflow run is
marked ``KILLED``, one line says what was saved and how to resume, and the exit status is
``128 + signal`` (143 for SIGTERM, 130 for SIGINT).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import warnings
from argparse import Action
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from tlt_lightning.callbacks import BanditCallback, SpotDrafterCallback
from tlt_lightning.callbacks.progress import GRPOProgressBar
from tlt_lightning.callbacks.signals import CheckpointOnSignal
from tlt_lightning.cli_options import Parser
from tlt_lightning.drafter.mlflow_uri import DEFAULT_TRACKING_URI
from tlt_lightning.efficiency import ActivationCheckpointingCallback, LayerwisePrecisionCallback
from tlt_lightning.models import training_precision
from tlt_lightning.resume import LIGHTNING_CKPT_NAMES, check_resume, checkpoint_weights_only, read_checkpoint
from tlt_lightning.rl.module import GRPOModule
from tlt_lightning.rl.tasks import reasoning_gym
from tlt_lightning.safe_load import refusing_pickled_objects
from tlt_lightning.tracking.logger import default_artifact_location, is_tracking_logger, prepare_logger_store
from tlt_lightning.tracking.mlflow_resume import MLflowRunCheckpoint, canonical_tracking_uri, resumable_run_id
from tlt_lightning.tracking.mlflow_store import TrackingStoreError
from tlt_lightning.tracking.run_directory import (
    CheckpointsInRunDir,
    latest_checkpoint,
    run_dir,
    save_run_config,
)
from tlt_lightning.validation import check

__all__ = ["GRPOCLI", "ConciseHelpFormatter", "FitParser", "SaveLastAtTrainEnd", "TrackingSaveConfig", "main"]

log = logging.getLogger(__name__)

# Where `fit --help` sends a user for the options it leaves out.
FIT_HELP_EPILOG = (
    "Every setting of the config's model: and trainer: sections is an option too, --model.KEY=VALUE and "
    "--trainer.KEY=VALUE (nested: --model.optim.lr=3e-5); `tlt-lightning fit --config CONFIG --print_config` "
    "prints them all with their values. They are GRPOModule's and lightning's Trainer's arguments, "
    "documented there."
)
# What compares its saved settings as the checkpoint loads (its `resume_overrides` says what to do).
_COMPARE_ON_LOAD = (
    GRPOModule,
    SpotDrafterCallback,
    BanditCallback,
    ActivationCheckpointingCallback,
    LayerwisePrecisionCallback,
)


class SaveLastAtTrainEnd(Callback):
    """Saves ``last.ckpt`` at the end of training when the last steps are in no checkpoint yet.

    Lightning's ``ModelCheckpoint(save_last=True)`` saves at the end of training only if it has saved
    nothing before: a fit whose ``max_steps`` is not a multiple of ``every_n_train_steps`` (16 steps,
    every 5) would end with ``last.ckpt`` at step 15, and ``fit --ckpt_path last.ckpt`` would train
    step 16 again. ``tlt-lightning fit`` adds this callback; it runs after the config's own callbacks
    (their state at the end of training, e.g. the final drafter save, is in the checkpoint).
    """

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for callback in trainer.checkpoint_callbacks:
            # _should_skip_saving_checkpoint: already saved at this step, or not fitting.
            due = isinstance(callback, ModelCheckpoint) and bool(callback.save_last)
            if due and not callback._should_skip_saving_checkpoint(trainer):
                callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


class TrackingSaveConfig(SaveConfigCallback):
    """Saves the resolved config beside the run and, with MLflow, as the run's ``config.yaml`` artifact.

    Beside the run: in :func:`~tlt_lightning.tracking.run_dir`, ``<default_root_dir>/<experiment
    id>/<run id>/`` for MLflow (where Lightning's ``ModelCheckpoint`` writes that run's checkpoints;
    an MLflow logger with a database store has no log directory of its own), else the logger's log
    directory. Construct with ``save_to_log_dir=False`` (Lightning's own saving needs a log directory).
    """

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        run_dir(trainer)  # on every rank (Lightning saves the config on rank 0 only)
        super().setup(trainer, pl_module, stage)

    # Trainer arguments that are objects (logged elsewhere or not parameters at all).
    _UNLOGGED_TRAINER_KEYS = frozenset({"callbacks", "logger", "plugins", "profiler", "strategy"})

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # A resumed run (the same MLflow run, fit --ckpt_path) keeps its first config: the resumed
        # fit's goes beside it as config-resume-<n>.yaml.
        save_run_config(trainer, self.parser.dump(self.config, skip_none=False), self.config_filename)
        if trainer.logger is not None:
            trainer.logger.log_hyperparams(self.extra_hyperparams(pl_module))

    def extra_hyperparams(self, pl_module: LightningModule) -> dict[str, Any]:
        """What the Trainer's own hyper-parameter logging misses: the prompt source, the trainer.

        Lightning logs the module's initial hyper-parameters (its groups as ``optim/lr``, ``task/name``,
        ...); the prompt source is not among them (a source may not serialise).
        """
        config = self.config.as_dict()
        trainer = {
            k: v
            for k, v in config.get("trainer", {}).items()
            if k not in self._UNLOGGED_TRAINER_KEYS and v is not None
        }
        params: dict[str, Any] = {
            "trainer": trainer,
            "seed_everything": config.get("seed_everything"),
            "threads": config.get("threads"),
        }
        source = config.get("model", {}).get("prompt_source")
        if source is not None:
            params["prompt_source"] = source
        return params


def _mlflow_logger_args(config: Any) -> list[Any]:
    """The ``init_args`` of every ``trainer.logger`` entry that is an ``MLFlowLogger`` class (Lightning's
    or a subclass), not the :func:`~tlt_lightning.tracking.tracking_logger` factory."""
    loggers = config.get("trainer", {}).get("logger")
    found = []
    for entry in loggers if isinstance(loggers, list) else [loggers]:
        class_path = getattr(entry, "class_path", None)
        if not isinstance(class_path, str) or "." not in class_path:
            continue
        module, _, name = class_path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # jsonargparse reports it when it instantiates the entry
            continue
        if isinstance(cls, type) and issubclass(cls, MLFlowLogger):
            found.append(entry.init_args)
    return found


def _default_mlflow_store(config: Any) -> None:
    """Point an ``MLFlowLogger`` given without ``tracking_uri`` at the store of
    :func:`~tlt_lightning.tracking.tracking_logger`.

    Lightning's own default is ``$MLFLOW_TRACKING_URI`` read when Lightning is imported, else the
    ``./mlruns`` file store, which MLflow 3 keeps in maintenance mode and refuses to open. So
    ``--trainer.logger=MLFlowLogger`` logs to ``DEFAULT_TRACKING_URI`` (made absolute; artifacts in
    ``mlartifacts/`` beside it), like the configs' factory; a ``tracking_uri`` given, or the environment
    variable, is kept.
    """
    for args in _mlflow_logger_args(config):
        if args.get("tracking_uri"):
            continue
        # Absolute: MLflow caches a store per URI string, and a relative one depends on the cwd.
        args.tracking_uri = canonical_tracking_uri(DEFAULT_TRACKING_URI)
        args.artifact_location = default_artifact_location(args.tracking_uri, args.get("artifact_location"))
        # Without MLflow nothing is prepared: Lightning says MLflow is missing when it builds the logger.
        prepare_logger_store(args.tracking_uri, args.get("experiment_name"), args.artifact_location)


def _tracking_logger_args(config: Any) -> Any:
    """The ``init_args`` of a ``trainer.logger`` that is :func:`~tlt_lightning.tracking.tracking_logger`,
    else ``None``."""
    logger = config.get("trainer", {}).get("logger")
    if is_tracking_logger(getattr(logger, "class_path", None)):
        return logger.init_args
    return None


class ConciseHelpFormatter(DefaultHelpFormatter):
    """``--help`` with the top-level options only: ``--model.*`` and ``--trainer.*`` (hundreds of lines,
    the module's and the Trainer's signatures) are left to ``--print_config``."""

    @staticmethod
    def _top_level(actions: Iterable[Action]) -> list[Action]:
        return [a for a in actions if "." not in a.dest]

    def add_usage(self, usage: Any, actions: Iterable[Action], *args: Any, **kwargs: Any) -> None:
        super().add_usage(usage, self._top_level(actions), *args, **kwargs)

    def add_arguments(self, actions: Iterable[Action]) -> None:
        super().add_arguments(self._top_level(actions))


class FitParser(Parser, LightningArgumentParser):
    """LightningCLI's parser under the command line's rules (:class:`~tlt_lightning.cli_options.Parser`):
    options never abbreviated, errors of a few lines, and a concise ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", ConciseHelpFormatter)
        kwargs.setdefault("epilog", FIT_HELP_EPILOG)
        super().__init__(*args, **kwargs)


class GRPOCLI(LightningCLI):
    """``LightningCLI`` for :class:`~tlt_lightning.rl.GRPOModule`, with only the ``fit`` subcommand.

    Adds ``--threads`` (torch intra-op threads, set before anything is built), and defaults
    ``--trainer.precision`` to the one that pays here (:func:`~tlt_lightning.models.training_precision`:
    ``bf16-mixed`` where bf16 products are native, else ``32-true``). The optimizer is the
    module's own (AdamW with ``model.optim.lr``), so no ``--optimizer`` section is added.

    Example:
        >>> GRPOCLI(args=["fit", "--config", "configs/grpo_tiny.yaml"])  # doctest: +SKIP
    """

    def __init__(self, args: Sequence[str] | None = None, run: bool = True) -> None:
        super().__init__(
            GRPOModule,
            parser_class=FitParser,
            save_config_callback=TrackingSaveConfig,
            save_config_kwargs={"save_to_log_dir": False},
            # Every checkpoint names its MLflow run: `fit --ckpt_path` continues that run.
            # A last.ckpt of the final step, whatever every_n_train_steps is.
            # SIGTERM / SIGINT: last.ckpt at the end of the step (then exit 128 + signal, see fit).
            trainer_defaults={
                "callbacks": [
                    MLflowRunCheckpoint(),
                    SaveLastAtTrainEnd(),
                    CheckpointsInRunDir(),
                    CheckpointOnSignal(),
                ]
            },
            seed_everything_default=0,
            auto_configure_optimizers=False,
            parser_kwargs={"fit": {"prog": "tlt-lightning fit"}},
            args=None if args is None else list(args),
            run=run,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # GRPO has no validation or test loop: fit is the job. The set holds the Trainer.fit
        # arguments the CLI supplies itself (everything else, e.g. ckpt_path, becomes a flag).
        return {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"}}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--threads",
            type=int | None,
            default=None,
            help="torch intra-op threads (on shared 2-core machines 1 is often faster than 2)",
        )
        parser.add_argument(
            "--resume_overrides",
            type=Literal["refuse", "apply", "checkpoint"],
            default="refuse",
            help="with --ckpt_path, module settings that differ from the checkpoint's: 'refuse' (list them "
            "and stop), 'apply' them, or keep the 'checkpoint' values; a changed prompt source or callback "
            "setting is applied with 'apply', else refused",
        )
        # Unless a config or flag says otherwise, train in the precision that pays on this machine:
        # bf16 autocast where bf16 products are native (AMX / AVX512-BF16 CPUs, GPUs), else fp32.
        parser.set_defaults({"trainer.precision": training_precision()})

    def _parse_ckpt_path(self) -> None:
        """Check ``--ckpt_path`` and the module settings against the checkpoint's (Lightning's own
        version silently replaces the ``model:`` section by the checkpoint's hyper-parameters)."""
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        config = self.config[subcommand]
        config.weights_only = checkpoint_weights_only(config.get("weights_only"))
        ckpt_path = config.get("ckpt_path")
        if str(ckpt_path) == "last":  # Lightning looks in the new run's (empty) directory only
            root = config.get("trainer", {}).get("default_root_dir") or os.getcwd()
            config.ckpt_path = ckpt_path = str(latest_checkpoint(root))
            log.info("ckpt_path 'last': resuming from %s", ckpt_path)
        if not ckpt_path or str(ckpt_path) in LIGHTNING_CKPT_NAMES:
            return
        saved = read_checkpoint(ckpt_path).get("hyper_parameters") or {}
        mode = config.get("resume_overrides") or "refuse"
        conflicts = check_resume(ckpt_path, saved, config["model"].as_dict(), mode)
        if mode == "checkpoint":
            super()._parse_ckpt_path()  # Lightning's: the checkpoint's values replace the config's
        if conflicts:
            shown = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in sorted(conflicts.items()))
            kept = "kept the checkpoint's" if mode == "checkpoint" else "applied"
            log.warning("resuming from %s: %s changed module settings (%s)", ckpt_path, kept, shown)

    def before_fit(self) -> None:
        # The prompt source and the callbacks compare their settings as the checkpoint loads.
        mode = self.config[self.subcommand].get("resume_overrides") or "refuse"
        for obj in (self.model, *self.trainer.callbacks):
            if isinstance(obj, _COMPARE_ON_LOAD):
                obj.resume_overrides = mode

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config  # run=False: no subcommand
        threads = config.get("threads")
        if threads is not None:
            check(threads >= 1, "threads", threads, "an int >= 1")
            torch.set_num_threads(threads)
        if config.get("model") is not None and config.model.get("prompt_source") is None:
            reasoning_gym()  # the task's prompts: a missing `tasks` extra is named before anything loads
        _default_mlflow_store(config)
        self._default_progress_bar(config.get("trainer") or {})
        logger = _tracking_logger_args(config)
        # The store is prepared here, not inside the logger factory: jsonargparse would report a failure
        # while it instantiates the logger as a config that "does not validate against" the logger type.
        if logger is not None and prepare_logger_store(
            logger.tracking_uri, logger.experiment_name, logger.artifact_location
        ):
            if config.get("ckpt_path") and logger.get("run_id") is None:
                logger.run_id = resumable_run_id(str(config.ckpt_path), logger.tracking_uri)

    def fit(self, **kwargs: Any) -> None:
        """``Trainer.fit``; when SIGTERM or SIGINT stopped it (see
        :class:`~tlt_lightning.callbacks.CheckpointOnSignal`): the MLflow run marked ``KILLED``, one line
        on stderr, and ``SystemExit(128 + signal)``."""
        try:
            self.trainer.fit(**kwargs)
        except SIGTERMException as stopped:
            stops = (c for c in self.trainer.callbacks if isinstance(c, CheckpointOnSignal))
            raise SystemExit(next(stops, CheckpointOnSignal()).report(self.trainer)) from stopped

    def _default_progress_bar(self, trainer: Any) -> None:
        """:class:`~tlt_lightning.callbacks.GRPOProgressBar` is the trainer's default bar: none with
        ``--trainer.enable_progress_bar=false``, nor beside a progress bar the config lists."""
        paths = [c.class_path.rpartition(".") for c in trainer.get("callbacks") or [] if c.get("class_path")]
        listed = [getattr(importlib.import_module(module), name) for module, _, name in paths]
        bar = trainer.get("enable_progress_bar") is not False and not any(
            isinstance(c, type) and issubclass(c, ProgressBar) for c in listed
        )
        defaults = [c for c in self.trainer_defaults["callbacks"] if not isinstance(c, GRPOProgressBar)]
        self.trainer_defaults["callbacks"] = [*defaults, *([GRPOProgressBar()] if bar else [])]


def main(args: Sequence[str]) -> None:
    """Run ``tlt-lightning fit``; ``args`` start with ``"fit"``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may wait on a hub download
    # GRPO takes one optimizer step per rollout batch: a checkpoint holds the weights after that
    # step, which is what resuming needs. Lightning warns about it on every manual-optimization run.
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
    # Parsed as the command line (LightningCLI warns when given both `args` and a sys.argv). The program
    # stays the running script: Lightning's DDP launcher starts the other ranks as `python sys.argv[0] ...`.
    program = sys.argv[0] if sys.argv and Path(sys.argv[0]).name == "tlt-lightning" else "tlt-lightning"
    saved, sys.argv = sys.argv, [program, *args]
    try:
        with refusing_pickled_objects("the checkpoint --ckpt_path names"):
            GRPOCLI()
    except TrackingStoreError as err:  # the store, not the config: one line naming it and the cause
        raise SystemExit(f"tlt-lightning fit: {err}") from err
    finally:
        sys.argv = saved
