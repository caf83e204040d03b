"""Plots of rollout statistics for run tracking (PNG files a logger can attach as artifacts).

They need matplotlib, the ``plots`` extra (:func:`tlt_lightning.reports.new_figure` says how to install
it); a fit's callbacks draw them through :func:`tlt_lightning.reports.draw_or_skip`, which skips them with
a warning instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

__all__ = ["plot_accept_lengths"]


def plot_accept_lengths(
    steps: Sequence[int], means: Sequence[float], histogram: Sequence[int], path: str | Path
) -> Path:
    """Mean accept length per RL step (left) and the histogram of per-request accept lengths (right).

    Args:
        steps: RL steps.
        means: mean accept length of each step's speculative steps (``NaN``: none ran; the step is
            left out of the plot).
        histogram: ``histogram[k]`` = how many request-steps emitted ``k`` tokens over the fit.
        path: PNG path (its folder is created).
    """
    from tlt_lightning.reports import new_figure, save_figure

    ran = [(step, mean) for step, mean in zip(steps, means) if math.isfinite(mean)]
    fig, (a, b) = new_figure(1, 2, figsize=(11, 3.8))
    a.plot([step for step, _ in ran], [mean for _, mean in ran], marker="o")
    a.set(xlabel="RL step", ylabel="mean accept length", title="Tokens per speculative step")
    b.bar(range(len(histogram)), list(histogram))
    b.set(xlabel="tokens emitted per request-step", ylabel="count", title="Accept lengths over the fit")
    return save_figure(fig, path)
