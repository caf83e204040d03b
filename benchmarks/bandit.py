"""``python -m benchmarks bandit``: BEG-MAB vs UCB vs every fixed arm on the simulated environment.

:class:`~tlt_lightning.scheduling.SimulatedSDEnvironment` knows its best arm per bucket, so every
strategy is judged against that oracle on the same batch sizes and noise, with a drafter that gets
worse halfway through (which changes the best arm of some buckets). Seconds on one core.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tlt_lightning.reports import new_figure
from tlt_lightning.scheduling import (
    BEGMABStrategy,
    BucketedStrategy,
    FixedStrategy,
    SimulatedSDEnvironment,
    UCBStrategy,
)
from tlt_lightning.scheduling.bucketed import default_arms
from tlt_lightning.scheduling.heatmap import draw_heatmaps
from tlt_lightning.scheduling.simulate import run_strategy
from tlt_lightning.speculative import arm_key

__all__ = ["main", "plot_benchmark", "run", "run_bandit_benchmark"]


def _summarise(
    trace: list[dict[str, Any]],
    strategy: BucketedStrategy,
    change_at: int | None,
    majority: int,
    burn_in: int,
):
    """Best-arm fractions per bucket and phase, and steps to follow the change (see the benchmark)."""
    end = len(trace) if change_at is None else change_at
    settle = None if change_at is None else change_at + (len(trace) - change_at) // 2
    fractions: dict[str, dict[str, float | None]] = {}
    follow: dict[str, dict[str, int | None]] = {}
    for b, label in enumerate(strategy.bucket_labels):
        rows = [r for r in trace if strategy.bucket_of(r["batch_size"]) == b and r["mode"] == "exploit"]
        if not rows:
            continue

        def frac(rs):
            return sum(r["arm"] == r["best"] for r in rs) / len(rs) if rs else None

        fractions[label] = {
            "before_change": frac([r for r in rows if r["step"] < end]),
            "before_change_after_burn_in": frac([r for r in rows if burn_in <= r["step"] < end]),
        }
        if change_at is None:
            continue
        fractions[label]["after_change_settled"] = frac([r for r in rows if r["step"] >= settle])
        before = [r for r in trace if r["step"] < change_at and strategy.bucket_of(r["batch_size"]) == b]
        after = [r for r in trace if r["step"] >= change_at and strategy.bucket_of(r["batch_size"]) == b]
        if not before or not after or before[-1]["best"] == after[0]["best"]:
            continue
        # First step at which a majority of the last `majority` exploit decisions pick the new best.
        recent: deque[bool] = deque(maxlen=majority)
        steps = bucket_steps = None
        bucket_step = 0
        for r in after:
            bucket_step += 1
            if r["mode"] != "exploit":
                continue
            recent.append(r["arm"] == r["best"])
            if len(recent) == majority and sum(recent) > majority // 2:
                steps, bucket_steps = r["step"] - change_at, bucket_step
                break
        follow[label] = {"steps": steps, "bucket_steps": bucket_steps}
    return fractions, follow


def _strategies(epsilon: float, window: int, seed: int, ucb_c: float) -> dict[str, BucketedStrategy]:
    """BEG-MAB (constant and decaying exploration), UCB and every fixed arm."""
    return {
        "begmab": BEGMABStrategy(epsilon=epsilon, window=window, seed=seed),
        # Exploration decaying per bucket to a 1% floor: cheaper once known, slower to follow a change.
        "begmab-decay": BEGMABStrategy(
            epsilon=epsilon,
            window=window,
            seed=seed,
            epsilon_half_life=window,
            epsilon_floor=min(0.01, epsilon),
        ),
        "ucb": UCBStrategy(c=ucb_c, window=window),
        **{f"fixed:{arm_key(arm)}": FixedStrategy(arm) for arm in default_arms()},
    }


def _results(
    strategies: dict[str, BucketedStrategy],
    traces: dict[str, list[dict[str, Any]]],
    change_at: int,
    majority: int,
    burn_in: int,
) -> dict[str, Any]:
    """Each strategy's total reward, reward against the oracle, best-arm fractions and change following."""
    results: dict[str, Any] = {}
    for name, strategy in strategies.items():
        trace = traces[name]
        # Fixed arms have one bucket; judge every strategy on the bandit's buckets.
        fractions, follow = _summarise(
            trace,
            strategies["begmab"] if name.startswith("fixed") else strategy,
            change_at,
            majority,
            burn_in,
        )
        results[name] = {
            "total_reward": sum(r["reward"] for r in trace),
            "reward_vs_oracle": statistics.fmean(r["reward"] / r["oracle"] for r in trace),
            "best_arm_fraction": fractions,
            "steps_to_follow_change": follow,
        }
    return results


