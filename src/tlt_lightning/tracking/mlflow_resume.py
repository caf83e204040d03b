"""Resuming a fit into the MLflow run it started, not a new one.

* :class:`MLflowRunCheckpoint` writes the trainer's MLflow run (run id, experiment id, tracking
  URI) into every Lightning checkpoint, under the key ``"mlflow_run"``.
* :func:`mlflow_run_in_checkpoint` reads it back from a checkpoint file, before anything is built;
  :func:`resumable_run_id` checks that the run is in the store the resumed fit logs to
  (``tlt-lightning fit --ckpt_path`` passes it to :func:`~tlt_lightning.tracking.tracking_logger`).
* :class:`ResumableMLFlowLogger` continues that run: marked ``RUNNING`` again when opened (Lightning
  marks it ``FINISHED`` at the end of the resumed fit; a run that nothing ended, its process killed by
  SIGKILL, is marked ``KILLED`` first; the status it had is the tag ``resumed_from_status``),
  parameters already logged are not logged again, and a parameter the resumed fit changes (MLflow
  forbids changing one) is kept as the tag ``resumed.<name>``.

Nothing here imports MLflow at import time.

Example:
    >>> # run = mlflow_run_in_checkpoint("runs/fit/1/<run id>/checkpoints/last.ckpt")
    >>> # logger = ResumableMLFlowLogger(tracking_uri=run["tracking_uri"], run_id=run["run_id"])
    >>> # Trainer(logger=logger, callbacks=[MLflowRunCheckpoint(), ...]).fit(module, ckpt_path=...)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from typing_extensions import override

from tlt_lightning.safe_load import load_torch_file
from tlt_lightning.tracking.lightning_mlflow import mlflow_loggers
from tlt_lightning.tracking.mlflow_store import sqlite_path

__all__ = [
    "LIGHTNING_CKPT_NAMES",
    "MLFLOW_RUN_KEY",
    "MLflowRunCheckpoint",
    "ResumableMLFlowLogger",
    "canonical_tracking_uri",
    "mlflow_run_in_checkpoint",
    "resumable_run_id",
]

log = logging.getLogger(__name__)

MLFLOW_RUN_KEY = "mlflow_run"

LIGHTNING_CKPT_NAMES = frozenset({"last", "best", "hpc", "registry"})
"""``ckpt_path`` values Lightning resolves itself (not files, even where a file of that name exists)."""


def canonical_tracking_uri(tracking_uri: str) -> str:
    """``tracking_uri`` with a sqlite database path made absolute (relative ones depend on the cwd)."""
    database = sqlite_path(tracking_uri)
    return tracking_uri if database is None else f"sqlite:///{database.resolve()}"


class MLflowRunCheckpoint(L.Callback):
    """Writes the trainer's MLflow run into every Lightning checkpoint (``checkpoint["mlflow_run"]``).

    ``{"run_id", "experiment_id", "tracking_uri"}`` of the first ``MLFlowLogger`` (nothing without
    one), so that ``fit --ckpt_path`` can continue the same run. ``tlt-lightning fit`` adds it.
    """

    @override
    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        loggers = mlflow_loggers(trainer)
        if not loggers or not trainer.is_global_zero:  # rank 0 writes the checkpoint file
            return
        logger = loggers[0]
        checkpoint[MLFLOW_RUN_KEY] = {
            "run_id": logger.run_id,
            "experiment_id": logger.experiment_id,
            "tracking_uri": canonical_tracking_uri(logger._tracking_uri),
        }


def mlflow_run_in_checkpoint(path: str | os.PathLike) -> dict[str, str] | None:
    """The MLflow run a Lightning checkpoint was saved from (see :class:`MLflowRunCheckpoint`).

    Reads only the checkpoint's metadata (tensors are memory-mapped, not read), and no pickled
    objects (see :func:`~tlt_lightning.safe_load.load_torch_file`).

    Returns:
        ``{"run_id", "experiment_id", "tracking_uri"}``, or ``None`` when the checkpoint names no
        run (saved without MLflow, or before runs were recorded).

    Raises:
        ValueError: the file holds pickled objects (refused unless trusted), or is not a torch file.
    """
    checkpoint = load_torch_file(path, "a Lightning checkpoint", mmap=True)
    run = checkpoint.get(MLFLOW_RUN_KEY) if isinstance(checkpoint, dict) else None
    if not isinstance(run, dict) or not run.get("run_id"):
        return None
    return {key: str(run[key]) for key in ("run_id", "experiment_id", "tracking_uri") if key in run}


def resumable_run_id(ckpt_path: str | os.PathLike, tracking_uri: str) -> str | None:
    """The MLflow run that ``ckpt_path`` was saved from, if a fit logging to ``tracking_uri`` can continue it.

    ``None`` (with a warning saying why: a new run starts) when the checkpoint names no run, names
    a run of another store, or a run the store does not have. ``ckpt_path`` values that are not
    files (Lightning's ``"last"``, ``"hpc"``: :data:`LIGHTNING_CKPT_NAMES`) give ``None`` silently.
    """
    if str(ckpt_path) in LIGHTNING_CKPT_NAMES or not Path(ckpt_path).is_file():
        return None
    run = mlflow_run_in_checkpoint(ckpt_path)
    if run is None:
        log.warning(
            "%s names no MLflow run (saved without MLflow or by an older version): a new run starts",
            ckpt_path,
        )
        return None
    here = canonical_tracking_uri(tracking_uri)
    if run.get("tracking_uri") != here:
        log.warning(
            "%s was saved from MLflow run %s in the store %s, not %s: a new run starts",
            ckpt_path,
            run["run_id"],
            run.get("tracking_uri"),
            here,
        )
        return None
    import mlflow

    try:
        mlflow.MlflowClient(tracking_uri=tracking_uri).get_run(run["run_id"])
    except mlflow.exceptions.MlflowException as err:
        log.warning(
            "MLflow run %s of %s is not in %s (%s): a new run starts",
            run["run_id"],
            ckpt_path,
            tracking_uri,
            err,
        )
        return None
    rank_zero_info(f"Resuming MLflow run {run['run_id']} from {ckpt_path}")
    return run["run_id"]


class ResumableMLFlowLogger(MLFlowLogger):
    """Lightning's ``MLFlowLogger`` that continues the run ``run_id`` when given one.

    Without ``run_id`` it is exactly an ``MLFlowLogger`` (a new run). With one: the run is marked
    ``RUNNING`` when opened (``KILLED`` first if it was left ``RUNNING``; the tag ``resumed_from_status``
    says what it was), parameters it already holds with the same value are skipped, and a
    changed value is set as the tag ``resumed.<name>`` (with a warning) instead of failing the fit.

    Args: those of :class:`~lightning.pytorch.loggers.MLFlowLogger`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resumed = self._run_id is not None

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        opening = not self._initialized
        client = super().experiment
        if opening and self.resumed:
            status = client.get_run(self._run_id).info.status
            if status == "RUNNING":  # no process ended it: killed without a chance to (SIGKILL, power loss)
                log.warning("MLflow run %s was left RUNNING by a killed fit: marked KILLED", self._run_id)
                client.set_terminated(self._run_id, "KILLED")
                status = "KILLED"
            client.set_tag(self._run_id, "resumed_from_status", status)
            client.update_run(self._run_id, status="RUNNING")  # Lightning sets FINISHED / FAILED at the end
        return client

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        if not self.resumed:
            super().log_hyperparams(params)
            return
        flat = _flatten_dict(_convert_params(params))
        logged = self.experiment.get_run(self.run_id).data.params
        # MLflow keeps a parameter's first value (truncated to 250 characters, as Lightning logs it).
        new = {k: v for k, v in flat.items() if k not in logged}
        changed = {k: str(v)[:250] for k, v in flat.items() if k in logged and logged[k] != str(v)[:250]}
        if new:
            super().log_hyperparams(new)
        for key, value in changed.items():
            self.experiment.set_tag(self.run_id, f"resumed.{key}", value)
        if changed:
            log.warning(
                "resumed MLflow run %s with changed parameters %s: MLflow keeps the first values, the new "
                "ones are the run's tags resumed.<name>",
                self.run_id,
                sorted(changed),
            )
