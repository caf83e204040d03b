"""The figure of ``python -m benchmarks rollout --speculative``: throughput or speedup per batch, and the
long tail's accept lengths and batch over time."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import new_figure, save_figure
from tlt_lightning.rollout import RolloutResult

__all__ = ["plot"]


def plot(results: dict[str, Any], long_tail: RolloutResult | None, path: Path) -> Path:
    """One panel for the fixed batches (speedup against temperature when there are several, else
    throughput per batch size) and two for the long tail (when there is one)."""
    batches, arms = results["batches"], results["strategies"]
    panels = (1 if batches else 0) + (2 if long_tail is not None else 0)
    if panels == 0:
        raise ValueError("nothing to plot: no batch workloads and no long-tail run")
    fig, axes = new_figure(1, panels, figsize=(5.3 * panels, 4.5), squeeze=False)
    axes = list(axes[0])
    temperatures = results.get("temperatures", [results["temperature"]])
    if batches and len(temperatures) > 1:
        _speedup_against_temperature(axes.pop(0), batches, arms)
    elif batches:
        _throughput_per_batch(axes.pop(0), batches, arms, results["temperature"])
    if long_tail is not None:
        _long_tail_panels(*axes, long_tail.stats)
    return save_figure(fig, path)


def _speedup_against_temperature(a: Any, batches: list[dict[str, Any]], arms: list[str]) -> None:
    """Each arm and batch size's speedup against the temperature (labels: accept length)."""
    for j, (arm, n) in enumerate(itertools.product(arms, dict.fromkeys(b["requests"] for b in batches))):
        points = [b for b in batches if b["strategy"] == arm and b["requests"] == n]
        a.plot(
            [b["temperature"] for b in points],
            [b["speedup_tokens_per_s"] for b in points],
            "o-",
            color=f"C{j}",
            label=f"{arm}, batch {n}",
        )
        for b in points:
            a.annotate(
                f"{b['mean_accept_length']:.2f}",
                (b["temperature"], b["speedup_tokens_per_s"]),
                textcoords="offset points",
                xytext=(0, 5),
                ha="center",
                fontsize=7,
                color=f"C{j}",
            )
    a.axhline(1.0, color="grey", lw=0.8, ls="--")
    a.set(
        xlabel="sampling temperature",
        ylabel="speedup over plain decoding (tokens / s)",
        title="Speedup against temperature (labels: accept length)",
    )
    a.legend(fontsize=8)


def _throughput_per_batch(a: Any, batches: list[dict[str, Any]], arms: list[str], temperature: float) -> None:
    """Plain and each arm's tokens/s per batch size (labels: speedup and accept length)."""
    sizes = list(dict.fromkeys(b["requests"] for b in batches))
    width = 0.8 / (len(arms) + 1)
    a.bar(
        [x - 0.4 + width / 2 for x in range(len(sizes))],
        [next(b for b in batches if b["requests"] == n)["plain_tokens_per_s"] for n in sizes],
        width=width,
        label="plain",
    )
    for j, arm in enumerate(arms):
        for x, n in enumerate(sizes):
            b = next(b for b in batches if b["requests"] == n and b["strategy"] == arm)
            xb = x - 0.4 + width * (j + 1.5)
            a.bar(xb, b["sd_tokens_per_s"], width=width, color=f"C{j + 1}", label=arm if x == 0 else None)
            a.text(
                xb,
                b["sd_tokens_per_s"],
                f"x{b['speedup_tokens_per_s']:.2f}\nacc {b['mean_accept_length']:.2f}",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    a.set_xticks(list(range(len(sizes))), [str(n) for n in sizes])
    a.set(
        xlabel="batch size (speculation on every step)",
        ylabel="tokens / s",
        title=f"Throughput, T={temperature:g}",
    )
    a.legend(fontsize=8)


def _long_tail_panels(b: Any, c: Any, stats: Any) -> None:
    """The long tail's accept-length histogram (``b``) and active requests over time (``c``)."""
    hist = torch.bincount(stats.accept_lengths).tolist() if stats.accept_lengths.numel() else []
    b.bar(range(len(hist)), hist)
    b.set(
        xlabel="tokens emitted per request per speculative step",
        ylabel="count",
        title="Long tail: accept-length histogram",
    )
    times = torch.tensor(stats.step_times).cumsum(0).tolist()
    c.plot(times, stats.step_batch_sizes, lw=1, label="active requests")
    spec_t = [t for t, s in zip(times, stats.step_speculative) if s]
    spec_n = [n for n, s in zip(stats.step_batch_sizes, stats.step_speculative) if s]
    c.scatter(spec_t, spec_n, s=4, color="tab:red", label="speculative step")
    c.set(xlabel="seconds", ylabel="active requests", title="Long tail: batch over time (SD run)")
    c.legend()
