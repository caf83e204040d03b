"""The logger of ``tlt-lightning fit``: an MLflow run in a local sqlite store, or CSV without MLflow.

:func:`tracking_logger` is a factory that a config names as ``trainer.logger`` (``class_path:
tlt_lightning.tracking.tracking_logger``), so one config runs with and without the ``mlflow`` extra.
:func:`prepare_logger_store` creates the store and experiment a logger will open, under a file lock
(:func:`~tlt_lightning.tracking.mlflow_store.prepare_store`), before the logger is built.

MLflow is not imported here: :func:`mlflow_available` finds it without importing it.

Example:
    >>> from tlt_lightning.tracking import tracking_logger
    >>> logger = tracking_logger("sqlite:////tmp/mlflow.db", run_name="try-1")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import time
from typing import Any

from lightning.pytorch.loggers import CSVLogger, Logger

from tlt_lightning.drafter.mlflow_uri import DEFAULT_TRACKING_URI
from tlt_lightning.tracking.mlflow_resume import ResumableMLFlowLogger
from tlt_lightning.tracking.mlflow_store import prepare_store, sqlite_path

__all__ = [
    "DEFAULT_EXPERIMENT",
    "default_artifact_location",
    "is_tracking_logger",
    "mlflow_available",
    "prepare_logger_store",
    "tracking_logger",
]

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "tlt-lightning"
"""The MLflow experiment (the CSV logger's ``name``) of :func:`tracking_logger` with no arguments."""


def mlflow_available(tracking_uri: str = DEFAULT_TRACKING_URI) -> bool:
    """Whether MLflow can log to ``tracking_uri``: ``mlflow`` imports, and sqlite stores find SQLAlchemy.

    Found without importing them (``mlflow`` takes a second to import).
    """
    needed = ["mlflow"]
    if tracking_uri.startswith("sqlite:"):
        needed += ["sqlalchemy", "alembic"]  # the sqlite store's ORM and its schema migrations
    return all(importlib.util.find_spec(name) is not None for name in needed)


def default_artifact_location(tracking_uri: str, artifact_location: str | None) -> str | None:
    """``artifact_location``, or for a sqlite store ``mlartifacts/`` beside the database file."""
    database = sqlite_path(tracking_uri)
    if artifact_location is None and database is not None:
        return (database.parent / "mlartifacts").resolve().as_uri()
    return artifact_location


def prepare_logger_store(
    tracking_uri: str, experiment_name: str | None, artifact_location: str | None
) -> bool:
    """Create the store and experiment an MLflow logger will open, when MLflow can log there.

    Args:
        tracking_uri: the logger's tracking URI.
        experiment_name: its experiment (created when missing).
        artifact_location: where a new experiment stores artifacts; ``None``: the default of
            :func:`default_artifact_location`.

    Returns:
        Whether MLflow is available for ``tracking_uri`` (nothing is prepared when it is not).

    Raises:
        TrackingStoreError: the store cannot be opened or prepared.
    """
    if not mlflow_available(tracking_uri):
        return False
    prepare_store(tracking_uri, experiment_name, default_artifact_location(tracking_uri, artifact_location))
    return True


def tracking_logger(
    tracking_uri: str = DEFAULT_TRACKING_URI,
    experiment_name: str = DEFAULT_EXPERIMENT,
    run_name: str | None = None,
    tags: dict[str, Any] | None = None,
    artifact_location: str | None = None,
    fallback_dir: str = "runs/fit",
    run_id: str | None = None,
) -> Logger:
    """An :class:`~lightning.pytorch.loggers.MLFlowLogger`, or a ``CSVLogger`` where MLflow is missing.

    A factory, so that a config can name it as ``trainer.logger`` (``class_path:
    tlt_lightning.tracking.tracking_logger``) and the same config runs with and without the ``mlflow``
    extra. Metrics and the module's hyper-parameters reach either logger.

    Args:
        tracking_uri: MLflow tracking URI; default a local sqlite store, ``runs/mlflow.db`` (MLflow 3
            keeps its ``./mlruns`` file store in maintenance mode). Any URI MLflow accepts works
            (``http://host:5000``, ``databricks``, ...).
        experiment_name: MLflow experiment (created on first use); the CSV logger's ``name``.
        run_name: MLflow run name; ``None``: ``fit-<local time>`` (MLflow's random names repeat
            from run to run once ``seed_everything`` has seeded Python's ``random``).
        tags: MLflow run tags.
        artifact_location: where a *new* experiment stores artifacts; ``None``: for a sqlite store,
            ``mlartifacts/`` beside the database file, else MLflow's default.
        fallback_dir: the CSV logger's directory when MLflow is not available.
        run_id: continue this MLflow run instead of starting one
            (:class:`~tlt_lightning.tracking.ResumableMLFlowLogger`); ``fit --ckpt_path`` sets it
            to the run the checkpoint was saved from.

    Example:
        >>> logger = tracking_logger("sqlite:////tmp/mlflow.db", run_name="try-1")  # doctest: +SKIP
        >>> Trainer(logger=logger, max_steps=2).fit(module)  # doctest: +SKIP
    """
    if not mlflow_available(tracking_uri):
        log.warning(
            "MLflow is not installed (pip install 'tlt-lightning[mlflow]'): logging to CSV under %s instead",
            fallback_dir,
        )
        return CSVLogger(fallback_dir, name=experiment_name)
    if run_name is None:
        run_name = time.strftime("fit-%Y%m%d-%H%M%S")
    artifact_location = default_artifact_location(tracking_uri, artifact_location)
    # A fresh sqlite store, or a new experiment, is created under a file lock: fits started at once
    # would otherwise race on MLflow's table creation and schema migrations.
    prepare_store(tracking_uri, experiment_name, artifact_location)
    return ResumableMLFlowLogger(
        experiment_name=experiment_name,
        run_name=run_name,
        tracking_uri=tracking_uri,
        tags=tags,
        artifact_location=artifact_location,
        run_id=run_id,
    )


def is_tracking_logger(path: Any) -> bool:
    """Whether the dotted ``path`` (a config's ``class_path`` or ``_component_``) names
    :func:`tracking_logger`.

    Compared by the object it imports, so ``tlt_lightning.tracking.tracking_logger`` and
    ``tlt_lightning.tracking.logger.tracking_logger`` both count; a path that does not import is not it.
    """
    if not isinstance(path, str) or "." not in path:
        return False
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None) is tracking_logger
    except ImportError:
        return False
