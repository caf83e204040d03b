"""prepare_store: concurrent first use of one fresh sqlite store, and store errors named as such."""

from __future__ import annotations

import multiprocessing

import pytest

from tests.helpers import run_at_once
from tlt_lightning.tracking import tracking_logger
from tlt_lightning.tracking.mlflow_store import TrackingStoreError, prepare_store, sqlite_path

mlflow = pytest.importorskip("mlflow")


def _first_use(uri: str, name: str, start, results) -> None:
    """One fit's first use of the store: the logger, a run, a metric, the model registry."""
    try:
        start.wait(60)
        logger = tracking_logger(uri, experiment_name="race", run_name=name)
        logger.log_metrics({"m": 1.0}, step=0)
        logger.experiment.search_registered_models()
        logger.finalize("success")
        results.put((name, logger.run_id, None))
    except Exception as err:  # noqa: BLE001 -- reported to the test
        results.put((name, None, f"{type(err).__name__}: {err}"))


def test_two_fits_creating_one_fresh_sqlite_store_at_once_both_succeed(tmp_path):
    uri = f"sqlite:///{tmp_path}/db/mlflow.db"
    # fork: the children start with mlflow already imported, and reach the store within milliseconds
    context = multiprocessing.get_context("fork")
    outcome = run_at_once(context, _first_use, [(uri, name) for name in ("a", "b")])
    assert [error for _, _, error in outcome] == [None, None]
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("race")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["a", "b"]
    assert {r.info.status for r in runs} == {"FINISHED"}


def test_prepare_store_creates_the_store_and_experiment_once(tmp_path):
    uri = f"sqlite:///{tmp_path}/nested/mlflow.db"
    first = prepare_store(uri, "x", artifact_location=(tmp_path / "art").as_uri())
    assert prepare_store(uri, "x") == first and prepare_store(uri) is None
    assert (tmp_path / "nested" / "mlflow.db").is_file()
    assert mlflow.MlflowClient(uri).get_experiment(first).artifact_location == (tmp_path / "art").as_uri()
    assert prepare_store("http://localhost:1", "x") is None  # a server: left to MLflow, nothing opened
    assert sqlite_path("sqlite:///:memory:") is None and sqlite_path("sqlite:///a/b.db").name == "b.db"


def test_a_store_that_cannot_be_opened_is_named_with_its_cause(tmp_path):
    (tmp_path / "not-sqlite.db").write_bytes(b"\x00garbage" * 512)
    uri = f"sqlite:///{tmp_path}/not-sqlite.db"
    with pytest.raises(
        TrackingStoreError,
        match=r"MLflow tracking store 'sqlite:///.*not-sqlite.db' could not "
        r"be opened \(opening the tracking store\): DatabaseError: .*"
        r"file is not a database",
    ):
        prepare_store(uri, "x")
