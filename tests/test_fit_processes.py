"""``tlt-lightning fit`` as real processes: killed with SIGKILL then resumed; two fits at once on one store.

The in-process tests (``test_resume.py``, ``test_cli.py``) simulate a kill with an exception and set
the MLflow status back by hand; here the fit is a subprocess that really gets ``kill -9`` at an
arbitrary point after a checkpoint (the async drafter writer, MLflow's sqlite writes and Lightning's
checkpoint write may all be in flight), and two fits really share a default root dir and a fresh store.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers import assert_same, callback_state
from tlt_lightning.tracking import mlflow_available

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "grpo_tiny.yaml"
MODEL = "tlt-drafter-tiny-llama"  # the drafter's registered-model name for the tiny config
TIMEOUT_S = 300.0  # a safety net only: a tiny fit takes seconds

pytestmark = pytest.mark.skipif(not mlflow_available(), reason="the mlflow extra is not installed")


def tlt_config(tmp_path: Path) -> Path:
    """The tiny config with TLT on, bit-reproducible: a step-bounded spot drafter saved every RL step, a
    reproducible bandit, Lightning checkpoints every 2 steps (all kept, ``step=N.ckpt``) and ``last.ckpt``."""
    config = yaml.safe_load(TINY.read_text())
    config["model"]["rollout_progress"] = False
    config["model"]["speculative"]["drafter_kind"] = None  # the callback builds and trains the drafter
    config["trainer"]["enable_progress_bar"] = False
    config["trainer"]["callbacks"] = [
        {
            "class_path": "tlt_lightning.callbacks.SpotDrafterCallback",
            "init_args": {
                "config": {
                    "training": {"max_steps_per_rollout": 2, "max_seconds_per_rollout": None},
                    "draft_vocab_size": None,
                    "checkpoint_interval": 1,
                },
                "timeline": False,
            },
        },
        {
            "class_path": "tlt_lightning.callbacks.BanditCallback",
            "init_args": {
                "reproducible": True,
                "strategy": {
                    "class_path": "tlt_lightning.scheduling.BEGMABStrategy",
                    "init_args": {"epsilon": 0.3, "seed": 1},
                },
            },
        },
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {
                "every_n_train_steps": 2,
                "save_top_k": -1,
                "filename": "{step}",
                "save_last": True,
            },
        },
    ]
    path = tmp_path / "tlt.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def ctrl_c_default() -> None:
    """In a child, before it starts: SIGINT as in a terminal. A shell's background job (``cmd &``, nohup)
    ignores it, a setting children inherit, and a fit then keeps running when it is sent SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Fit:
    """A ``tlt-lightning fit`` subprocess (this checkout's sources), its output in ``<name>.log``."""

    def __init__(self, tmp_path: Path, name: str, config: Path, root: Path, store: Path, *args: str) -> None:
        path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        self.log = tmp_path / f"{name}.log"
        argv = [
            sys.executable,
            "-m",
            "tlt_lightning.cli",
            "--threads",
            "1",
            "fit",
            "--config",
            str(config),
            f"--trainer.default_root_dir={root}",
            f"--trainer.logger.init_args.tracking_uri=sqlite:///{store}",
            *args,
        ]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=ctrl_c_default
            )

    def output(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"{self.log.stem} did not end within {TIMEOUT_S} s:\n{self.output()}")

    def succeed(self) -> None:
        assert self.wait() == 0, f"{self.log.stem} failed:\n{self.output()}"

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        """Poll ``condition`` until it holds; fail if the process ends first (or after ``TIMEOUT_S``)."""
        deadline = time.monotonic() + TIMEOUT_S
        while not condition():
            if self.proc.poll() is not None:
                pytest.fail(
                    f"{self.log.stem} exited ({self.proc.returncode}) before {what}:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"no {what} after {TIMEOUT_S} s:\n{self.output()}")
            time.sleep(0.01)


def client(store: Path):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=f"sqlite:///{store}")


def runs(store: Path) -> list:
    c = client(store)
    return c.search_runs([e.experiment_id for e in c.search_experiments()])


