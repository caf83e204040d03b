"""``python -m benchmarks memory --config FILE``: where a fit's memory goes, per part and per phase.

Runs ``tlt-lightning fit --config FILE`` for a few steps (as :mod:`benchmarks.e2e_config` does, TLT
on) with a :class:`~benchmarks.e2e_config.RankRecorder`, whose :class:`MemoryProbe` writes two
things into each rank's step records:

- ``tensors_mb``: the bytes of every live tensor (storages counted once), by owner: the policy's
  weights, their gradients, the optimizer's state, the rollout target's own tensors (the bf16 mirror,
  packed weights), the drafters (the module's and the spot trainer's, with its optimizer), and the
  rest (KV caches, buffers, anything else alive between steps), with its largest storages named by
  shape and dtype (``other_largest``);
- ``phase_peak_mb``: the process's resident memory sampled every 10 ms, its peak in each phase of the
  step (rollout, reward and training, the drafter's idle time) and before the first step.

What no tensor holds (the peak of a phase over the memory at its start: activations, logits,
Inductor's workspaces; and the libraries, code and compiled kernels under everything) is what the
two tell apart.
"""

from __future__ import annotations

import argparse
import gc
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tlt_lightning.efficiency.host_memory import malloc_mb, resident_kinds_mb, rss_mb
from tlt_lightning.rl.listeners import RolloutListener
from tlt_lightning.rollout.types import RolloutResult

__all__ = ["MemoryProbe", "run", "tensor_breakdown"]

MB = 2**20


def _storage(t: Any) -> tuple[int, int] | None:
    """``(storage address, bytes)`` of a CPU tensor (oneDNN-packed ones: their own), else ``None``."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_meta:
        return None
    if t.is_mkldnn:  # opaque (oneDNN-packed weights): no storage to share
        return id(t), t.numel() * t.element_size()
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # fake tensors (a compiler's) hold no memory
        return None


def _storages(tensors) -> dict[int, int]:
    """``{storage address: bytes}`` of ``tensors`` (views of one storage counted once)."""
    return dict(filter(None, map(_storage, tensors)))


def _module_tensors(module: nn.Module | None) -> list[torch.Tensor]:
    return [] if module is None else [*module.parameters(), *module.buffers()]


def _object_tensors(root: Any, depth: int = 4) -> list[torch.Tensor]:
    """Tensors reachable from ``root``'s attributes, lists and dicts (``depth`` levels deep)."""
    found, seen, frontier = [], set(), [root]
    for _ in range(depth):
        nxt = []
        for obj in frontier:
            if id(obj) in seen or obj is None:
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                found.append(obj)
            elif isinstance(obj, nn.Module):
                found += _module_tensors(obj)
            elif isinstance(obj, dict):
                nxt += list(obj.values())
            elif isinstance(obj, (list, tuple)):
                nxt += list(obj)
            elif hasattr(obj, "__dict__") and not isinstance(obj, type):
                nxt += list(vars(obj).values())
        frontier = nxt
    return found


def tensor_breakdown(module: Any, trainer: Any, spot: Any = None, largest: int = 8) -> dict[str, Any]:
    """MiB of every live CPU tensor by owner (each storage in the first part that holds it), under
    ``"mb"``; the ``largest`` storages of ``"other"`` (none of the parts' tensors) as
    ``"[shape] dtype MiB"`` strings, under ``"other_largest"``, to tell what they are; and what the
    process holds besides, under ``"resident_mb"`` (anonymous / file-backed) and ``"malloc_mb"`` (glibc's
    blocks in use / freed but kept), where the system tells."""
    policy = getattr(module, "policy", None)
    params = list(policy.parameters()) if policy is not None else []
    states = [v for opt in trainer.optimizers for s in opt.state.values() for v in s.values()]
    parts = {
        "policy": _module_tensors(policy),
        "grads": [p.grad for p in params if p.grad is not None],
        "optimizer": states,
        "reference": _module_tensors(getattr(module, "reference", None)),
        "rollout_target": _object_tensors(getattr(module, "rollout_target", None)),
        "drafter": _module_tensors(getattr(module, "drafter", None))
        + ([] if spot is None else _object_tensors(spot, depth=5)),
    }
    counted: dict[int, int] = {}
    out = {}
    for name, tensors in parts.items():
        mine = {k: v for k, v in _storages(tensors).items() if k not in counted}
        counted.update(mine)
        out[name] = sum(mine.values()) / MB
    gc.collect()
    rest, named = {}, {}  # each storage of the rest, named by the shape and dtype of one tensor over it
    for t in (o for o in gc.get_objects() if isinstance(o, torch.Tensor)):
        storage = _storage(t)
        if storage is not None and storage[0] not in counted and storage[0] not in rest:
            rest[storage[0]] = storage[1]
            named[storage[0]] = f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
    out["other"] = sum(rest.values()) / MB
    top = sorted(rest, key=rest.get, reverse=True)[:largest]
    return {
        "mb": _rounded(out),
        "other_largest": [f"{named[k]} {rest[k] / MB:.1f}" for k in top],
        "resident_mb": _rounded(resident_kinds_mb()),
        "malloc_mb": _rounded(malloc_mb()),
    }


