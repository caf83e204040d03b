"""Opening an MLflow tracking store when several fits may start at the same time.

A fresh sqlite store is created by the first client that opens it: MLflow creates its tables and
runs its schema migrations without a lock, so two fits opening one new ``mlflow.db`` at once race
(``table registered_models already exists``, ``duplicate column name``), and two fits creating one
experiment race too (a unique-name violation). :func:`prepare_store` does both under an exclusive
file lock beside the database (``mlflow.db.lock``); the loser of the race waits, then finds the
tables and the experiment in place.

A failure is raised as :class:`TrackingStoreError`, naming the store and what failed, so that a
caller (``tlt-lightning fit``) can report it as a store problem and not as a config problem.

MLflow is imported inside the functions: this module imports without it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from tlt_lightning.validation import UserError

__all__ = ["TrackingStoreError", "prepare_store", "sqlite_path"]


class TrackingStoreError(RuntimeError, UserError):
    """The MLflow tracking store could not be opened or prepared (not a config error)."""


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///PATH`` URI (relative to the working directory), else ``None``."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix) or tracking_uri[len(prefix) :] in ("", ":memory:"):
        return None
    return Path(tracking_uri[len(prefix) :])


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``lock_path`` (created), across processes and threads."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock (concurrent first use may race, as without this module)
        yield
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def prepare_store(
    tracking_uri: str, experiment_name: str | None = None, artifact_location: str | None = None
) -> str | None:
    """Create the store of ``tracking_uri`` (its tables) and the experiment, safely under concurrency.

    For a ``sqlite:///`` URI: creates the database's directory, then under an exclusive lock on
    ``<database>.lock`` opens the tracking and model-registry stores (creating and migrating the
    schema on first use) and creates ``experiment_name`` if it does not exist. Other URIs are left
    to MLflow (a server serialises its own writes).

    Args:
        tracking_uri: the MLflow tracking URI.
        experiment_name: the experiment to make sure exists (``None``: only the store).
        artifact_location: where a *new* experiment stores its artifacts (``None``: MLflow's default).

    Returns:
        The experiment's id (``None`` without ``experiment_name`` or for a non-sqlite URI).

    Raises:
        TrackingStoreError: the store could not be opened, migrated or written; the message names
            the URI and the underlying error.

    Example:
        >>> # prepare_store("sqlite:///runs/mlflow.db", "tlt-lightning")   # then MLFlowLogger(...)
    """
    database = sqlite_path(tracking_uri)
    if database is None:
        return None
    if database.is_dir():  # MLflow would retry opening it for minutes
        raise TrackingStoreError(
            f"MLflow tracking store {tracking_uri!r} is a folder, not a database file: "
            f"name a file in it, e.g. sqlite:///{database / 'mlflow.db'}"
        )
    step = "creating its directory"
    try:
        database.parent.mkdir(parents=True, exist_ok=True)  # sqlite creates the file, not its directory
        step = "locking it"
        with _exclusive(database.with_name(database.name + ".lock")):
            step = "importing mlflow"
            import mlflow

            step = "opening the tracking store"
            client = mlflow.MlflowClient(tracking_uri=tracking_uri)
            step = "opening the model registry"
            client.search_registered_models(max_results=1)
            if experiment_name is None:
                return None
            step = f"creating experiment {experiment_name!r}"
            experiment = client.get_experiment_by_name(experiment_name)
            if experiment is not None:
                return experiment.experiment_id
            return client.create_experiment(experiment_name, artifact_location=artifact_location)
    except Exception as err:
        raise TrackingStoreError(
            f"MLflow tracking store {tracking_uri!r} could not be opened ({step}): "
            f"{type(err).__name__}: {err}"
        ) from err