def run_bandit_benchmark(
    steps: int = 8000,
    seed: int = 0,
    change_at: int | None = None,
    epsilon: float = 0.1,
    window: int = 300,
    ucb_c: float = 0.05,
    majority: int = 20,
    burn_in: int | None = None,
    return_traces: bool = False,
) -> dict[str, Any]:
    """BEG-MAB vs UCB vs every fixed arm on :class:`SimulatedSDEnvironment` (same batch sizes and noise).

    Per strategy: ``total_reward`` (sum of per-step tokens/s), ``reward_vs_oracle`` (mean of
    reward / the best arm's expected reward), ``best_arm_fraction`` per bucket (exploit decisions
    picking the best arm: all of them before the change; those between ``burn_in`` and the change,
    once the medians rest on several samples per arm; those in the second half after the change),
    ``steps_to_follow_change`` per bucket whose best arm changed (steps after the change until a
    majority of the last ``majority`` exploit decisions in the bucket pick the new best arm, in
    global ``steps`` and in the bucket's own ``bucket_steps``; ``None`` if never), and
    ``total_reward_vs_best_fixed``.

    Args:
        steps: simulated decode steps; ``change_at`` defaults to ``steps // 2``.
        burn_in: first step of the converged before-change phase; defaults to ``change_at // 4``.
        return_traces: also return the per-step traces (``traces``) and the strategy objects
            (``strategy_objects``; neither is JSON-serialisable).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    change_at = steps // 2 if change_at is None else change_at
    burn_in = change_at // 4 if burn_in is None else burn_in
    env_args = {"change_at": change_at, "seed": seed}
    strategies = _strategies(epsilon, window, seed, ucb_c)
    env = SimulatedSDEnvironment(**env_args)
    probe = strategies["begmab"]
    best = {
        phase: {
            probe.bucket_labels[probe.bucket_of(bs)]: arm_key(env.best_arm(bs, t)) for bs in env.batch_sizes
        }
        for phase, t in (("before_change", 0), ("after_change", change_at))
    }
    traces = {
        name: run_strategy(strategy, SimulatedSDEnvironment(**env_args), steps)
        for name, strategy in strategies.items()
    }
    results = _results(strategies, traces, change_at, majority, burn_in)
    best_fixed = max((n for n in results if n.startswith("fixed")), key=lambda n: results[n]["total_reward"])
    for res in results.values():
        res["total_reward_vs_best_fixed"] = res["total_reward"] / results[best_fixed]["total_reward"]
    out = {
        "config": {
            "steps": steps,
            "seed": seed,
            "change_at": change_at,
            "epsilon": epsilon,
            "window": window,
            "ucb_c": ucb_c,
            "majority": majority,
            "burn_in": burn_in,
            "buckets": list(probe.bucket_labels),
            "environment": {k: v for k, v in asdict(env).items() if not k.startswith("_")},
        },
        "best_arms": best,
        "best_fixed": best_fixed,
        "strategies": results,
    }
    if return_traces:
        out["traces"], out["strategy_objects"] = traces, strategies
    return out


def _moving_average(values: list[float], width: int) -> list[float]:
    out, acc, q = [], 0.0, deque()
    for v in values:
        q.append(v)
        acc += v
        if len(q) > width:
            acc -= q.popleft()
        out.append(acc / len(q))
    return out


def plot_benchmark(result: dict[str, Any], path: str | Path, smooth: int = 200) -> Path:
    """PNG: reward / oracle over time per strategy (top) and BEG-MAB's heat map (bottom)."""
    traces, bandit = result["traces"], result["strategy_objects"]["begmab"]
    edges, rows = bandit.heatmap_data(num_bins=40)
    fig, _ = new_figure(0, figsize=(4 * len(rows), 8), layout="constrained")
    grid = fig.add_gridspec(2, len(rows), height_ratios=(1.2, 1))
    ax = fig.add_subplot(grid[0, :])
    shown = ["begmab", "begmab-decay", "ucb", result["best_fixed"]]
    for name, trace in traces.items():
        ratio = _moving_average([r["reward"] / r["oracle"] for r in trace], smooth)
        ax.plot(ratio, lw=1.6 if name in shown else 0.7, alpha=1.0 if name in shown else 0.5, label=name)
    if result["config"]["change_at"] is not None:
        ax.axvline(result["config"]["change_at"], color="k", ls="--", lw=1, label="drafter changes")
    ax.set_xlabel("decode step")
    ax.set_ylabel(f"reward / best arm's (moving mean, {smooth} steps)")
    ax.legend(fontsize=7, ncol=3)
    draw_heatmaps([fig.add_subplot(grid[1, i]) for i in range(len(rows))], edges, rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def main(
    json_path: str | Path, plot_path: str | Path | None = None, steps: int = 8000, seed: int = 0
) -> dict:
    """Run the benchmark, write its JSON to ``json_path`` and, if given, the PNG to ``plot_path``."""
    result = run_bandit_benchmark(steps=steps, seed=seed, return_traces=plot_path is not None)
    if plot_path is not None:
        plot_benchmark(result, plot_path)
        result.pop("traces"), result.pop("strategy_objects")
        result["plot"] = str(plot_path)
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2))
    return result


def run(args: argparse.Namespace) -> None:
    """``python -m benchmarks bandit``: the JSON at ``--json``, the PNG at ``--plot`` (default: beside it)."""
    plot = args.plot or str(Path(args.json).with_suffix(".png"))
    result = main(args.json, plot, steps=args.steps, seed=args.seed)
    ratios = {name: round(v["reward_vs_oracle"], 3) for name, v in result["strategies"].items()}
    print(f"[bench bandit] reward / per-bucket oracle: {json.dumps(ratios)}")
    print(f"[bench bandit] wrote {args.json} and {plot}")
