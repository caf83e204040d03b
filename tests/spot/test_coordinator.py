from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tlt_lightning.spot import (
    CoordinatorConfig,
    Segment,
    WorkerCoordinator,
    WorkerState,
    idle_fraction_recovered,
    plot_timeline,
)
from tlt_lightning.spot.coordinator import cpu_group

BUSY, IDLE, TRAINING = WorkerState.BUSY, WorkerState.IDLE, WorkerState.TRAINING
STEP_S = 0.03


def states(timeline, worker=None):
    """The sequence of states, zero-length segments dropped."""
    return [s.state for s in timeline if (worker is None or s.worker == worker) and s.end > s.start]


# ---------------------------------------------------------------------------------- single process
def test_single_worker_trains_within_budget():
    coord = WorkerCoordinator(CoordinatorConfig(max_steps=3))
    assert not coord.distributed and coord.world_size == 1 and coord.state is BUSY
    coord.rollout_started()
    coord.share_done()
    assert coord.state is IDLE
    calls = []
    window = coord.maybe_train(lambda: calls.append(time.time()))
    assert window.steps == 3 == len(calls) and not window.preempted and window.latency_s is None
    assert coord.state is IDLE
    coord.wait_rollout_end()
    assert coord.state is BUSY and coord.finished_last()  # alone: always the last one done
    assert [s.state for s in coord.timeline()][-4:] == [IDLE, TRAINING, IDLE, BUSY]
    assert coord.state_dict()["train_steps"] == 3 and coord.state_dict()["windows"] == 1


def test_single_worker_local_preemption_stops_after_the_running_step():
    coord = WorkerCoordinator(CoordinatorConfig(max_seconds=3600.0))  # only the preemption can stop it
    coord.rollout_started()
    coord.share_done()
    events = []

    def step():
        n = sum(e == "start" for e in events) + 1
        events.append("start")
        if n == 3:  # "the next rollout starts" from another thread, during the third step
            signal = threading.Thread(target=lambda: (coord.preempt(), events.append("preempt")))
            signal.start()
            signal.join()
        events.append("end")

    window = coord.maybe_train(step)
    # The step that was running finishes; no step starts after the signal.
    assert events == ["start", "end"] * 2 + ["start", "preempt", "end"]
    assert window.preempted and window.steps == 3 and coord.state is BUSY
    assert window.latency_s is not None and window.latency_s >= 0
    assert coord.stats()["preemption_latency_p50"] == pytest.approx(window.latency_s)
    assert [s.state for s in coord.timeline()][-3:] == [IDLE, TRAINING, BUSY]


def test_no_data_means_no_training():
    coord = WorkerCoordinator(CoordinatorConfig(max_steps=5))
    coord.rollout_started()
    coord.share_done()
    window = coord.maybe_train(lambda: None, has_data=False)
    assert window.steps == 0 and coord.state is IDLE and coord.windows == 0
    coord.wait_rollout_end()
    coord.rollout_started()
    coord.share_done()
    left = iter([True, True, False])
    assert coord.maybe_train(lambda: None, has_data=lambda: next(left)).steps == 2


def test_errors():
    with pytest.raises(ValueError, match="min_idle_s must be a finite number >= 0, got -1"):
        CoordinatorConfig(min_idle_s=-1)
    with pytest.raises(ValueError, match="max_steps must be a positive int or None, got 0"):
        CoordinatorConfig(max_steps=0)
    with pytest.raises(ValueError, match="max_seconds must be a number > 0 or None, got -2"):
        CoordinatorConfig(max_seconds=-2)
    with pytest.raises(ValueError, match="poll_s must be a number > 0, got 0"):
        CoordinatorConfig(poll_s=0)
    with pytest.raises(ValueError, match="max_segments must be an int >= 1, got 0"):
        CoordinatorConfig(max_segments=0)
    coord = WorkerCoordinator()
    with pytest.raises(RuntimeError, match="maybe_train\\(\\) needs an IDLE worker"):
        coord.maybe_train(lambda: None)
    coord.share_done()
    with pytest.raises(RuntimeError, match="share_done\\(\\) needs a started rollout"):
        coord.share_done()
    with pytest.raises(
        ValueError, match="single worker has no tail to fill: set CoordinatorConfig.max_steps"
    ):
        coord.maybe_train(lambda: None)
    with pytest.raises(ValueError, match="timeline is empty"):
        plot_timeline([], "x.png")


def test_state_dict_tolerates_missing_keys():
    coord = WorkerCoordinator()
    coord.load_state_dict({"train_steps": 12, "idle_seconds": 1.5})
    coord.load_state_dict({})
    assert coord.state_dict() == {
        "rollouts": 0,
        "windows": 0,
        "train_steps": 12,
        "train_seconds": 0.0,
        "idle_seconds": 1.5,
    }


def test_idle_fraction_and_plot(tmp_path):
    timeline = [
        Segment(0, BUSY, 0.0, 1.0),
        Segment(0, IDLE, 1.0, 1.5),
        Segment(0, TRAINING, 1.5, 4.0),
        Segment(0, BUSY, 4.0, 5.0),
        Segment(1, BUSY, 0.0, 4.0),
        Segment(1, BUSY, 4.0, 5.0),
    ]
    assert idle_fraction_recovered(timeline) == pytest.approx(2.5 / 3.0)
    assert idle_fraction_recovered(timeline[4:]) == 0.0
    path = plot_timeline(timeline, tmp_path / "plots" / "timeline.png")
    assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------- two gloo processes
