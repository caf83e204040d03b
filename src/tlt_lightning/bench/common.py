"""Shared benchmark plumbing: machine description, task prompts, interleaved timing, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tlt_lightning.models.hardware import cpu_bf16_instructions, cpu_info

__all__ = ["machine_info", "median", "save_figure", "task_prompts", "timed", "write_json"]


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on (no host names or paths)."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_info("model name") or None,
        # Vendors' model names can hide the generation ("AMD EPYC"): family/model tell them apart.
        "cpu_family_model": "/".join(filter(None, (cpu_info("cpu family"), cpu_info("model")))) or None,
        # The bf16 matrix instructions decide whether bfloat16 decoding is faster than float32 here.
        "cpu_bf16": cpu_bf16_instructions(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """Run ``fn``; return its result, wall-clock seconds and this process's CPU seconds.

    On a shared machine the wall clock also counts time spent waiting for a core; with one torch
    thread the CPU time counts only the work done, so CPU-time ratios are the steadier comparison.
    Benchmarks report both.
    """
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - start, time.process_time() - cpu


def task_prompts(tokenizer: Any, task: str, count: int, seed: int = 0) -> list[list[int]]:
    """``count`` real task prompts rendered with the model's chat template."""
    from tlt_lightning.rl.tasks import TaskConfig, TaskDataset

    dataset = TaskDataset(TaskConfig(name=task, size=count, seed=seed), tokenizer)
    return [list(dataset[i].input_ids) for i in range(count)]


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def save_figure(fig: Any, path: str | Path) -> Path:
    """Lay out, write (creating the folder) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
