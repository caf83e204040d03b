"""What the spot drafter reports: per-step metrics from the summed step statistics, the workers'
timeline (BUSY / IDLE / TRAINING) as a Gantt chart and the idle fraction it recovered."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tlt_lightning.spot.coordinator import Segment, WorkerState

__all__ = ["idle_fraction_recovered", "plot_timeline", "step_metrics", "timeline_view"]


def step_metrics(total: dict[str, float], world_size: int, version: int) -> dict[str, float]:
    """The ``drafter/*`` metrics of one RL step from :meth:`SpotDrafter.end_step`'s sums over ranks.

    ``drafter/loss``, ``drafter/top1`` (mean over this step's drafter steps, when there were any),
    ``drafter/version``, ``drafter/steps`` = ``tail_steps`` + ``paid_steps``, ``drafter/train_seconds``
    (tail + paid), ``drafter/paid_seconds``, ``drafter/idle_seconds`` (idle and not training),
    ``drafter/idle_fraction_recovered`` (tail training over idle + tail training time: ``0`` for a
    single worker, which has no idle time), ``drafter/overhead_fraction`` (paid seconds over the RL
    step without them), ``drafter/saved_seconds`` (what the rollouts' speculative steps saved against
    plain decoding, :mod:`~tlt_lightning.spot.savings`), ``drafter/buffer_mb`` and
    ``drafter/buffer_tokens`` (per rank) and ``drafter/preemption_latency_s`` (when a tail window
    was preempted).

    Example:
        >>> from tlt_lightning.spot import STEP_STATS
        >>> total = {**dict.fromkeys(STEP_STATS, 0.0), "paid_steps": 2.0, "paid_s": 0.5, "step_s": 2.0}
        >>> m = step_metrics(total, world_size=1, version=3)
        >>> m["drafter/steps"], m["drafter/overhead_fraction"], m["drafter/version"]
        (2.0, 0.25, 3.0)
    """
    steps, idle_pool = total["tail_steps"] + total["paid_steps"], total["tail_s"] + total["idle_s"]
    metrics = {
        "drafter/version": float(version),
        "drafter/steps": steps,
        "drafter/tail_steps": total["tail_steps"],
        "drafter/paid_steps": total["paid_steps"],
        "drafter/train_seconds": total["tail_s"] + total["paid_s"],
        "drafter/paid_seconds": total["paid_s"],
        "drafter/idle_seconds": total["idle_s"],
        "drafter/idle_fraction_recovered": total["tail_s"] / idle_pool if idle_pool > 0 else 0.0,
        "drafter/overhead_fraction": total["paid_s"] / max(1e-9, total["step_s"]),
        "drafter/saved_seconds": total["saved_s"],
        "drafter/buffer_mb": total["buffer_mb"] / world_size,
        "drafter/buffer_tokens": total["buffer_tokens"] / world_size,
    }
    if steps > 0:
        metrics["drafter/loss"] = total["loss"] / steps
        metrics["drafter/top1"] = total["top1"] / steps
    if total["latency_n"] > 0:
        metrics["drafter/preemption_latency_s"] = total["latency_sum"] / total["latency_n"]
    return metrics


def _without(segment: Segment, cuts: list[Segment]) -> list[Segment]:
    """``segment`` minus the time spans of ``cuts`` (of the same worker)."""
    pieces = [(segment.start, segment.end)]
    for cut in cuts:
        if cut.worker != segment.worker:
            continue
        pieces = [
            piece
            for a, b in pieces
            for piece in ([(a, b)] if cut.end <= a or cut.start >= b else [(a, cut.start), (cut.end, b)])
            if piece[1] > piece[0]
        ]
    return [Segment(segment.worker, segment.state, a, b) for a, b in pieces]


def timeline_view(segments: list[Segment], paid: list[Segment]) -> tuple[list[Segment], float, float]:
    """What the Gantt chart shows: the coordinator's ``segments`` with the ``paid`` training spans
    drawn as TRAINING where the coordinator saw the worker BUSY; the idle fraction recovered (the
    coordinator's TRAINING is idle time only); paid training seconds per worker.

    Example:
        >>> from tlt_lightning.spot import WorkerState
        >>> busy = Segment(0, WorkerState.BUSY, 0.0, 4.0)
        >>> shown, recovered, paid_s = timeline_view([busy], [Segment(0, WorkerState.TRAINING, 3.0, 4.0)])
        >>> [(s.state.value, s.start, s.end) for s in shown], recovered, paid_s
        ([('busy', 0.0, 3.0), ('training', 3.0, 4.0)], 0.0, 1.0)
    """
    shown = [piece for s in segments for piece in _without(s, paid)] + paid
    per_worker = sum(s.end - s.start for s in paid) / max(1, len({s.worker for s in segments}))
    return shown, idle_fraction_recovered(segments), per_worker


def idle_fraction_recovered(timeline: Sequence[Segment]) -> float:
    """TRAINING time over IDLE + TRAINING time: the share of idle worker time spent on the drafter."""
    train = sum(s.end - s.start for s in timeline if WorkerState(s.state) is WorkerState.TRAINING)
    idle = sum(s.end - s.start for s in timeline if WorkerState(s.state) is WorkerState.IDLE)
    return train / (train + idle) if train + idle > 0 else 0.0


_COLOURS = {WorkerState.BUSY: "#4C72B0", WorkerState.IDLE: "#D0D0D0", WorkerState.TRAINING: "#55A868"}


def plot_timeline(timeline: Sequence[Segment], path: str | Path, title: str | None = None) -> Path:
    """Save a per-worker Gantt chart (BUSY / IDLE / TRAINING) of ``timeline`` as a PNG.

    Example:
        >>> # plot_timeline(coord.gather_timeline(since=step_start), "timeline.png")
    """
    from tlt_lightning.reports import new_figure, save_figure

    if not timeline:
        raise ValueError("timeline is empty: nothing to plot")
    t0 = min(s.start for s in timeline)
    workers = sorted({s.worker for s in timeline})
    fig, ax = new_figure(figsize=(10, 0.6 * len(workers) + 1.4))  # without matplotlib: names the plots extra
    from matplotlib.patches import Patch

    for row, worker in enumerate(workers):
        for state in WorkerState:
            spans = [
                (s.start - t0, s.end - s.start)
                for s in timeline
                if s.worker == worker and WorkerState(s.state) is state
            ]
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=_COLOURS[state])
    ax.set_yticks(range(len(workers)), [f"worker {w}" for w in workers])
    ax.set_xlabel("seconds")
    ax.invert_yaxis()
    recovered = idle_fraction_recovered(timeline)
    ax.set_title(title or f"worker timeline (idle fraction recovered: {recovered:.0%})", loc="left")
    ax.legend(
        handles=[Patch(color=c, label=s.value.upper()) for s, c in _COLOURS.items()],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=3,
        frameon=False,
    )
    return save_figure(fig, path)
