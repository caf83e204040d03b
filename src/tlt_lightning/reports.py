"""Run reports for every floor above ``models``: JSON files, the machine they were measured on, figures.

Figures are plain :class:`matplotlib.figure.Figure` objects drawn on Agg canvases
(:func:`new_figure`): nothing here selects a global matplotlib backend, so a notebook user's
backend stays as it was. matplotlib is the ``plots`` extra: without it :func:`new_figure` raises an
``ImportError`` that says how to install it, and code that draws along the way (a fit's callbacks)
goes through :func:`draw_or_skip`, which warns and skips the picture instead.

    fig, (a, b) = new_figure(ncols=2, figsize=(11, 4))
    a.plot(steps, losses)
    save_figure(fig, "runs/plot.png")
    write_json("runs/result.json", {"machine": machine_info(), "loss": losses})
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from tlt_lightning.models.hardware import cpu_bf16_instructions, cpu_info
from tlt_lightning.validation import MissingExtraError

__all__ = [
    "draw_or_skip",
    "machine_info",
    "median",
    "new_figure",
    "require_matplotlib",
    "save_figure",
    "write_json",
]

PLOTS_INSTALL = "pip install 'tlt-lightning[plots]'"
T = TypeVar("T")


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


def require_matplotlib() -> None:
    """Raise an ``ImportError`` naming the ``plots`` extra unless matplotlib imports.

    Example:
        >>> require_matplotlib()  # matplotlib is installed here: nothing happens
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise MissingExtraError(f"figures need matplotlib (the plots extra): {PLOTS_INSTALL}") from err


def draw_or_skip(draw: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """``draw(*args, **kwargs)``, or ``None`` and a ``UserWarning`` (once per process) without matplotlib.

    For pictures drawn along the way (a fit's callbacks, a warm-up's curves): a missing matplotlib
    never ends the run that produced the numbers. Call :func:`new_figure` itself where the picture
    is the point.

    Example:
        >>> draw_or_skip(lambda title: f"drew {title}", "loss.png")  # with matplotlib installed
        'drew loss.png'
    """
    try:
        require_matplotlib()
    except ImportError:
        warn_no_matplotlib()
        return None
    return draw(*args, **kwargs)


@functools.cache
def warn_no_matplotlib() -> None:
    """The ``UserWarning`` of :func:`draw_or_skip`, once per process however many pictures it skips."""
    warnings.warn(
        f"matplotlib is not installed: pictures (PNG) are skipped; {PLOTS_INSTALL} draws them",
        UserWarning,
        stacklevel=3,
    )


def new_figure(
    nrows: int = 1,
    ncols: int = 1,
    figsize: tuple[float, float] = (6.5, 4),
    *,
    layout: str | None = None,
    **subplots: Any,
) -> tuple[Any, Any]:
    """A figure on its own Agg canvas and its axes (as ``plt.subplots`` returns them), without pyplot.

    ``subplots`` go to ``Figure.subplots`` (``squeeze=False``, ...); ``nrows=0`` makes no axes, for a
    caller that lays out its own grid (``layout="constrained"`` then, say). Without matplotlib an
    ``ImportError`` naming ``pip install 'tlt-lightning[plots]'``.
    """
    require_matplotlib()
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