def _worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        coord = WorkerCoordinator(CoordinatorConfig(min_idle_s=0.05))
        assert coord.distributed and coord.rank == rank
        started: list[float] = []

        def step():
            started.append(time.time())
            time.sleep(STEP_S)  # a drafter step (sleep: the 2-core machine is shared)

        windows, signals, last = [], [], []
        for rollout in range(2):
            coord.rollout_started()
            straggler = (rollout + 1) % 2  # rollout 0: rank 1 is in the tail; rollout 1: rank 0
            time.sleep(0.6 if rank == straggler else 0.05)
            coord.share_done()
            window = coord.maybe_train(step)
            signals.append(float(coord._signal.item()) if window.preempted else None)
            windows.append(window._asdict())
            coord.wait_rollout_end()
            last.append(coord.finished_last())
        segments = [[s.worker, s.state.value, s.start, s.end] for s in coord.gather_timeline()]
        Path(out, f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "windows": windows,
                    "started": started,
                    "signals": signals,
                    "last": last,
                    "timeline": segments,
                }
            )
        )
    finally:
        dist.destroy_process_group()


def test_two_gloo_workers_unbalanced_rollouts(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(2, f"file://{tmp_path}/init", str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for rank, me, trains_in in ((0, r0, 0), (1, r1, 1)):
        trained, waited = me["windows"][trains_in], me["windows"][1 - trains_in]
        # The early worker trains through the other's tail and is preempted when it ends...
        # (no step or time budget: only the end of the rollout stops it).
        assert trained["steps"] >= 1 and trained["preempted"], (rank, trained)
        # ...within one drafter step: at most one step starts after the signal (an order, not a duration).
        signal = me["signals"][trains_in]
        assert sum(t > signal for t in me["started"]) <= 1, (rank, signal)
        assert trained["latency_s"] is not None and trained["latency_s"] >= 0, (rank, trained)
        # The straggler does not train (the rollout is over as soon as its share is done).
        assert waited["steps"] == 0, (rank, waited)
        assert me["last"][1 - trains_in] and not me["last"][trains_in]  # finished_last: the straggler's share
    timeline = [Segment(w, WorkerState(s), a, b) for w, s, a, b in r0["timeline"]]
    assert r0["timeline"] == r1["timeline"]  # gathered: every rank sees all workers
    seq0, seq1 = states(timeline, 0), states(timeline, 1)
    assert seq0[:4] == [BUSY, BUSY, IDLE, TRAINING] and TRAINING not in seq1[:4]
    assert seq0.count(TRAINING) == 1 and seq1.count(TRAINING) == 1
    assert idle_fraction_recovered(timeline) > 0  # the tail was (partly) spent training


def _local_preempt_worker(rank: int, world: int, init: str, out: str) -> None:
    """A local preempt() while the other rank is still busy: IDLE until the rollout really ends."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    go = Path(out, "rank0-checked")  # rank 1 finishes its share only once rank 0 has checked
    try:
        coord = WorkerCoordinator(CoordinatorConfig(min_idle_s=0.0))
        coord.rollout_started()
        if rank == 1:
            while not go.exists():
                time.sleep(0.01)
        coord.share_done()
        if rank == 0:
            steps = []

            def step():
                steps.append(len(steps))
                if len(steps) == 3:
                    coord.preempt()  # the local "next rollout" signal, during the third step

            window = coord.maybe_train(step)
            assert window.preempted and window.steps == 3 and coord.state is WorkerState.IDLE
            assert not coord._work.is_completed()  # rank 1 is still generating (it waits for `go`)
            go.write_text("ok")
            coord.wait_rollout_end()
            assert coord.state is WorkerState.BUSY
            seq = states(coord.timeline())
            assert seq[-3:] == [TRAINING, IDLE, BUSY], seq
    finally:
        dist.destroy_process_group()


def test_local_preempt_while_others_busy(tmp_path):
    mp.spawn(_local_preempt_worker, args=(2, f"file://{tmp_path}/init", str(tmp_path)), nprocs=2, join=True)


def _cuda_only_world_worker(rank: int, world: int, init: str, out: str) -> None:
    """A world whose backend says it carries CUDA tensors only (as NCCL does): signals go over gloo."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        world_config = dist.get_backend_config
        dist.get_backend_config = lambda group=None: "cuda:nccl" if group is None else world_config(group)
        try:
            coord = WorkerCoordinator(CoordinatorConfig(min_idle_s=0.0))
        finally:
            dist.get_backend_config = world_config
        assert coord.group is not None and dist.get_backend(coord.group) == "gloo"
        assert dist.get_process_group_ranks(coord.group) == [0, 1]
        assert cpu_group(coord.group) is coord.group  # a gloo group is kept as it is
        coord.rollout_started()
        coord.share_done()
        coord.wait_rollout_end()
        assert coord.rollout_over() and float(coord._signal.item()) >= coord._done_at
        Path(out, f"rank{rank}.done").write_text("ok")
    finally:
        dist.destroy_process_group()


def test_a_world_without_cpu_collectives_signals_over_a_gloo_group(tmp_path):
    mp.spawn(_cuda_only_world_worker, args=(2, f"file://{tmp_path}/init", str(tmp_path)), nprocs=2, join=True)
    assert sorted(p.name for p in tmp_path.glob("*.done")) == ["rank0.done", "rank1.done"]
