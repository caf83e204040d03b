"""Shared benchmark plumbing: timing, and (from where the library keeps them) machine description, task
prompts, JSON output and figures."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tlt_lightning.reports import machine_info, median, new_figure, save_figure, write_json
from tlt_lightning.rl.tasks import task_prompts

__all__ = [
    "compile_report",
    "machine_info",
    "median",
    "new_figure",
    "prompt_groups",
    "save_figure",
    "task_prompts",
    "timed",
    "write_json",
]


def prompt_groups(prompts: list[list[int]], size: int, repeats: int) -> list[list[list[int]]]:
    """The ``repeats`` groups of ``size`` prompts the timed runs use: group ``r`` is the ``r``-th slice,
    wrapping around, so small batches average over several prompts."""
    return [
        (prompts[r * size % len(prompts) :] + prompts[: r * size % len(prompts)])[:size]
        for r in range(repeats)
    ]


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """Run ``fn``; return its result, wall-clock seconds and this process's CPU seconds.

    On a shared machine the wall clock also counts time spent waiting for a core; with one torch
    thread the CPU time counts only the work done, so CPU-time ratios are the steadier comparison.
    Benchmarks report both.
    """
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - start, time.process_time() - cpu


def compile_report(target: Any) -> dict[str, Any]:
    """Compile time of a ``decode="compiled"`` target so far, to report apart from decoding.

    Returns ``{"compile_seconds": total, "compile_buckets": [{"batch", "queries", "kv_len",
    "feature_layers", "all_slots", "seconds"}, ...]}`` (zero and empty for other targets).
    """
    times = getattr(target, "compile_times", {})
    return {
        "compile_seconds": sum(times.values()),
        "compile_buckets": [
            {**b._asdict(), "feature_layers": list(b.feature_layers), "seconds": s} for b, s in times.items()
        ],
    }
