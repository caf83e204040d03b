"""Heat maps of a bucketed strategy's arm choices over time (:meth:`BucketedStrategy.heatmap_data`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["draw_heatmaps", "save_heatmaps"]

Rows = list[tuple[str, list[str], list[list[float]]]]


def save_heatmaps(edges: list[float], rows: Rows, title: str, path: str | Path) -> Path:
    """Draw ``rows`` (one heat map per bucket) on an Agg canvas and save it as a PNG; returns the path."""
    from tlt_lightning.reports import new_figure

    fig, axes = new_figure(1, len(rows), figsize=(4 * len(rows), 3.2), layout="constrained", squeeze=False)
    draw_heatmaps(axes[0], edges, rows)
    fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def draw_heatmaps(axes: Sequence[Any], edges: list[float], rows: Rows):
    """Draw :meth:`BucketedStrategy.heatmap_data` on matplotlib ``axes`` (one per bucket)."""
    for ax, (label, keys, matrix) in zip(axes, rows):
        image = ax.imshow(
            matrix,
            aspect="auto",
            vmin=0.0,
            vmax=1.0,
            cmap="viridis",
            interpolation="nearest",
            extent=(edges[0], edges[-1], len(keys) - 0.5, -0.5),
        )
        ax.set_yticks(range(len(keys)), keys)
        ax.set_title(f"batch {label}")
        ax.set_xlabel("update step")
    if rows:
        axes[-1].figure.colorbar(image, ax=list(axes), label="fraction of choices")
