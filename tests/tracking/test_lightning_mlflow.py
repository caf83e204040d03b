import json
from types import SimpleNamespace

from lightning.pytorch.loggers import CSVLogger

from tlt_lightning.spot.checkpoint_io import META_NAME
from tlt_lightning.tracking import CheckpointRegistrar, log_artifact, mlflow_loggers


def _checkpoint(directory, step, saved_at):
    path = directory / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / META_NAME).write_text(json.dumps({"time": saved_at}))


def test_registrar_waits_for_the_writer_and_skips_stale_or_missing_checkpoints(tmp_path):
    trainer = SimpleNamespace(loggers=[], is_global_zero=True)
    writer = SimpleNamespace(
        directory=tmp_path, in_flight=True, owns=lambda path: path.name != "step-00000004"
    )
    registrar = CheckpointRegistrar("tlt-drafter-x")
    _checkpoint(tmp_path, 2, saved_at=100.0)  # fresh: saved after the request at 99
    _checkpoint(tmp_path, 1, saved_at=50.0)  # stale: left by an earlier fit, requested at 60
    _checkpoint(tmp_path, 4, saved_at=100.0)  # fresh, but another writer's (it replaced ours)
    for step, requested in ((2, 99.0), (1, 60.0), (3, 99.5), (4, 99.0)):  # step 3 never reached the disk
        registrar.request(step, requested)
    registrar.register(trainer, writer)
    assert registrar.registered_steps == []  # a write is in flight: nothing yet
    writer.in_flight = False
    registrar.register(trainer, writer)
    assert registrar.registered_steps == [2]
    registrar.request(2, 99.0)
    registrar.register(trainer, writer)
    assert registrar.registered_steps == [2]  # never twice


def test_registrar_state_carries_unregistered_saves_to_a_resumed_fit(tmp_path):
    trainer = SimpleNamespace(loggers=[], is_global_zero=True)
    writer = SimpleNamespace(directory=tmp_path / "new-run", in_flight=False, owns=lambda path: True)
    first = CheckpointRegistrar("tlt-drafter-x")
    first.request(1, 10.0, tmp_path / "old-run" / "step-00000001")
    first.request(2, 20.0)
    first.request(2, 21.0)  # the same step again: the newer request only
    assert first.pending_steps == [1, 2]
    resumed = CheckpointRegistrar("tlt-drafter-x")
    resumed.load_state_dict(first.state_dict())
    assert resumed.pending_steps == [1, 2] and resumed.registered_steps == []
    _checkpoint(tmp_path / "old-run", 1, saved_at=11.0)  # landed where the first fit wrote it
    resumed.register(trainer, writer)
    assert resumed.registered_steps == [1] and resumed.pending_steps == []
    unnamed = CheckpointRegistrar(None)  # not rank 0 / no MLflow: nothing is kept pending
    unnamed.load_state_dict(first.state_dict())
    assert unnamed.pending_steps == [] and unnamed.state_dict() == {"registered_steps": [], "pending": []}


def test_without_mlflow_nothing_is_logged(tmp_path):
    trainer = SimpleNamespace(loggers=[CSVLogger(tmp_path)], is_global_zero=True)
    assert mlflow_loggers(trainer) == []
    assert log_artifact(trainer, tmp_path) is False
