"""The drafter in MLflow's model registry: one version per checkpoint of a GRPO fit, loaded back in one
call."""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger

from tests.rl.test_module import make_module, make_trainer
from tlt_lightning.callbacks import SpotDrafterCallback
from tlt_lightning.drafter import Drafter, DrafterConfig, load_drafter, save_drafter
from tlt_lightning.tracking import (
    drafter_model_name,
    load_drafter_from_mlflow,
    log_drafter_version,
    mlflow_drafter,
    tracking_logger,
)

mlflow = pytest.importorskip("mlflow")

NAME = "tlt-drafter-tiny-llama"


@contextlib.contextmanager
def mlflow_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's process-wide tracking URI (what ``mlflow.pyfunc.load_model("models:/...")`` resolves
    against) set to ``uri``, then set back. Lightning's ``MLFlowLogger`` sets it too when it opens a run."""
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)


def weights(drafter: Drafter) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in drafter.state_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


class Record(L.Callback):
    """After the SpotDrafterCallback: the drafter each step saved, and what was registered by then."""

    def __init__(self, spot: SpotDrafterCallback) -> None:
        self.spot, self.saved, self.registered_at = spot, {}, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.saved[trainer.global_step] = weights(self.spot.spot.drafter)
        self.registered_at[trainer.global_step] = list(self.spot.registrar.registered_steps)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A 3-step GRPO fit on tiny-llama, a drafter checkpoint every step, an MLflow run on a sqlite store."""
    tmp = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{tmp}/mlflow.db"
    logger = MLFlowLogger(
        experiment_name="drafter-registry", tracking_uri=uri, artifact_location=str(tmp / "artifacts")
    )
    config = {"checkpoint_interval": 1, "training": {"max_steps_per_rollout": 1}}
    spot = SpotDrafterCallback(config, timeline=False)
    record = Record(spot)
    module = make_module()
    trainer = make_trainer(
        3, callbacks=[spot, record], logger=logger, default_root_dir=tmp / "run", log_every_n_steps=1
    )
    trainer.fit(module)
    return {
        "uri": uri,
        "client": logger.experiment,
        "run_id": logger.run_id,
        "spot": spot,
        "record": record,
        "target": module.rollout_target,
        "tmp": tmp,
    }


def versions(client, name: str = NAME) -> list:
    return sorted(client.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version))


def test_one_version_per_checkpoint_in_step_order(fitted):
    client, run_id, spot = fitted["client"], fitted["run_id"], fitted["spot"]
    found = versions(client)
    assert [(int(v.version), v.tags["rl_step"]) for v in found] == [(1, "1"), (2, "2"), (3, "3")]
    vocab = str(spot.spot.drafter.config.draft_vocab_size or spot.spot.drafter.config.vocab_size)
    for v in found:
        assert v.run_id == run_id and v.tags["run_id"] == run_id
        assert v.tags["kind"] == "eagle1" and v.tags["draft_vocab"] == vocab
        assert v.source == f"runs:/{run_id}/drafter/model/step-{int(v.tags['rl_step']):08d}"
        assert v.status == "READY"
    assert len({v.tags["sha256"] for v in found}) == 3  # three different drafters
    assert "load_drafter_from_mlflow" in client.get_registered_model(NAME).description
    assert spot.registrar.registered_steps == [1, 2, 3] and spot.state_dict()["registered_steps"] == [1, 2, 3]
    # Registered at the next step's end, once written: the rollouts never waited for it.
    assert fitted["record"].registered_at == {1: [], 2: [1], 3: [1, 2]}


def test_the_run_holds_each_steps_drafter(fitted):
    client, run_id = fitted["client"], fitted["run_id"]
    folders = {a.path for a in client.list_artifacts(run_id, "drafter/model") if a.is_dir}
    assert folders == {f"drafter/model/step-{s:08d}" for s in (1, 2, 3)}
    for step in (1, 2, 3):
        files = {Path(a.path).name for a in client.list_artifacts(run_id, f"drafter/model/step-{step:08d}")}
        # The checkpoint's own files (no optimizer state) beside what makes it an MLflow model.
        checkpoint = {"model.safetensors", "config.json", "meta.json"}
        mlflow_model = {"MLmodel", "requirements.txt", "python_env.yaml", "conda.yaml"}
        assert checkpoint | mlflow_model <= files and "optimizer.pt" not in files


def test_newest_version_reloads_the_final_drafter_and_older_versions_older_weights(fitted, monkeypatch):
    uri, target, spot, saved = fitted["uri"], fitted["target"], fitted["spot"], fitted["record"].saved
    newest = load_drafter_from_mlflow(NAME, target, tracking_uri=uri, dtype=torch.float32)
    assert isinstance(newest, Drafter) and newest.config == spot.spot.drafter.config
    assert_same(weights(newest), weights(spot.spot.drafter))
    assert_same(saved[3], weights(spot.spot.drafter))
    first = load_drafter_from_mlflow(NAME, target, version=1, tracking_uri=uri)
    assert_same(weights(first), saved[1])
    assert not all(torch.equal(first.state_dict()[k], v) for k, v in saved[3].items())
    assert_same(weights(load_drafter_from_mlflow(f"models:/{NAME}/2", target, tracking_uri=uri)), saved[2])
    assert_same(
        weights(load_drafter_from_mlflow(f"models:/{NAME}/latest", target, tracking_uri=uri)), saved[3]
    )
    fitted["client"].set_registered_model_alias(NAME, "best", "2")
    assert_same(weights(load_drafter_from_mlflow(f"models:/{NAME}@best", target, tracking_uri=uri)), saved[2])
    assert_same(weights(load_drafter_from_mlflow(NAME, target, version="best", tracking_uri=uri)), saved[2])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # no tracking_uri: MLflow's own setting
    assert_same(weights(load_drafter_from_mlflow(NAME, target, version="1")), saved[1])


def test_the_callbacks_settings_are_run_params(fitted):
    params = fitted["client"].get_run(fitted["run_id"]).data.params
    spot = fitted["spot"]
    assert params["drafter/lr"] == "0.0003" and params["drafter/buffer_mb"] == "256.0"
    assert params["drafter/checkpoint_interval"] == "1" and params["drafter/max_steps_per_rollout"] == "1"
    assert params["drafter/kind"] == "eagle1" and params["drafter/draft_vocab_size"] == "8192"
    # The drafter actually trained: the draft vocabulary capped at tiny-llama's 128 tokens.
    assert params["drafter/effective_draft_vocab"] == "128" == str(spot.spot.drafter.config.draft_vocab)
    assert params["drafter/registered_model_name"] == NAME and params["drafter/drafter_path"] == "None"
    assert params["drafter/trainable_parameters"] == str(spot.spot.drafter.num_trainable_parameters())
    assert (
        set(params) >= set(spot.params()) and "optim/lr" in params
    )  # beside the module's own (grouped) hyper-parameters


def test_a_fits_versions_load_by_uri_and_as_pyfunc_models(fitted):
    uri, run_id, target, saved = fitted["uri"], fitted["run_id"], fitted["target"], fitted["record"].saved
    assert_same(weights(load_drafter(f"models:/{NAME}/2", target, tracking_uri=uri)), saved[2])
    step1 = f"runs:/{run_id}/drafter/model/step-00000001"
    assert_same(weights(load_drafter(step1, target, tracking_uri=uri)), saved[1])
    assert_same(weights(load_drafter_from_mlflow(step1, target, tracking_uri=uri)), saved[1])
    with mlflow_tracking_uri(uri):
        model = mlflow.pyfunc.load_model(f"models:/{NAME}/3", model_config={"target": target})
        info = mlflow.models.get_model_info(f"models:/{NAME}/3")
    assert_same(weights(model.get_raw_model()), saved[3])
    assert info.flavors["tlt_drafter"]["target"]["model"] == "tiny-llama"  # the fit's model, loadable by name
    assert info.flavors["tlt_drafter"]["rl_step"] == 3


def test_unknown_names_versions_and_aliases_say_what_exists(fitted, tmp_path):
    uri, target = fitted["uri"], fitted["target"]
    with pytest.raises(ValueError, match=rf"no registered model 'nope' in .*registered models: \['{NAME}'\]"):
        load_drafter_from_mlflow("nope", target, tracking_uri=uri)
    with pytest.raises(ValueError, match=rf"'{NAME}' has no version 9; versions: \[1, 2, 3\]"):
        load_drafter_from_mlflow(NAME, target, version=9, tracking_uri=uri)
    with pytest.raises(ValueError, match=rf"'{NAME}' has no version 7; versions: \[1, 2, 3\]"):
        load_drafter_from_mlflow(f"models:/{NAME}/7", target, tracking_uri=uri)
    with pytest.raises(ValueError, match=r"has no alias 'gold'; aliases: .*, versions: \[1, 2, 3\]"):
        load_drafter_from_mlflow(f"models:/{NAME}@gold", target, tracking_uri=uri)
    missing = f"sqlite:///{tmp_path}/none.db"
    with pytest.raises(
        ValueError, match=r"no MLflow store at .*none.db.* does not exist\): pass tracking_uri="
    ):
        load_drafter_from_mlflow(NAME, target, tracking_uri=missing)
    assert not (tmp_path / "none.db").exists()
    with pytest.raises(ValueError, match=r"location must be 'models:/<name>/<version>', .* got 'file:/x/y'"):
        load_drafter_from_mlflow("file:/x/y", target, tracking_uri=uri)
    with pytest.raises(ValueError, match=r"no run 'x' in sqlite:.* \(from 'runs:/x/y'\)"):
        load_drafter_from_mlflow("runs:/x/y", target, tracking_uri=uri)
    with pytest.raises(ValueError, match=r"version=2 given with a models:/ URI that names one already"):
        load_drafter_from_mlflow(f"models:/{NAME}/1", target, version=2, tracking_uri=uri)
    with pytest.raises(ValueError, match=r"version must be an int >= 1, .* got 0"):
        load_drafter_from_mlflow(NAME, target, version=0, tracking_uri=uri)


def test_without_an_mlflow_logger_no_registry_is_touched(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/untouched.db")

    def fail(*args, **kwargs):
        raise AssertionError("log_drafter_version called without an MLFlowLogger")

    monkeypatch.setattr("tlt_lightning.tracking.lightning_mlflow.log_drafter_version", fail)
    for logger in (False, CSVLogger(tmp_path / "csv")):
        config = {"checkpoint_interval": 1, "training": {"max_steps_per_rollout": 1}}
        spot = SpotDrafterCallback(config, timeline=False)
        make_trainer(2, callbacks=[spot], logger=logger, default_root_dir=tmp_path / "run").fit(make_module())
        assert spot.registrar.registered_steps == [] and spot.registrar.versions == []
        last = spot.spot.last_checkpoint
        assert last is not None and Path(last).is_dir()  # checkpoints as before
    assert not list(tmp_path.rglob("*.db")) and not (tmp_path / "mlruns").exists()


@pytest.fixture
def standalone(tmp_path, tiny_llama):
    """A client on a fresh sqlite store, one run, and a saved tiny drafter."""
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("x", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(tiny_llama, "eagle3", 64), tiny_llama)
    return client, run_id, save_drafter(drafter, tmp_path / "drafter"), drafter


def test_log_drafter_version_registers_once_per_checkpoint(standalone, tmp_path, tiny_llama):
    client, run_id, directory, drafter = standalone
    version = log_drafter_version(client, run_id, directory, "my-drafter", rl_step=5)
    assert version.version == 1 and version.source == f"runs:/{run_id}/drafter/model/step-00000005"
    assert {k: version.tags[k] for k in ("rl_step", "kind", "draft_vocab")} == {
        "rl_step": "5",
        "kind": "eagle3",
        "draft_vocab": "64",
    }
    # The same checkpoint again (a resumed fit saving its restored step, in another run): no duplicate.
    other_run = client.create_run(client.get_run(run_id).info.experiment_id).info.run_id
    assert log_drafter_version(client, other_run, directory, "my-drafter", rl_step=5).version == 1
    assert log_drafter_version(client, run_id, directory, "my-drafter", rl_step=6).version == 2
    assert len(versions(client, "my-drafter")) == 2
    loaded = load_drafter_from_mlflow(
        "models:/my-drafter/1", tiny_llama, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db"
    )
    assert_same(weights(loaded), weights(drafter))


def test_log_drafter_version_when_another_fit_creates_the_registered_model_first(standalone):
    # Two fits on one store register their first drafter at once: both find no registered model, one
    # creates it, the other's create fails (RESOURCE_ALREADY_EXISTS). That one must go on, not crash.
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

    client, run_id, directory, _ = standalone

    class Racing:
        def __getattr__(self, name):
            return getattr(client, name)

        def get_registered_model(self, name):  # the other fit creates it just after this one looked
            client.create_registered_model(name)
            del Racing.get_registered_model
            raise mlflow.exceptions.MlflowException(f"no {name}", RESOURCE_DOES_NOT_EXIST)

    version = log_drafter_version(Racing(), run_id, directory, "my-drafter", rl_step=1)
    assert version.version == 1 and version.run_id == run_id
    assert [m.name for m in client.search_registered_models()] == ["my-drafter"]


def test_log_drafter_version_bad_input(standalone, tmp_path):
    client, run_id, directory, _ = standalone
    with pytest.raises(ValueError, match=r"is not a drafter checkpoint: model.safetensors not found"):
        log_drafter_version(client, run_id, tmp_path, "my-drafter", rl_step=1)
    with pytest.raises(ValueError, match=r"rl_step must be an int >= 0, got -1"):
        log_drafter_version(client, run_id, directory, "my-drafter", rl_step=-1)
    with pytest.raises(ValueError, match=r"name must be a non-empty registered-model name, got ''"):
        log_drafter_version(client, run_id, directory, "", rl_step=1)
    assert client.search_registered_models() == []


def test_without_mlflow_installed_the_error_names_the_extra(standalone, monkeypatch, tiny_llama):
    client, run_id, directory, _ = standalone
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` now raises ImportError
    with pytest.raises(
        ModuleNotFoundError, match=r"needs the mlflow extra \(pip install 'tlt-lightning\[mlflow\]'\)"
    ):
        load_drafter_from_mlflow(NAME, tiny_llama)
    with pytest.raises(ModuleNotFoundError, match=r"tlt-lightning\[mlflow\]"):
        log_drafter_version(client, run_id, directory, "my-drafter", rl_step=1)


def test_drafter_model_name():
    assert drafter_model_name("smollm2-135m") == "tlt-drafter-smollm2-135m"
    assert (
        drafter_model_name("/models/HuggingFaceTB/SmolLM2-135M-Instruct/")
        == "tlt-drafter-smollm2-135m-instruct"
    )
    assert drafter_model_name(Path("runs/my model")) == "tlt-drafter-my-model"
    with pytest.raises(ValueError, match=r"model must name a model .* got '/'"):
        drafter_model_name("/")
    with pytest.raises(ValueError, match=r"registered_model_name must be a non-empty string or None, got ''"):
        SpotDrafterCallback(registered_model_name="")
    # load_drafter_from_mlflow's default store is the one `tlt-lightning fit` writes to.
    fit_store = inspect.signature(tracking_logger).parameters["tracking_uri"].default
    assert mlflow_drafter.DEFAULT_TRACKING_URI == fit_store


def test_a_registered_version_whose_weights_were_changed_is_refused(standalone, tmp_path, tiny_llama):
    client, run_id, directory, drafter = standalone
    log_drafter_version(client, run_id, directory, "my-drafter", rl_step=5)
    (stored,) = (tmp_path / "artifacts").rglob("model.safetensors")
    tampered = Drafter(DrafterConfig.from_target(tiny_llama, "eagle3", 64), tiny_llama)
    save_drafter(tampered, tmp_path / "tampered")
    stored.write_bytes((tmp_path / "tampered" / "model.safetensors").read_bytes())
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with pytest.raises(
        ValueError, match=r"'my-drafter' version 1: model.safetensors has sha256 .* registered"
    ):
        load_drafter_from_mlflow("models:/my-drafter/1", tiny_llama, tracking_uri=uri)
    with pytest.raises(ValueError, match=r"the stored file was changed after registration; refusing"):
        load_drafter("models:/my-drafter/1", tiny_llama, tracking_uri=uri)