def rewards(store: Path, run_id: str) -> dict[int, set[float]]:
    """``{step: every reward/mean value logged at that step}`` (a resumed run logs some steps twice)."""
    found = defaultdict(set)
    for metric in client(store).get_metric_history(run_id, "reward/mean"):
        found[metric.step].add(metric.value)
    return dict(found)


def drafter_versions(store: Path) -> list:
    return client(store).search_model_versions(f"name='{MODEL}'")


def the_one(pattern: str, where: Path) -> Path:
    (found,) = where.glob(pattern)
    return found


def stray_files(root: Path) -> list[str]:
    """Temporaries a writer left behind (the drafter checkpointer's ``*.tmp-*``, any ``*.tmp``)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".tmp" in p.name)


# ---------------------------------------------------------------------------------- kill -9, resume


def test_fit_killed_with_sigkill_resumes_into_the_uninterrupted_run(tmp_path):
    steps = 8
    config = tlt_config(tmp_path)
    full_store, store = tmp_path / "full" / "mlflow.db", tmp_path / "killed" / "mlflow.db"
    full_root, root = tmp_path / "full" / "fit", tmp_path / "killed" / "fit"
    full = Fit(tmp_path, "full", config, full_root, full_store, f"--trainer.max_steps={steps}")
    victim = Fit(tmp_path, "victim", config, root, store, f"--trainer.max_steps={steps}")

    # Kill once the Lightning checkpoint of step 2 exists and the run has moved on: the drafter of
    # step 3 is saved (its Lightning checkpoint is written after the callbacks' hooks of that step).
    victim.wait_for(
        lambda: (
            any(root.glob("*/*/checkpoints/step=2.ckpt"))
            and any(root.glob("*/*/drafter/checkpoints/step-00000003"))
        ),
        "the checkpoint of step 2 and the drafter of step 3",
    )
    victim.proc.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL, f"it ended before the kill; make it longer:\n{victim.output()}"
    full.succeed()

    (run,) = runs(store)
    run_id = run.info.run_id
    assert run.info.status == "RUNNING"  # what a SIGKILL leaves
    before = {int(v.tags["rl_step"]) for v in drafter_versions(store)}
    assert 1 in before and max(before) < steps  # the first half registered its drafters as it went
    last = the_one(f"*/{run_id}/checkpoints/last.ckpt", root)
    killed_at = torch.load(last, weights_only=False, mmap=True)["global_step"]
    assert killed_at in (2, 4, 6)

    resumed = Fit(
        tmp_path, "resumed", config, root, store, f"--trainer.max_steps={steps}", f"--ckpt_path={last}"
    )
    resumed.succeed()

    # MLflow: the same run, finished; every step's reward is the uninterrupted run's (steps logged
    # by both halves, those after the resume point, have one value: the same).
    (run,) = runs(store)
    assert (run.info.run_id, run.info.status) == (run_id, "FINISHED")
    (full_run,) = runs(full_store)
    expected = rewards(full_store, full_run.info.run_id)
    assert sorted(expected) == list(range(steps)) and all(len(v) == 1 for v in expected.values())
    assert rewards(store, run_id) == expected
    # A drafter version for every save of both halves (the resume step and the end included), each
    # once, all of this run; the last one's weights are the uninterrupted run's.
    versions = drafter_versions(store)
    assert sorted(int(v.tags["rl_step"]) for v in versions) == list(range(1, steps + 1))
    assert {v.run_id for v in versions} == {run_id}
    full_versions = {int(v.tags["rl_step"]): v.tags["sha256"] for v in drafter_versions(full_store)}
    assert {int(v.tags["rl_step"]): v.tags["sha256"] for v in versions} == full_versions

    # Policy, optimizer, drafter (weights, optimizer, buffer) and bandit: bit-identical.
    full_dir, run_dir = the_one(f"*/{full_run.info.run_id}", full_root), the_one(f"*/{run_id}", root)
    end, end_full = (torch.load(d / "checkpoints/last.ckpt", weights_only=False) for d in (run_dir, full_dir))
    assert end["global_step"] == end_full["global_step"] == steps
    assert_same(end["state_dict"], end_full["state_dict"], "policy")
    assert_same(end["optimizer_states"], end_full["optimizer_states"], "optimizer")
    spot, spot_full = (callback_state(c, "SpotDrafterCallback") for c in (end, end_full))
    assert_same(spot["drafter"], spot_full["drafter"], "drafter")
    assert_same(spot["buffer"], spot_full["buffer"], "buffer")
    final = f"drafter/checkpoints/step-{steps:08d}/model.safetensors"
    assert_same(load_file(run_dir / final), load_file(full_dir / final), "final drafter checkpoint")
    bandit = callback_state(end_full, "BanditCallback")
    assert bandit["num_updates"] > 0 and callback_state(end, "BanditCallback") == bandit

    # The run's directory: both configs, a summary naming a checkpoint on disk, no stray temporaries.
    assert {"config.yaml", "config-resume-1.yaml"} <= {p.name for p in run_dir.iterdir()}
    summary = json.loads((run_dir / "drafter" / "summary.json").read_text())
    assert summary["rl_steps"] == steps and Path(summary["checkpoint"]) == run_dir / final.rsplit("/", 1)[0]
    assert stray_files(root) == []


# ---------------------------------------------------------------------------------- two fits at once


def test_two_fits_at_once_on_one_root_dir_and_one_store(tmp_path):
    config = tlt_config(tmp_path)
    root, store = tmp_path / "fit", tmp_path / "mlflow.db"  # both fresh: created by the racing fits
    fits = {
        steps: Fit(
            tmp_path,
            f"fit-{steps}",
            config,
            root,
            store,
            f"--trainer.max_steps={steps}",
            f"--seed_everything={seed}",
            f"--model.seed={seed}",
        )
        for steps, seed in ((3, 1), (4, 2))
    }
    for fit in fits.values():
        fit.succeed()

    found = runs(store)
    assert sorted(r.info.status for r in found) == ["FINISHED", "FINISHED"]
    versions = drafter_versions(store)
    assert {v.run_id for v in versions} == {r.info.run_id for r in found}
    for run in found:
        run_dir = the_one(f"*/{run.info.run_id}", root)
        steps = torch.load(run_dir / "checkpoints/last.ckpt", weights_only=False, mmap=True)["global_step"]
        assert steps in fits and run.data.params["trainer/max_steps"] == str(steps)
        assert sorted(rewards(store, run.info.run_id)) == list(range(steps))
        # Its own drafter checkpoints, complete; its summary names one of them.
        drafters = sorted((run_dir / "drafter" / "checkpoints").iterdir())
        assert [p.name for p in drafters] == [f"step-{s:08d}" for s in (steps - 1, steps)]
        for path in drafters:
            assert {p.name for p in path.iterdir()} == {
                "model.safetensors",
                "config.json",
                "optimizer.pt",
                "meta.json",
            }
        summary = json.loads((run_dir / "drafter" / "summary.json").read_text())
        assert Path(summary["run_dir"]) == run_dir and Path(summary["checkpoint"]) == drafters[-1]
        # Its own registered drafter versions, one per save, the last one its final drafter.
        mine = {int(v.tags["rl_step"]): v for v in versions if v.run_id == run.info.run_id}
        assert sorted(mine) == list(range(1, steps + 1))
        assert len([v for v in versions if v.run_id == run.info.run_id]) == steps
        assert all(v.source.startswith(f"runs:/{run.info.run_id}/") for v in mine.values())
        final = hashlib.sha256((drafters[-1] / "model.safetensors").read_bytes()).hexdigest()
        assert mine[steps].tags["sha256"] == final
    # The two runs' directories and nothing else under the shared root; no stray temporaries anywhere.
    assert sorted(p.name for p in root.glob("*/*")) == sorted(r.info.run_id for r in found)
    assert stray_files(tmp_path) == []
    assert not (tmp_path / "runs").exists() and not (tmp_path / "lightning_logs").exists()
