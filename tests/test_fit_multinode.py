"""``tlt-lightning fit`` on two nodes: two ``torchrun`` agents meet at a c10d rendezvous on this machine.

Each agent is one "node" (``--nnodes=2 --nproc_per_node=1``) running one rank of the main job's CLI with
``trainer.num_nodes=2`` over gloo, as ``torchrun`` would on two hosts of a cluster: Lightning finds
``TorchElasticEnvironment`` and starts no processes of its own. The fit has the spot drafter (its
worker coordinator spans both ranks) and the bandit; :class:`RankReport` saves what each rank holds at
the start and end of training, since Lightning checkpoints and drafter files are written by rank 0 only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning import Callback, LightningModule, Trainer

from tests.helpers import assert_same, callback_state
from tests.test_fit_processes import drafter_versions, rewards, runs, tlt_config
from tlt_lightning.callbacks import SpotDrafterCallback
from tlt_lightning.tracking import mlflow_available

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300.0  # a safety net only: two steps on the tiny model take seconds after the imports

pytestmark = pytest.mark.skipif(not mlflow_available(), reason="the mlflow extra is not installed")


class RankReport(Callback):
    """Saves this rank's view (rank, node, weights of policy and drafter, counters) at train start and end
    as ``<directory>/rank<R>-<start|end>-<global step>.pt``."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save(trainer, pl_module, "start")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save(trainer, pl_module, "end")

    def _save(self, trainer: Trainer, pl_module: LightningModule, when: str) -> None:
        (spot,) = [c.spot for c in trainer.callbacks if isinstance(c, SpotDrafterCallback)]
        report = {
            "global_rank": trainer.global_rank,
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "world_size": trainer.world_size,
            "environment": type(trainer.strategy.cluster_environment).__name__,
            "policy": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            "drafter": {k: v.detach().clone() for k, v in spot.drafter.state_dict().items()},
            "version": spot.publisher.version,
            "drafter_steps": spot.steps,
            "rollouts": spot.coordinator.rollouts,
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        torch.save(report, self.directory / f"rank{trainer.global_rank}-{when}-{trainer.global_step}.pt")


def two_node_config(tmp_path: Path) -> Path:
    """The TLT config of ``test_fit_processes`` on ``num_nodes=2`` (one device each, DDP over gloo)."""
    config = yaml.safe_load(tlt_config(tmp_path).read_text())
    config["trainer"]["num_nodes"] = 2
    config["trainer"]["strategy"] = {
        "class_path": "lightning.pytorch.strategies.DDPStrategy",
        "init_args": {"process_group_backend": "gloo"},
    }
    report = {"class_path": f"{__name__}.RankReport", "init_args": {"directory": str(tmp_path / "ranks")}}
    config["trainer"]["callbacks"].append(report)
    path = tmp_path / "two-nodes.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit_on_two_nodes(tmp_path: Path, name: str, config: Path, root: Path, store: Path, *args: str) -> None:
    """Two ``torchrun`` agents, node ranks 0 and 1, joining one c10d rendezvous; both must succeed."""
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    rendezvous = [
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        f"--rdzv_id={name}",
        "--rdzv_conf=join_timeout=120",
    ]
    fit = ["-m", "tlt_lightning.cli", "--threads", "1", "fit", "--config", str(config)]
    fit += [
        f"--trainer.default_root_dir={root}",
        f"--trainer.logger.init_args.tracking_uri=sqlite:///{store}",
    ]
    nodes = []
    for node in range(2):
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *rendezvous,
            f"--node_rank={node}",
            *fit,
            *args,
        ]
        log = tmp_path / f"{name}-node{node}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        nodes.append((proc, log))
    failed = []
    for proc, log in nodes:
        try:
            code = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the agent and its worker (its own session)
            code = proc.wait()
        if code != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            failed.append(f"{log.stem} exited with {code}:\n{tail}")
    assert not failed, "\n\n".join(failed)


def reports(tmp_path: Path, when: str, step: int) -> list[dict]:
    found = sorted((tmp_path / "ranks").glob(f"rank*-{when}-{step}.pt"))
    assert [p.name for p in found] == [f"rank{r}-{when}-{step}.pt" for r in range(2)]
    return [torch.load(p, weights_only=False) for p in found]


def test_two_nodes_through_torchrun_train_the_drafter_checkpoint_and_resume(tmp_path):
    config = two_node_config(tmp_path)
    root, store = tmp_path / "fit", tmp_path / "mlflow.db"
    fit_on_two_nodes(tmp_path, "first", config, root, store, "--trainer.max_steps=2")

    # Two nodes of one rank each, found by Lightning through torchrun's environment; both stepped.
    first = reports(tmp_path, "end", 2)
    assert sorted((r["global_rank"], r["node_rank"]) for r in first) == [(0, 0), (1, 1)]
    for report in first:
        assert (report["local_rank"], report["world_size"]) == (0, 2)
        assert report["environment"] == "TorchElasticEnvironment"
        assert report["rollouts"] == 2  # the coordinator saw both of this rank's rollouts
    # The drafter was trained and published on both ranks alike; DDP kept the policies identical.
    assert first[0]["drafter_steps"] == first[1]["drafter_steps"] > 0
    assert first[0]["version"] == first[1]["version"] > 0
    assert_same(first[0]["drafter"], first[1]["drafter"], "drafter")
    assert_same(first[0]["policy"], first[1]["policy"], "policy")

    # Rank 0 logged one MLflow run, registered a drafter per RL step and wrote the checkpoints.
    (run,) = runs(store)
    assert run.info.status == "FINISHED"
    assert sorted(rewards(store, run.info.run_id)) == [0, 1]
    assert sorted(int(v.tags["rl_step"]) for v in drafter_versions(store)) == [1, 2]
    (run_dir,) = root.glob(f"*/{run.info.run_id}")
    last = run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=False)
    assert checkpoint["global_step"] == 2
    assert_same(callback_state(checkpoint, "SpotDrafterCallback")["drafter"], first[0]["drafter"], "saved")

    # Resumed on two nodes: both ranks start from the checkpoint and train on, into the same run.
    fit_on_two_nodes(tmp_path, "resumed", config, root, store, "--trainer.max_steps=4", f"--ckpt_path={last}")
    for start, end in zip(reports(tmp_path, "start", 2), first):
        assert_same(start["policy"], end["policy"], "resumed policy")
        assert_same(start["drafter"], end["drafter"], "resumed drafter")
        assert start["version"] == end["version"]
    resumed = reports(tmp_path, "end", 4)
    assert resumed[0]["drafter_steps"] == resumed[1]["drafter_steps"] > first[0]["drafter_steps"]
    assert_same(resumed[0]["drafter"], resumed[1]["drafter"], "drafter after the resume")
    (run,) = runs(store)
    assert run.info.status == "FINISHED"
    assert sorted(rewards(store, run.info.run_id)) == [0, 1, 2, 3]
    assert sorted(int(v.tags["rl_step"]) for v in drafter_versions(store)) == [1, 2, 3, 4]
    assert torch.load(last, weights_only=False, mmap=True)["global_step"] == 4
