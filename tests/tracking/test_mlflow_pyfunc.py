"""Each registered drafter version is an MLflow model: MLmodel, signature, pyfunc load round trip, URIs."""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tracking.test_mlflow_drafter import assert_same, mlflow_tracking_uri, weights
from tlt_lightning import cli
from tlt_lightning.drafter import Drafter, DrafterConfig, import_drafter, load_drafter, save_drafter
from tlt_lightning.drafter.mlflow_uri import file_sha256
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
from tlt_lightning.tracking import log_drafter_version
from tlt_lightning.tracking.mlflow_pyfunc import FLAVOR_NAME, _load_target

mlflow = pytest.importorskip("mlflow")
pd = pytest.importorskip("pandas")

PROMPTS = [[5, 6, 7], [9, 10, 11, 12]]


@pytest.fixture
def registered(tmp_path, tiny_llama, monkeypatch):
    """A random tiny-llama drafter registered as version 1 of 'my-drafter' in a fresh sqlite store,
    which is MLflow's tracking URI for the test (also for our own loaders: ``$MLFLOW_TRACKING_URI``)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("x", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(tiny_llama, "eagle3", 64), tiny_llama)
    directory = save_drafter(drafter, tmp_path / "drafter")
    version = log_drafter_version(
        client, run_id, directory, "my-drafter", rl_step=5, target_model="tiny-llama"
    )
    with mlflow_tracking_uri(uri):
        yield {"uri": uri, "client": client, "run_id": run_id, "drafter": drafter, "version": version}


def test_a_version_is_an_mlflow_model_with_flavours_signature_and_target(registered):
    info = mlflow.models.get_model_info("models:/my-drafter/1")
    assert set(info.flavors) == {"python_function", FLAVOR_NAME}
    assert info.flavors["python_function"]["loader_module"] == "tlt_lightning.tracking.mlflow_pyfunc"
    flavour = info.flavors[FLAVOR_NAME]
    config = registered["drafter"].config
    assert flavour["drafter_config"] == json.loads(json.dumps(config.to_dict()))  # the checkpoint's config
    assert flavour["target"] == {
        "model": "tiny-llama",
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "num_layers": config.num_target_layers,
        "vocab_size": config.vocab_size,
    }
    assert flavour["rl_step"] == 5 and info.metadata["target_model"] == "tiny-llama"
    assert flavour["tlt_lightning_version"] == metadata.version("tlt-lightning")  # the installed package
    assert info.signature.inputs.input_names() == ["input_ids"]
    assert info.signature.outputs.input_names() == ["token_ids", "mean_accept_length"]
    assert {p.name: p.default for p in info.signature.params} == {"max_new_tokens": 32, "num_draft_tokens": 4}
    files = registered["client"].list_artifacts(registered["run_id"], "drafter/model/step-00000005")
    sizes = {Path(a.path).name: a.file_size for a in files}
    size = mlflow.models.Model.load("models:/my-drafter/1").model_size_bytes
    assert size >= sizes["model.safetensors"] > 0  # the weights are counted


def test_pyfunc_load_round_trip_drafts_for_the_recorded_target(registered, tiny_llama):
    model = mlflow.pyfunc.load_model("models:/my-drafter/1")  # loads tiny-llama (seed 0) by its recorded name
    drafter = model.get_raw_model()
    assert isinstance(drafter, Drafter) and drafter.config == registered["drafter"].config
    assert_same(weights(drafter), weights(registered["drafter"]))
    out = model.predict(
        pd.DataFrame({"input_ids": PROMPTS}), params={"max_new_tokens": 6, "num_draft_tokens": 3}
    )
    assert list(out.columns) == ["token_ids", "mean_accept_length"] and len(out) == 2
    # Lossless: exactly the target's own greedy continuation, whatever the (random) drafter proposed.
    plain = RolloutEngine(tiny_llama, RolloutConfig(max_new_tokens=6, temperature=0.0)).generate(PROMPTS)
    assert [list(row) for row in out["token_ids"]] == [r.token_ids.tolist() for r in plain.rollouts]
    assert all(1.0 <= a <= 4.0 for a in out["mean_accept_length"])  # tokens per speculative step
    records = model.predict([{"input_ids": PROMPTS[0]}], params={"max_new_tokens": 6, "num_draft_tokens": 3})
    assert list(records["token_ids"][0]) == list(out["token_ids"][0])


def test_pyfunc_refuses_weights_changed_after_logging(registered, tmp_path):
    local = Path(mlflow.artifacts.download_artifacts("models:/my-drafter/1", dst_path=str(tmp_path / "dl")))
    info = mlflow.models.get_model_info(str(local))
    assert info.flavors[FLAVOR_NAME]["weights_sha256"] == file_sha256(local / "model.safetensors")
    stored = load_file(str(local / "model.safetensors"))
    save_file(
        {k: v + 1 if v.is_floating_point() else v for k, v in stored.items()},
        str(local / "model.safetensors"),
    )
    with pytest.raises(ValueError, match=r"sha256 is not the one this MLflow model was saved with"):
        mlflow.pyfunc.load_model(str(local))


def test_pyfunc_takes_another_target_through_model_config(registered, tiny_llama):
    model = mlflow.pyfunc.load_model("models:/my-drafter/1", model_config={"target": tiny_llama})
    assert model._model_impl.target is tiny_llama  # that very target object, not a fresh load
    qwen = HFTarget(load_model("tiny-qwen2", seed=0).model)
    with pytest.raises(ValueError, match=r"model_type"):  # a target the drafter does not fit
        mlflow.pyfunc.load_model("models:/my-drafter/1", model_config={"target": qwen})


def test_unrecorded_target_is_found_by_signature_or_named_in_the_error():
    signature = {"model_type": "llama", "hidden_size": 64, "num_layers": 4, "vocab_size": 128}
    assert (
        _load_target(None, signature, "float32", 0).info.vocab_size == 128
    )  # the one registry model: tiny-llama
    with pytest.raises(
        ValueError, match=r"no registry model matches its signature .* model_config=\{'target'"
    ):
        _load_target(None, {**signature, "vocab_size": 999}, "float32", 0)


def test_load_drafter_resolves_models_and_runs_uris(registered, tiny_llama, tmp_path):
    run_id, expected = registered["run_id"], weights(registered["drafter"])
    assert_same(weights(load_drafter("models:/my-drafter/1", tiny_llama)), expected)
    assert_same(weights(load_drafter("models:/my-drafter/latest", tiny_llama)), expected)
    registered["client"].set_registered_model_alias("my-drafter", "serving", "1")
    assert_same(weights(load_drafter("models:/my-drafter@serving", tiny_llama)), expected)
    source = f"runs:/{run_id}/drafter/model/step-00000005"
    assert_same(weights(load_drafter(source, tiny_llama, tracking_uri=registered["uri"])), expected)
    with pytest.raises(
        ValueError,
        match=rf"run {run_id} has no artifact 'drafter/model/step-9'; artifacts under "
        r"'drafter/model': \['drafter/model/step-00000005'\]",
    ):
        load_drafter(f"runs:/{run_id}/drafter/model/step-9", tiny_llama)
    with pytest.raises(ValueError, match=r"no run 'nope' in sqlite:"):
        load_drafter("runs:/nope/drafter", tiny_llama)
    with pytest.raises(ValueError, match=r"a runs:/ URI names a run and a path"):
        load_drafter(f"runs:/{run_id}", tiny_llama)
    with pytest.raises(ValueError, match=r"no MLflow store at .*none.db"):
        load_drafter("models:/my-drafter/1", tiny_llama, tracking_uri=f"sqlite:///{tmp_path}/none.db")


def test_uris_without_mlflow_name_the_extra(monkeypatch, tiny_llama):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` now raises ImportError
    with pytest.raises(ModuleNotFoundError, match=r"tlt-lightning\[mlflow\]"):
        load_drafter("models:/my-drafter/1", tiny_llama)


def test_export_drafter_takes_a_registered_version(registered, tiny_llama, tmp_path, capsys):
    out = tmp_path / "eagle"
    assert (
        cli.main(["export-drafter", "models:/my-drafter/1", str(out), "--tracking-uri", registered["uri"]])
        == 0
    )
    assert "for tiny-llama" in capsys.readouterr().out  # the target recorded in the version's MLmodel
    assert import_drafter(out, tiny_llama).config.kind == "eagle3"
    with pytest.raises(SystemExit, match=r"export-drafter: no registered model 'nope' .*\['my-drafter'\]"):
        cli.main(["export-drafter", "models:/nope/1", str(tmp_path / "x")])
