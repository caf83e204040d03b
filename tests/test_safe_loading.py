"""No file a user or a registry hands the program runs code: a pickled payload planted at every entry.

The payload is an object whose ``__reduce__`` creates a marker file when unpickled; every test checks
that the marker never appears and that the error names the file and the way to trust it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.drafter.conftest import make_drafter
from tests.spot.test_checkpoint import trained
from tlt_lightning import cli
from tlt_lightning.drafter import export_drafter, load_drafter, save_drafter
from tlt_lightning.recipes.grpo_torchtune import load_config, run
from tlt_lightning.resume import checkpoint_weights_only, read_checkpoint
from tlt_lightning.safe_load import TRUST_ENV, load_torch_file
from tlt_lightning.spot import AsyncCheckpointer
from tlt_lightning.tracking.mlflow_resume import mlflow_run_in_checkpoint, resumable_run_id

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "grpo_tiny.yaml"
REFUSED = rf"holds pickled Python objects.*refused.*{TRUST_ENV}=1"


class Payload:
    """Unpickled, it creates ``marker`` (what an attacker's ``os.system`` would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(path: Path, marker: Path) -> Path:
    """A file that looks like a Lightning checkpoint and carries the payload."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {}, "hyper_parameters": {}, "payload": Payload(marker)}, path)
    return path


@pytest.fixture
def marker(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv(TRUST_ENV, raising=False)
    path = tmp_path / "PWNED"
    yield path
    assert not path.exists(), "the planted payload ran"


def test_load_torch_file_refuses_pickled_objects_unless_trusted(tmp_path, marker, monkeypatch):
    planted = plant(tmp_path / "x.pt", marker)
    with pytest.raises(ValueError, match=rf"'.*x.pt' {REFUSED}"):
        load_torch_file(planted, "a checkpoint")
    (tmp_path / "garbage.pt").write_bytes(b"garbage" * 10)
    with pytest.raises(ValueError, match=r"'.*garbage.pt' is corrupt or not a checkpoint \(UnpicklingError"):
        load_torch_file(tmp_path / "garbage.pt", "a checkpoint")
    # The opt-in reads it in full: the payload is real (the marker is removed for the fixture's check).
    monkeypatch.setenv(TRUST_ENV, "1")
    load_torch_file(planted, "a checkpoint")
    assert marker.exists()
    marker.unlink()


def test_weights_only_false_needs_the_trust_variable(monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    assert checkpoint_weights_only(None) is True and checkpoint_weights_only(True) is True
    with pytest.raises(ValueError, match=rf"weights_only=False .* runs any code .* set {TRUST_ENV}=1"):
        checkpoint_weights_only(False)
    monkeypatch.setenv(TRUST_ENV, "1")
    assert checkpoint_weights_only(None) is False and checkpoint_weights_only(False) is False


def test_checkpoint_readers_refuse_a_payload(tmp_path, marker, monkeypatch):
    planted = plant(tmp_path / "last.ckpt", marker)
    with pytest.raises(ValueError, match=rf"ckpt_path '.*last.ckpt' {REFUSED}"):
        read_checkpoint(planted)
    with pytest.raises(ValueError, match=REFUSED):
        mlflow_run_in_checkpoint(planted)
    # Lightning's keywords are keywords, even where a file of that name is in the working directory.
    monkeypatch.chdir(tmp_path)
    for keyword in ("last", "hpc"):
        plant(tmp_path / keyword, marker)
        assert resumable_run_id(keyword, f"sqlite:///{tmp_path}/mlflow.db") is None


def fit_argv(tmp_path: Path, ckpt_path: str) -> list[str]:
    config = yaml.safe_load(TINY.read_text())
    config["model"]["rollout_progress"] = False
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(config))
    return [
        "--threads",
        "1",
        "fit",
        "--config",
        str(tmp_path / "tiny.yaml"),
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.max_steps=1",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
        f"--ckpt_path={ckpt_path}",
    ]


def test_fit_ckpt_path_refuses_a_payload(tmp_path, marker, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["tlt-lightning"])
    planted = plant(tmp_path / "evil.ckpt", marker)
    assert cli.main(fit_argv(tmp_path, str(planted)), short_errors=True) == 1
    assert "evil.ckpt' holds pickled Python objects" in capsys.readouterr().err
    assert cli.main([*fit_argv(tmp_path, str(planted)), "--weights_only=false"], short_errors=True) == 1
    assert f"set {TRUST_ENV}=1" in capsys.readouterr().err


@pytest.mark.parametrize("keyword", ["last", "hpc"])
def test_fit_ckpt_path_keywords_refuse_a_payload(tmp_path, marker, monkeypatch, capsys, keyword):
    """fit resolves ``last`` (the newest ``*/checkpoints/last.ckpt`` under the root dir), Lightning ``hpc``
    (``hpc_ckpt_<n>.ckpt`` in the root dir): both are read weights-only."""
    monkeypatch.setattr(sys, "argv", ["tlt-lightning"])
    monkeypatch.chdir(tmp_path)
    plant(tmp_path / keyword, marker)  # a file named like the keyword, in the working directory
    name = "checkpoints/last.ckpt" if keyword == "last" else "hpc_ckpt_1.ckpt"
    plant(tmp_path / "run" / name, marker)
    assert cli.main(fit_argv(tmp_path, keyword), short_errors=True) == 1
    err = capsys.readouterr().err
    refused = "last.ckpt' holds" if keyword == "last" else "the checkpoint --ckpt_path names holds"
    assert f"{refused} pickled Python objects" in err and TRUST_ENV in err


def test_torchtune_recipe_ckpt_path_refuses_a_payload(tmp_path, marker, monkeypatch):
    monkeypatch.setenv("TLT_LIGHTNING_CACHE", str(tmp_path / "cache"))
    planted = plant(tmp_path / "evil.ckpt", marker)
    overrides = ["model=null", "checkpointer=null", "module.model=tiny-llama", "logger=null"]
    cfg = load_config(str(ROOT / "configs" / "grpo_torchtune.yaml"), [*overrides, f"ckpt_path={planted}"])
    with pytest.raises(ValueError, match=rf"'.*evil.ckpt' {REFUSED}"):
        run(cfg)


def test_drafter_and_spot_checkpoints_refuse_a_payload(tiny_llama, tmp_path, marker):
    drafter = make_drafter(tiny_llama, "eagle3", draft_vocab_size=64)
    saved = save_drafter(drafter, tmp_path / "drafter")
    plant(saved / "model.safetensors", marker)
    with pytest.raises(ValueError, match=r"model.safetensors is corrupt or not a safetensors file"):
        load_drafter(saved, tiny_llama)
    with pytest.raises(ValueError, match=r"model.safetensors is corrupt or not a safetensors file"):
        export_drafter(saved, tmp_path / "out", tiny_llama)
    # A spot checkpoint folder (what AsyncCheckpointer writes): a payload or garbage as optimizer.pt.
    optimizer = trained(drafter)
    ckpt = AsyncCheckpointer(tmp_path / "spot")
    ckpt.save(drafter, optimizer, step=1)
    assert ckpt.wait(timeout=30)
    folder = ckpt.latest()
    plant(folder / "optimizer.pt", marker)
    with pytest.raises(ValueError, match=rf"optimizer.pt' {REFUSED}"):
        AsyncCheckpointer.load(folder, drafter, optimizer)
    for garbage in (b"garbage" * 10, bytes(range(256))):
        (folder / "optimizer.pt").write_bytes(garbage)
        with pytest.raises(ValueError, match=r"'.*optimizer.pt' is corrupt or not an optimizer state"):
            AsyncCheckpointer.load(folder, drafter, optimizer)
    torch.save([1, 2, 3], folder / "optimizer.pt")
    with pytest.raises(
        ValueError, match=r"optimizer.pt is not an optimizer state \(no state / param_groups\)"
    ):
        AsyncCheckpointer.load(folder, drafter, optimizer)


@pytest.mark.parametrize("uri", ["models:/tlt-drafter-tiny/1", "runs:/0123abcd/drafter/model/step-1"])
def test_mlflow_downloads_refuse_a_payload(tiny_llama, tmp_path, marker, monkeypatch, uri):
    drafter = make_drafter(tiny_llama, "eagle3", draft_vocab_size=64)
    saved = save_drafter(drafter, tmp_path / "drafter")
    plant(saved / "model.safetensors", marker)
    monkeypatch.setattr("tlt_lightning.drafter.io.download_drafter", lambda location, dst, **_: saved)
    with pytest.raises(ValueError, match=r"model.safetensors is corrupt or not a safetensors file"):
        load_drafter(uri, tiny_llama)
