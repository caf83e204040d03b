"""Run reports for every floor above ``models``: JSON files, the machine they were measured on, figures.

Figures are plain :class:`matplotlib.figure.Figure` objects drawn on Agg canvases
(:func:`new_figure`): nothing here selects a global matplotlib backend, so a notebook user's
backend stays as it was.

    fig, (a, b) = new_figure(ncols=2, figsize=(11, 4))
    a.plot(steps, losses)
    save_figure(fig, "runs/plot.png")
    write_json("runs/result.json", {"machine": machine_info(), "loss": losses})
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

from tlt_lightning.models.hardware import cpu_bf16_instructions, cpu_info

__all__ = ["machine_info", "median", "new_figure", "save_figure", "write_json"]


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
    """The median, ``nan`` for no values."""
    return float(statistics.median(values)) if values else float("nan")


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as indented JSON (creating the folder); values JSON cannot hold become strings."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def new_figure(
    nrows: int = 1, ncols: int = 1, figsize: tuple[float, float] = (6.5, 4), *, layout: str | None = None, **subplots: Any
) -> tuple[Any, Any]:
    """A figure on its own Agg canvas and its axes (as ``plt.subplots`` returns them), without pyplot.

    ``subplots`` go to ``Figure.subplots`` (``squeeze=False``, ...); ``nrows=0`` makes no axes, for a
    caller that lays out its own grid (``layout="constrained"`` then, say).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout=layout)
    FigureCanvasAgg(fig)
    return fig, (fig.subplots(nrows, ncols, **subplots) if nrows else None)


def save_figure(fig: Any, path: str | Path) -> Path:
    """Lay out (unless the figure has its own layout engine) and write a figure as PNG, creating the
    folder; a pyplot figure is closed too."""
    path = Path(path)
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    if getattr(fig.canvas, "manager", None) is not None:  # made by pyplot, which keeps it open
        import matplotlib.pyplot as plt

        plt.close(fig)
    return path
