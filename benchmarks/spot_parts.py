"""The parts of spot training measured on their own (``python -m benchmarks spot --parts ...``).

- :func:`~benchmarks.spot_packing.benchmark_packing` (in :mod:`.spot_packing`): drafter training
  throughput with sequence packing vs padding;
- :func:`benchmark_preemption`: latency from "the rollout is over everywhere" to a training worker
  leaving TRAINING, with real ``torch.distributed`` (gloo) processes;
- :func:`benchmark_checkpoint`: caller-side blocking time of the asynchronous drafter checkpoint
  against a synchronous save.
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.spot_contention import drafter_step
from benchmarks.spot_packing import benchmark_packing
from tlt_lightning.drafter import Drafter, DrafterConfig
from tlt_lightning.models import HFTarget
from tlt_lightning.reports import machine_info, median
from tlt_lightning.spot import (
    AsyncCheckpointer,
    CoordinatorConfig,
    Segment,
    WorkerCoordinator,
    WorkerState,
    idle_fraction_recovered,
    plot_timeline,
)

# benchmark_packing is re-exported: it was defined here.
__all__ = ["benchmark_checkpoint", "benchmark_packing", "benchmark_preemption"]


# ---------------------------------------------------------------------------------- preemption
def _tiny_drafter_step(seed: int) -> Callable[[], Any]:
    """One real drafter training step on a tiny random target (a 1-layer drafter, 8 x 64 samples)."""
    return drafter_step("tiny-llama", None, "float32", length=64, batch_size=8, seed=seed)


def _preemption_worker(
    rank: int, world: int, init: str, rollouts: int, tail_s: tuple, min_idle_s: float, out: str, seed: int
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    step = _tiny_drafter_step(seed)
    step()  # warm-up
    coord = WorkerCoordinator(CoordinatorConfig(min_idle_s=min_idle_s))
    rng = random.Random(seed)  # the same draws on every rank
    windows = []
    for i in range(rollouts):
        tail = rng.uniform(*tail_s)
        coord.rollout_started()
        straggler = rank == i % world  # one rank per rollout is in the tail
        time.sleep(tail if straggler else 0.01)
        coord.share_done()
        window = coord.maybe_train(step)
        coord.wait_rollout_end()
        # Whatever the plan said (the other rank can be descheduled on a loaded machine):
        windows.append({**window._asdict(), "straggler": straggler, "last": coord.finished_last()})
    timeline = coord.gather_timeline()
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, windows)
    if rank == 0:
        segments = [[s.worker, s.state.value, s.start, s.end] for s in timeline]
        Path(out).write_text(json.dumps({"windows": everyone, "timeline": segments}))
    # Teardown only after both ranks are done with every collective: a rank that destroys its group
    # while the other still talks to it can abort the other's gloo threads (seen on a loaded machine).
    # On an error there is no teardown: mp.spawn reports the exception and ends the other rank.
    dist.barrier()
    dist.destroy_process_group()


def benchmark_preemption(
    rollouts: int = 20,
    world_size: int = 2,
    tail_s: tuple[float, float] = (0.2, 0.6),
    min_idle_s: float = 0.05,
    seed: int = 0,
    plot_path: str | Path | None = None,
) -> dict[str, Any]:
    """Preemption latency of drafter training with ``world_size`` gloo processes on this machine.

    Each rollout one rank is the straggler (it "generates" for ``tail_s`` seconds, uniform); the
    others finish at once and train a tiny drafter (real :func:`drafter_train_step` s) until the
    straggler's :meth:`~WorkerCoordinator.share_done` preempts them.

    Returns:
        Latency p50 / p99 / max (seconds), the mean drafter step time, latency in steps, the idle
        fraction recovered and the windows of every rank.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        args = (world_size, f"file://{tmp}/init", rollouts, tuple(tail_s), min_idle_s, str(out), seed)
        mp.spawn(_preemption_worker, args=args, nprocs=world_size, join=True)
        result = json.loads(out.read_text())
    every = [w for rank in result["windows"] for w in rank]
    windows = [w for w in every if w["steps"] > 0 and w["latency_s"] is not None]
    timeline = [Segment(w, WorkerState(st), a, b) for w, st, a, b in result["timeline"]]
    if plot_path is not None:
        plot_timeline(timeline, plot_path, "preemption benchmark")
    lat = torch.tensor([w["latency_s"] for w in windows], dtype=torch.float64)
    step_s = sum(w["seconds"] for w in windows) / max(1, sum(w["steps"] for w in windows))
    p50, p99 = (
        lat.quantile(torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
        if lat.numel()
        else [math.nan] * 2
    )
    return {
        "latency_p50_s": p50,
        "latency_p99_s": p99,
        "latency_max_s": float(lat.max()) if lat.numel() else math.nan,
        "step_s": step_s,
        "latency_p99_steps": p99 / step_s if step_s else math.nan,
        "windows": len(windows),
        # Planned stragglers that trained: 0 unless the OS delayed the other rank past the tail.
        "straggler_windows": sum(w["straggler"] and w["steps"] > 0 for w in every),
        # Ranks that finished last and still trained: 0 unless the all-reduce that tells them so took
        # longer than min_idle_s to complete (a loaded machine): nothing else tells a rank it was last.
        "last_finisher_windows": sum(w["last"] and w["steps"] > 0 for w in every),
        "steps_per_window": sum(w["steps"] for w in windows) / max(1, len(windows)),
        "idle_fraction_recovered": idle_fraction_recovered(timeline),
        "settings": {
            "rollouts": rollouts,
            "world_size": world_size,
            "tail_s": list(tail_s),
            "min_idle_s": min_idle_s,
            "seed": seed,
        },
        "machine": machine_info(),
    }


# ---------------------------------------------------------------------------------- checkpoint
def benchmark_checkpoint(
    hidden_size: int = 576,
    vocab_size: int = 49152,
    repeats: int = 5,
    directory: str | os.PathLike | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Caller-side blocking time of :meth:`AsyncCheckpointer.save` vs a synchronous save.

    The drafter is an EAGLE-1 drafter sized for SmolLM2-135M by default (``hidden_size`` 576:
    4.2M parameters + AdamW state, ~50 MB per checkpoint) on a random 1-layer target. Synchronous =
    the same snapshot + write + fsync + rename on the caller's thread (``save`` then ``wait``).
    After one warm-up save each, alternates sync / async ``repeats`` times; medians.

    Returns:
        ``{"sync_s", "async_blocking_s", "ratio", "checkpoint_mb", ...}``.
    """
    torch.manual_seed(seed)
    heads = max(1, hidden_size // 64)
    hf = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=int(hidden_size * 8 / 3) // 64 * 64,
        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=max(1, heads // 3),
        tie_word_embeddings=True,
    )  # fmt: skip
    target = HFTarget(LlamaForCausalLM(hf).eval())
    drafter = Drafter(DrafterConfig.from_target(target, "eagle1"), target)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    for p in drafter.parameters():  # populate the AdamW moments
        p.grad = torch.randn_like(p)
    optimizer.step()
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        sync, async_ = AsyncCheckpointer(Path(tmp) / "sync"), AsyncCheckpointer(Path(tmp) / "async")
        for ckpt in (sync, async_):  # warm-up: a run saves many times, buffers are reused after the first
            ckpt.save(drafter, optimizer, 0)
            ckpt.wait()
        sync_s, async_s, write_s = [], [], []
        for i in range(1, repeats + 1):
            start = time.perf_counter()
            sync.save(drafter, optimizer, i)
            sync.wait()
            sync_s.append(time.perf_counter() - start)
            async_.save(drafter, optimizer, i)
            async_s.append(async_.last_blocking_s)
            async_.wait()  # not timed: the caller would be generating meanwhile
            write_s.append(async_.last_write_s)
        size = sum(f.stat().st_size for f in async_.latest().iterdir())
    return {
        "sync_s": median(sync_s),
        "async_blocking_s": median(async_s),
        "async_write_s": median(write_s),
        "ratio": median(sync_s) / median(async_s),
        "checkpoint_mb": size / 2**20,
        "drafter_parameters": drafter.num_trainable_parameters(),
        "sync_s_all": sync_s,
        "async_blocking_s_all": async_s,
        "settings": {"hidden_size": hidden_size, "vocab_size": vocab_size, "repeats": repeats},
        "machine": machine_info(),
    }