def _rounded(values: dict[str, float] | None) -> dict[str, float]:
    return {k: round(v, 1) for k, v in (values or {}).items()}


class MemoryProbe(RolloutListener):
    """Samples resident memory every ``interval`` seconds; ``phase`` names what runs now.

    Phases: ``"setup"`` until the first rollout, ``"rollout"``, ``"train"`` (rewards, policy update,
    the rollout mirror's sync), ``"between"`` (the rest of a step and the time between steps: the
    spot drafter's training, checkpoints, logging). :meth:`take` returns each phase's peak since the
    last call and starts over.
    """

    def __init__(self, interval: float = 0.01) -> None:
        self.phase = "setup"
        self._peaks: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
        self._thread.start()

    def _sample(self, interval: float) -> None:
        while not self._stop.wait(interval):
            now = rss_mb() or 0.0
            with self._lock:
                self._peaks[self.phase] = max(self._peaks.get(self.phase, 0.0), now)

    def take(self) -> dict[str, float]:
        """``{phase: peak MiB}`` since the last call."""
        with self._lock:
            peaks, self._peaks = self._peaks, {}
        return {k: round(v, 1) for k, v in peaks.items()}

    def close(self) -> None:
        self._stop.set()

    def before_rollout(self) -> None:
        self.phase = "rollout"

    def after_rollout(self, result: RolloutResult) -> None:
        self.phase = "train"

    def end_step(self, module: Any, result: RolloutResult) -> None:
        self.phase = "between"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The fit of ``args.config`` with TLT for ``args.steps`` steps; prints and writes the breakdown."""
    import yaml

    from benchmarks.common import machine_info, write_json
    from benchmarks.e2e_config import absolute_drafter_paths, fit_config, read_records, summarise

    config = absolute_drafter_paths(yaml.safe_load(Path(args.config).read_text()), Path(args.config).parent)
    records, wall = fit_config(config, "memory", args)
    starts, steps = read_records(records)
    payload = {"config": args.config, "machine": machine_info(), "wall_s": wall, "ranks": {}}
    # The step's times (medians after the first, which warms up), to weigh a variant's memory against them.
    summary = summarise(steps, skip=1)
    payload["times"] = {k: summary[k] for k in ("step_s", "rollout_s", "train_s", "rollout_tokens_per_s")}
    for rank in starts:
        mine = [ranks[rank] for ranks in steps if rank < len(ranks)]
        tensors = next((r["tensors"] for r in reversed(mine) if "tensors" in r), {})
        phases: dict[str, float] = {}
        for record in mine:
            for phase, peak in record["phase_peak_mb"].items():
                phases[phase] = max(phases.get(phase, 0.0), peak)
        payload["ranks"][rank] = {
            "tensors_mb": tensors.get("mb", {}),
            "other_largest": tensors.get("other_largest", []),
            "resident_mb": tensors.get("resident_mb", {}),
            "malloc_mb": tensors.get("malloc_mb", {}),
            "phase_peak_mb": phases,
            # The kernel updates getrusage's high-water mark lazily: a sample may top it by a page or two.
            "peak_rss_mb": max([*(r["peak_rss_mb"] for r in mine), *phases.values()], default=0.0),
        }
    write_json(args.json, payload)
    print(
        "[bench memory] medians after step 1: "
        + ", ".join(f"{k} {v:.1f}" for k, v in payload["times"].items())
    )
    for rank, data in payload["ranks"].items():
        tensors = ", ".join(f"{k} {v:.0f}" for k, v in data["tensors_mb"].items())
        phases = ", ".join(f"{k} {v:.0f}" for k, v in data["phase_peak_mb"].items())
        print(f"[bench memory] rank {rank}: peak RSS {data['peak_rss_mb']:.0f} MiB")
        print(f"  tensors after the last step (MiB): {tensors}")
        print(f"  the largest of 'other': {', '.join(data['other_largest'])}")
        print(f"  peak RSS by phase (MiB): {phases}")
        kinds = {**data["resident_mb"], **{f"malloc {k}": v for k, v in data["malloc_mb"].items()}}
        print(f"  resident after the last step (MiB): {', '.join(f'{k} {v:.0f}' for k, v in kinds.items())}")
    return payload
