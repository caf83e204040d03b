"""Resuming into the same MLflow run: the run id in the checkpoint, the logger that continues the run."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.rl.test_module import make_module, make_trainer
from tlt_lightning.tracking import MLflowRunCheckpoint, ResumableMLFlowLogger
from tlt_lightning.tracking.mlflow_resume import (
    MLFLOW_RUN_KEY,
    canonical_tracking_uri,
    mlflow_run_in_checkpoint,
)

mlflow = pytest.importorskip("mlflow")


def test_every_checkpoint_names_its_run_and_reads_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = "sqlite:///store/mlflow.db"  # relative: recorded as an absolute path
    (tmp_path / "store").mkdir()
    logger = ResumableMLFlowLogger(experiment_name="x", tracking_uri=uri)
    trainer = make_trainer(1, logger=logger, callbacks=[MLflowRunCheckpoint()], default_root_dir=tmp_path)
    trainer.fit(make_module())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert mlflow_run_in_checkpoint(tmp_path / "a.ckpt") == {
        "run_id": logger.run_id,
        "experiment_id": logger.experiment_id,
        "tracking_uri": f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}",
    }
    assert canonical_tracking_uri("http://host:5000") == "http://host:5000"
    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")  # saved without the callback
    assert mlflow_run_in_checkpoint(tmp_path / "plain.ckpt") is None
    torch.save({MLFLOW_RUN_KEY: {"run_id": ""}}, tmp_path / "empty.ckpt")
    assert mlflow_run_in_checkpoint(tmp_path / "empty.ckpt") is None


def test_the_resumed_logger_reopens_the_run_and_keeps_its_first_parameters(tmp_path, caplog):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = ResumableMLFlowLogger(experiment_name="x", tracking_uri=uri)
    assert not first.resumed
    first.log_hyperparams({"lr": 0.1, "trainer": {"max_steps": 3}})
    first.finalize("failed")
    client, run_id = first.experiment, first.run_id
    assert client.get_run(run_id).info.status == "FAILED"

    resumed = ResumableMLFlowLogger(experiment_name="x", tracking_uri=uri, run_id=run_id)
    assert resumed.resumed and resumed.experiment_id == first.experiment_id
    assert client.get_run(run_id).info.status == "RUNNING"  # open again while the resumed fit runs
    with caplog.at_level(logging.WARNING, logger="tlt_lightning.tracking.mlflow_resume"):
        resumed.log_hyperparams({"lr": 0.1, "trainer": {"max_steps": 4}, "seed": 1})  # no MLflow error
    data = client.get_run(run_id).data
    assert data.params == {"lr": "0.1", "trainer/max_steps": "3", "seed": "1"}
    assert data.tags["resumed.trainer/max_steps"] == "4"
    assert "changed parameters ['trainer/max_steps']" in caplog.text
    resumed.finalize("success")
    assert client.get_run(run_id).info.status == "FINISHED"
    assert len(client.search_runs([first.experiment_id])) == 1


def test_a_run_left_running_by_a_killed_fit_is_marked_killed_when_resumed(tmp_path, caplog):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    killed = ResumableMLFlowLogger(experiment_name="x", tracking_uri=uri)
    client, run_id = killed.experiment, killed.run_id  # never finalized: what SIGKILL leaves
    assert client.get_run(run_id).info.status == "RUNNING"
    with caplog.at_level(logging.WARNING, logger="tlt_lightning.tracking.mlflow_resume"):
        resumed = ResumableMLFlowLogger(experiment_name="x", tracking_uri=uri, run_id=run_id)
        opened = resumed.experiment.get_run(run_id)
    assert f"MLflow run {run_id} was left RUNNING by a killed fit: marked KILLED" in caplog.text
    assert opened.info.status == "RUNNING" and opened.data.tags["resumed_from_status"] == "KILLED"
    resumed.finalize("failed")  # a crash: the next resume says so
    again = ResumableMLFlowLogger(experiment_name="x", tracking_uri=uri, run_id=run_id)
    assert again.experiment.get_run(run_id).data.tags["resumed_from_status"] == "FAILED"
