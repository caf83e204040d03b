"""``bench e2e --config --peers``: the same fit config on vLLM rollouts and on TRL's GRPOTrainer."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import yaml

import benchmarks.e2e_config as e2e_config
import benchmarks.trl_peer as trl_peer_module
from benchmarks.e2e_config import read_records, run, without_tlt
from benchmarks.e2e_peers import PeerUnavailable, merge, peer_ratios, trl_peer, vllm_python, with_vllm
from tests.benchmarks.test_e2e_config import tiny_config
from tlt_lightning.models.hardware import resolve_dtype

ROOT = Path(__file__).resolve().parents[2]
PEER_OVERLAY = ROOT / "benchmarks" / "vllm_cpu_peer.yaml"
# Runs `python -m tlt_lightning.cli ...` with vLLM replaced by tests/vllm/fake_vllm.py (our engine behind
# vLLM's API), so the vllm peer's fit runs here as it would on a real vLLM.
BOOT = """
import runpy, sys
sys.path[:0] = [{tests!r}, {root!r}]
import tlt_lightning.vllm.backend as backend
from fake_vllm import fake_vllm_module
backend.require_vllm = fake_vllm_module
sys.argv = sys.argv[2:]  # drop "-m tlt_lightning.cli"
runpy.run_module("tlt_lightning.cli", run_name="__main__")
"""


def tiny_peer_args(tmp_path: Path, python: Path, **settings) -> argparse.Namespace:
    """`bench e2e --config` arguments for the tiny config (written to `tmp_path`), vLLM run by `python`."""
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    return argparse.Namespace(
        config=str(path), devices=None, threads=1, out=str(tmp_path / "out"), json=str(tmp_path / "e2e.json"),
        skip_steps=0, baseline_first=True, vllm_python=str(python), vllm_config=str(PEER_OVERLAY), **settings,
    )  # fmt: skip


def test_merge_overlays_mappings_recursively_and_replaces_the_rest():
    base = {"model": {"optim": {"lr": 1.0, "group_size": 4}, "dtype": "float32"}, "seed": 0}
    out = merge(base, {"model": {"optim": {"lr": 2.0}, "rollout_backend": "vllm"}, "seed": [1]})
    assert out == {
        "model": {"optim": {"lr": 2.0, "group_size": 4}, "dtype": "float32", "rollout_backend": "vllm"},
        "seed": [1],
    }
    assert base["model"]["optim"]["lr"] == 1.0  # not modified


def test_the_vllm_peer_is_the_baseline_on_vllm_with_a_tracking_store_of_its_own(tmp_path):
    overlay = PEER_OVERLAY
    demo = yaml.safe_load((ROOT / "configs" / "grpo_smollm2.yaml").read_text())
    baseline = without_tlt(demo)
    peer = with_vllm(baseline, overlay, tmp_path / "vllm" / "mlflow.db")
    # vLLM's environment migrates an MLflow store to its own schema: never the one the other runs share.
    assert (
        peer["trainer"]["logger"]["init_args"]["tracking_uri"]
        == f"sqlite:///{tmp_path / 'vllm' / 'mlflow.db'}"
    )
    assert baseline["trainer"]["logger"]["init_args"]["tracking_uri"] == "sqlite:///runs/mlflow.db"
    peer = with_vllm(without_tlt(tiny_config()), overlay, tmp_path / "mlflow.db")  # no logger: none added
    assert peer["trainer"]["logger"] is False
    assert peer["model"]["rollout_backend"] == "vllm" and peer["model"]["speculative"]["enabled"] is False
    assert peer["model"]["vllm"] == yaml.safe_load(overlay.read_text())["model"]["vllm"]
    assert peer["model"]["optim"] == tiny_config()["model"]["optim"]
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("model: {dtype: float32}\n")
    with pytest.raises(ValueError, match="model.rollout_backend: vllm"):
        with_vllm(tiny_config(), wrong, tmp_path / "mlflow.db")


def test_the_vllm_python_is_the_requested_one_or_a_clear_error(tmp_path):
    assert vllm_python(sys.executable) == sys.executable
    with pytest.raises(PeerUnavailable, match="no such file"):
        vllm_python(str(tmp_path / "python"))


def test_the_trl_peer_runs_one_workers_share_of_the_configs_step(monkeypatch, tmp_path):
    seen = {}

    def fake_run(**kwargs):
        seen.update(kwargs)
        steps = [
            {"wall_s": w, "cpu_s": w / 2, "reward_mean": r, "completion_length_mean": n}
            for w, r, n in ((9.0, 0.1, 30.0), (4.0, 0.2, 20.0), (6.0, None, None), (5.0, 0.4, 10.0))
        ]
        return {"steps": steps, "trl_version": "x", "config": {"per_device_train_batch_size": 2}}

    monkeypatch.setattr(trl_peer_module, "run_trl_grpo", fake_run)
    config = yaml.safe_load((ROOT / "configs" / "grpo_smollm2_longtail.yaml").read_text())
    args = argparse.Namespace(steps=4, skip_steps=1, out=str(tmp_path))
    out = trl_peer(config, args)
    model = config["model"]
    assert seen["prompts_per_step"] == model["optim"]["prompts_per_step"]  # per worker, as each DDP rank
    assert seen["micro_batch_size"] == model["optim"]["micro_batch_size"]
    assert seen["max_new_tokens"] == model["rollout"]["max_new_tokens"] and seen["steps"] == 4
    assert seen["task"].system_prompt == model["task"]["system_prompt"] and seen["task"].size == 512
    assert model["dtype"] == "auto" and seen["dtype"] == resolve_dtype("auto")  # as the fit resolves it
    assert seen["group_size"] == model["optim"]["group_size"]
    assert out["step_s"] == 5.0 and out["step_cpu_s"] == 2.5 and out["steps"] == 3  # steps 2-4
    assert out["reward"] == [0.1, 0.2, None, 0.4] and out["length_mean"] == 15.0 and out["workers"] == 1


def test_peer_ratios_are_the_peers_seconds_over_ours():
    runs = {
        name: {"step_s": s, "rollout_s": r, "rollout_tokens_per_s": t}
        for name, s, r, t in (
            ("tlt", 2.0, 1.0, 300.0),
            ("baseline", 3.0, 2.0, 150.0),
            ("vllm", 4.0, 3.0, 100.0),
        )  # fmt: skip
    }
    out = peer_ratios(runs, {"trl": {"step_s": 12.0}})
    assert out["trl"] == {"tlt": {"step": 6.0}, "baseline": {"step": 4.0}}
    assert out["vllm"]["tlt"] == {"step": 2.0, "rollout": 3.0, "rollout_tokens_per_s": 3.0}
    assert out["vllm"]["baseline"] == {"step": 4 / 3, "rollout": 1.5, "rollout_tokens_per_s": 1.5}


def test_a_tiny_config_runs_beside_its_vllm_peer_and_a_missing_trl_is_skipped(monkeypatch, tmp_path):
    boot = tmp_path / "boot.py"
    boot.write_text(BOOT.format(tests=str(ROOT / "tests" / "vllm"), root=str(ROOT)))
    python = tmp_path / "vllm-python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{boot}" "$@"\n')
    python.chmod(0o755)

    def no_trl(config, args):
        raise PeerUnavailable("the TRL peer needs the 'trl' package")

    monkeypatch.setattr(e2e_config, "trl_peer", no_trl)
    args = tiny_peer_args(tmp_path, python, steps=2, bracket=False, peers=["vllm", "trl"])
    payload = run(args)
    assert payload["order"] == ["baseline", "tlt", "vllm", "trl"]
    assert payload["peers_skipped"] == {"trl": "the TRL peer needs the 'trl' package"}
    written = yaml.safe_load((tmp_path / "out" / "vllm" / "config.yaml").read_text())
    assert written["model"]["rollout_backend"] == "vllm"
    _, steps = read_records(tmp_path / "out" / "vllm" / "records")
    assert [[r["step"] for r in ranks] for ranks in steps] == [[1], [2]]
    assert all(len(r["lengths"]) == 16 and r["tokens"] == sum(r["lengths"]) for (r,) in steps)
    vllm, tlt = payload["runs"]["vllm"], payload["runs"]["tlt"]
    assert payload["vs_peers"]["vllm"]["tlt"]["step"] == vllm["step_s"] / tlt["step_s"]
    assert set(payload["vs_peers"]) == {"vllm"}


def test_a_failing_vllm_peer_is_skipped_and_a_crash_keeps_the_runs_so_far(monkeypatch, tmp_path):
    python = tmp_path / "broken-python"
    python.write_text("#!/bin/sh\nexit 3\n")
    python.chmod(0o755)
    fit = e2e_config.fit_config

    def crash_last(config, name, args, python=None):
        if name == "baseline_again":
            raise RuntimeError("the baseline_again fit failed (exit status 1)")
        return fit(config, name, args, python)

    monkeypatch.setattr(e2e_config, "fit_config", crash_last)
    args = tiny_peer_args(tmp_path, python, steps=1, bracket=True, peers=["vllm"])
    with pytest.raises(RuntimeError, match="baseline_again fit failed"):
        run(args)
    saved = json.loads(Path(args.json).read_text())  # written after each run
    assert saved["complete"] is False and set(saved["runs"]) == {"baseline", "tlt"}
    assert "the vllm fit failed (exit status 3)" in saved["peers_skipped"]["vllm"]
    assert [r["step"] for (r,) in saved["steps"]["tlt"]] == [1]
