"""Lightning's ``MLFlowLogger`` as the callbacks use it: artifacts, and drafter checkpoints registered
as model versions once an asynchronous writer has put them on disk.

Nothing here imports MLflow: without an ``MLFlowLogger`` in the trainer every call is a no-op.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import MLFlowLogger

from tlt_lightning.spot.checkpoint_io import read_meta
from tlt_lightning.tracking.mlflow_drafter import log_drafter_version

__all__ = ["CheckpointRegistrar", "log_artifact", "mlflow_loggers"]


def mlflow_loggers(trainer: L.Trainer) -> list[MLFlowLogger]:
    """The trainer's ``MLFlowLogger`` s (none: MLflow is not in use)."""
    return [logger for logger in trainer.loggers if isinstance(logger, MLFlowLogger)]


def log_artifact(trainer: L.Trainer, path: str | os.PathLike, artifact_path: str | None = None) -> bool:
    """Log a file (or a directory's files) to every :class:`MLFlowLogger` of ``trainer`` (rank 0).

    Returns:
        Whether some logger took it (other loggers have no artifact store: the file stays on disk).
    """
    if not trainer.is_global_zero:
        return False
    for logger in mlflow_loggers(trainer):
        client, run_id = logger.experiment, logger.run_id
        if Path(path).is_dir():
            client.log_artifacts(run_id, str(path), artifact_path)
        else:
            client.log_artifact(run_id, str(path), artifact_path)
    return bool(mlflow_loggers(trainer))


def _written_since(checkpoint: Path, requested: float) -> bool:
    """Whether ``checkpoint`` is complete and was saved no earlier than ``requested`` (not a stale one)."""
    meta = read_meta(checkpoint)
    return meta is not None and float(meta.get("time", 0.0)) >= requested


class CheckpointRegistrar:
    """Registers drafter checkpoints of an :class:`~tlt_lightning.spot.AsyncCheckpointer` as versions
    of the registered model ``name``, in step order, once they are on disk (rank 0).

    :meth:`register` acts only while the writer is idle: every requested save has then landed or
    been superseded by a newer one, and no write can delete a checkpoint being logged. A
    checkpoint that is not on disk (superseded, or deleted beyond the checkpointer's ``keep``), a
    stale one left by an earlier fit (written before the save was requested), or one another writer
    replaced (not :meth:`~tlt_lightning.spot.AsyncCheckpointer.owns`) is skipped.

    Its :meth:`state_dict` holds the steps registered and those requested but not registered yet
    (a fit stopped before they landed): a resumed fit registers the latter, or saves them again.

    With ``name=None`` (not rank 0, or no ``MLFlowLogger``) it registers nothing but still carries
    ``registered_steps`` through checkpoints.

    Args:
        name: the registered model (``None``: register nothing).
        target_model: the target the drafter drafts for (registry name or HF directory), recorded in
            each version's ``MLmodel`` so that ``mlflow.pyfunc.load_model`` loads it.

    Attributes:
        registered_steps: RL steps already registered (restore it on resume: no step twice).
        versions: the ``ModelVersion`` objects this registrar created.
    """

    def __init__(self, name: str | None, target_model: str | None = None) -> None:
        self.name, self.target_model = name, target_model
        self.registered_steps: list[int] = []
        self.versions: list[Any] = []
        self._pending: list[tuple[int, float, str | None]] = []  # (RL step, time requested, checkpoint dir)

    @property
    def pending_steps(self) -> list[int]:
        """RL steps requested and not registered yet."""
        return sorted(step for step, _, _ in self._pending)

    def request(self, rl_step: int, requested: float, path: str | os.PathLike | None = None) -> None:
        """A save of ``rl_step`` into ``path`` was requested at ``requested`` (``time.time()``).

        ``path=None``: ``step-XXXXXXXX`` in the checkpointer's directory. A newer request for the
        same step replaces an older one.
        """
        if self.name is not None:
            entry = (rl_step, requested, None if path is None else str(path))
            self._pending = [p for p in self._pending if p[0] != rl_step] + [entry]

    def register(self, trainer: L.Trainer, checkpoints: Any) -> None:
        """Register what landed since the last call (``checkpoints``: the ``AsyncCheckpointer``)."""
        if not self._pending or checkpoints.in_flight:
            return
        pending, self._pending = sorted(self._pending), []
        for step, requested, where in pending:
            path = Path(where) if where is not None else checkpoints.directory / f"step-{step:08d}"
            if step in self.registered_steps or not _written_since(path, requested):
                continue
            if not checkpoints.owns(path):  # another writer replaced it: not this run's drafter
                continue
            for logger in mlflow_loggers(trainer):
                self.versions.append(
                    log_drafter_version(
                        logger.experiment,
                        logger.run_id,
                        path,
                        self.name,
                        step,
                        target_model=self.target_model,
                    )
                )
            self.registered_steps.append(step)

    def state_dict(self) -> dict[str, Any]:
        return {
            "registered_steps": list(self.registered_steps),
            "pending": [list(entry) for entry in sorted(self._pending)],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; missing keys keep their current values."""
        self.registered_steps = [int(s) for s in state.get("registered_steps", self.registered_steps)]
        if self.name is not None and "pending" in state:
            self._pending = [
                (int(step), float(requested), None if where is None else str(where))
                for step, requested, where in state["pending"]
            ]
