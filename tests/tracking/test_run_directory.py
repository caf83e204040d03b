"""run_dir: one versioned output directory per run, shared by every callback of that run."""

from __future__ import annotations

import importlib.util
import os
import threading
from types import SimpleNamespace

import pytest
from lightning.pytorch.loggers import CSVLogger

from tests.rl.test_module import make_trainer
from tlt_lightning.tracking import run_dir
from tlt_lightning.tracking.run_directory import latest_checkpoint


def test_without_a_logger_each_trainer_claims_a_fresh_version(tmp_path):
    first, second = make_trainer(1, default_root_dir=tmp_path), make_trainer(1, default_root_dir=tmp_path)
    assert run_dir(first) == tmp_path / "version_0" and run_dir(first).is_dir()
    assert run_dir(second) == tmp_path / "version_1"
    assert run_dir(first) == tmp_path / "version_0"  # resolved once per trainer
    (tmp_path / "version_7").mkdir()
    assert run_dir(make_trainer(1, default_root_dir=tmp_path)) == tmp_path / "version_8"  # above all taken


def test_runs_started_at_once_get_different_directories(tmp_path):
    trainers = [make_trainer(1, default_root_dir=tmp_path) for _ in range(8)]
    found, start = [], threading.Barrier(len(trainers))

    def resolve(trainer):
        start.wait(30)
        found.append(run_dir(trainer))

    threads = [threading.Thread(target=resolve, args=(t,)) for t in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(found) == sorted(tmp_path / f"version_{n}" for n in range(8))


def test_with_a_logger_it_is_where_lightning_puts_the_checkpoints(tmp_path):
    logger = CSVLogger(tmp_path / "csv", name="exp")
    trainer = make_trainer(1, logger=logger, default_root_dir=tmp_path / "root")
    assert run_dir(trainer) == tmp_path / "csv" / "exp" / "version_0" == type(tmp_path)(logger.log_dir)


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed")
def test_an_mlflow_run_on_a_database_store_gets_root_experiment_run(tmp_path):
    from lightning.pytorch.loggers import MLFlowLogger

    logger = MLFlowLogger(experiment_name="x", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    trainer = make_trainer(1, logger=logger, default_root_dir=tmp_path / "root")
    assert run_dir(trainer) == tmp_path / "root" / logger.experiment_id / logger.run_id


class _Rank1:
    """What run_dir reads of a trainer on rank 1 of 2."""

    is_global_zero, world_size, loggers = False, 2, []

    def __init__(self, root, broadcast) -> None:
        self.default_root_dir, self.strategy = str(root), SimpleNamespace(broadcast=broadcast)


def test_other_ranks_take_rank_zeros_directory(tmp_path):
    sent = []
    rank1 = _Rank1(tmp_path, lambda obj: sent.append(obj) or str(tmp_path / "from-rank-0"))
    assert run_dir(rank1) == tmp_path / "from-rank-0" and sent == [None]  # it resolved nothing itself
    assert not (tmp_path / "version_0").exists()


def test_latest_checkpoint_is_the_newest_last_ckpt_of_any_run(tmp_path):
    where = rf"'{tmp_path}/\*\*/checkpoints/last\*.ckpt'"
    with pytest.raises(ValueError, match=rf"ckpt_path 'last': no checkpoint matches {where}: pass a"):
        latest_checkpoint(tmp_path)
    paths = [tmp_path / "checkpoints/last.ckpt", tmp_path / "1/run/checkpoints/last.ckpt"]
    paths.append(tmp_path / "version_3/checkpoints/last-v1.ckpt")
    for age, path in enumerate(reversed(paths)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        os.utime(path, ns=(0, (10 - age) * 10**9))
    (tmp_path / "version_3/checkpoints/step=9.ckpt").write_bytes(b"x")  # not a last.ckpt
    assert latest_checkpoint(tmp_path) == paths[-1]
    os.utime(paths[0], ns=(0, 20 * 10**9))
    assert latest_checkpoint(tmp_path) == paths[0]
