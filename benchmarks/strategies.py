"""``python -m benchmarks strategies``: BEG-MAB vs every fixed SD arm vs no SD on a real long-tail rollout.

The same prompts, seeds, model and drafter for every run; only the strategy differs. Each
fixed arm is applied at every step below ``--threshold`` active requests (above it every run
decodes plainly), and each BEG-MAB variant (``--bandits``) chooses among the same arms. The bandits
keep their state across rollouts, as they do across RL steps: they first learn on
``--warm-rollouts`` rollouts of other prompts of the task, then the measured groups run. Runs are
interleaved group by group (every run rolls out group ``k`` before any run starts group ``k + 1``,
"SD off" first and again last), so a drift of the machine's speed hits every run alike, and the
two identical "SD off" runs measure the timing noise (``off_runs_ratio``). Times are CPU times (one
torch thread): on a shared machine the wall clock counts waiting for a core, the CPU time the work
done. Wall-clock figures are reported alongside.

At T=1 every run samples its own responses, and the mix of batch sizes they are decoded at varies
from run to run (one run's longest responses may decode among few others for 300 steps, another's
for 30): on SmolLM2 on a CPU a token costs ~9x more at batch 2 than at batch 32, so raw time per
token also measures how long each run's tail happened to be. Runs are therefore ranked by their
*standardised* cost (:func:`standardized_ms_per_token`): each run's decode time per token at each
batch size, weighted by how many tokens the "SD off" runs decoded at that batch size, so every run
is scored on the same workload mix. Raw CPU time per token is reported next to it.

Goal (issue): the bandit within 5% of the best fixed arm in hindsight, better than the others.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks.common import (
    machine_info,
    median,
    new_figure,
    save_figure,
    task_prompts,
    timed,
    write_json,
)
from tlt_lightning.drafter import load_drafter
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.scheduling.bandit import BEGMABStrategy
from tlt_lightning.scheduling.baselines import FixedStrategy
from tlt_lightning.scheduling.bucketed import default_arms
from tlt_lightning.speculative import arm_key, parse_arm

__all__ = ["run"]


def standardized_ms_per_token(by_batch: dict[int, tuple[float, int]], weights: dict[int, int]) -> float:
    """Decode milliseconds per token of a run, re-weighted to a reference mix of batch sizes.

    Args:
        by_batch: the run's ``{batch_size: (decode seconds, tokens)}`` (CPU or wall seconds).
        weights: ``{batch_size: tokens}`` of the reference run(s).

    Returns:
        ``sum_b w_b * cost_b / sum_b w_b`` with ``cost_b`` the run's ms per token at batch size
        ``b``; a batch size the run never decoded at takes the cost at the nearest one it did.

    Example:
        >>> standardized_ms_per_token({1: (0.5, 10), 8: (0.2, 40)}, {1: 100, 8: 100, 9: 200})
        16.25
    """
    cost = {b: 1e3 * sec / tok for b, (sec, tok) in by_batch.items() if tok > 0}
    if not cost:
        raise ValueError("the run decoded no tokens")
    total = sum(weights.values())
    if total <= 0:
        raise ValueError("the reference decoded no tokens")

    def at(b: int) -> float:
        return cost[b] if b in cost else cost[min(cost, key=lambda c: (abs(c - b), c))]

    return sum(w * at(b) for b, w in weights.items()) / total


def parse_bandit_spec(spec: str) -> tuple[bool, tuple[int, ...]]:
    """``"REWARD/THRESHOLDS"`` -> ``(per_request, bucket_thresholds)`` of a BEG-MAB variant.

    Example:
        >>> parse_bandit_spec("request/1,2,3,5,8")
        (True, (1, 2, 3, 5, 8))
    """
    reward, _, thresholds = spec.partition("/")
    try:
        values = tuple(int(t) for t in thresholds.split(","))
    except ValueError:
        values = ()
    if reward not in ("batch", "request") or not values:
        raise ValueError(
            f"--bandits {spec!r} is not REWARD/THRESHOLDS with REWARD 'batch' or 'request' and "
            "comma-separated ints, e.g. batch/1,2,5,21"
        )
    return reward == "request", values


def _add_rollout(acc: dict[str, Any], result, wall: float, cpu: float) -> None:
    """Add one rollout's totals and per-batch-size decode CPU time to a run's accumulator."""
    stats = result.stats
    for b, sec, tok in zip(stats.step_batch_sizes, stats.step_cpu_times, stats.step_tokens):
        cell = acc["by_batch_size"].setdefault(b, [0.0, 0])
        cell[0] += sec
        cell[1] += tok
    acc["groups"].append(
        {
            "seconds": wall,
            "cpu_seconds": cpu,
            "tokens": stats.generated_tokens,
            "steps": stats.num_steps,
            "sd_steps": sum(stats.step_speculative),
            "mean_accept_length": stats.mean_accept_length,
        }
    )


def _summarize(acc: dict[str, Any]) -> dict[str, Any]:
    """Totals over a run's groups, its mean accept length and raw CPU ms per token."""
    parts = acc["groups"]
    total = {k: sum(p[k] for p in parts) for k in ("seconds", "cpu_seconds", "tokens", "steps", "sd_steps")}
    accepts = [p["mean_accept_length"] for p in parts if p["sd_steps"]]
    return total | {
        "mean_accept_length": sum(accepts) / len(accepts) if accepts else 0.0,
        "cpu_ms_per_token": 1e3 * total["cpu_seconds"] / max(1, total["tokens"]),
        "by_batch_size": {b: acc["by_batch_size"][b] for b in sorted(acc["by_batch_size"])},
        "groups": parts,
    }


def plot(payload: dict[str, Any], bandit: BEGMABStrategy, path: Path) -> Path:
    from tlt_lightning.scheduling.heatmap import draw_heatmaps

    runs = payload["runs"]
    names = list(runs)
    edges, rows = bandit.heatmap_data(num_bins=10)
    fig, _ = new_figure(0, figsize=(6 + 3.2 * len(rows), 4.2), layout="constrained")
    grid = fig.add_gridspec(1, 1 + len(rows), width_ratios=[2] + [1] * len(rows))
    a = fig.add_subplot(grid[0])
    colors = [
        "tab:red" if n.startswith("BEG-MAB") else "tab:gray" if n.startswith("off") else "tab:blue"
        for n in names
    ]
    a.barh(names, [runs[n]["std_ms_per_token"] for n in names], color=colors)
    for i, n in enumerate(names):
        label = f" {runs[n]['speedup_vs_off']:.2f}x (raw {runs[n]['cpu_ms_per_token']:.2f})"
        a.text(runs[n]["std_ms_per_token"], i, label, va="center", fontsize=8)
    a.invert_yaxis()
    a.set(
        xlabel="decode ms per token on the off runs' batch-size mix (lower is better)",
        title=f"{payload['groups']} x {payload['requests']} requests, SD below {payload['threshold']} active",
    )
    draw_heatmaps([fig.add_subplot(grid[1 + i]) for i in range(len(rows))], edges, rows)
    return save_figure(fig, path)


def _arms_and_bandits(args: argparse.Namespace) -> tuple[tuple[Any, ...], dict[str, BEGMABStrategy]]:
    """The fixed arms (``off`` among them) and a fresh bandit per ``--bandits`` spec, checked."""
    for name in ("requests", "groups", "max_new_tokens", "threshold"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warm_rollouts < 0:
        raise ValueError(f"--warm-rollouts must be >= 0, got {args.warm_rollouts}")
    arms = default_arms() if args.arms is None else tuple(dict.fromkeys(parse_arm(a) for a in args.arms))
    if None not in arms:
        raise ValueError(
            f"--arms must include 'off' (the baseline every arm is compared with), got {args.arms}"
        )
    bandits: dict[str, BEGMABStrategy] = {}
    for spec in dict.fromkeys(args.bandits):
        per_request, thresholds = parse_bandit_spec(spec)
        bandits[f"BEG-MAB {spec}"] = BEGMABStrategy(
            arms,
            thresholds,
            epsilon=args.epsilon,
            seed=args.seed,
            epsilon_half_life=args.epsilon_half_life,
            per_request=per_request,
        )
    return arms, bandits


def _standardize(runs: dict[str, dict[str, Any]], arms: tuple[Any, ...]) -> dict[str, float]:
    """Add each run's ms per token on the off runs' batch-size mix and its speedup over off; returns
    the fixed arms' (and off's) standardised ms per token."""
    mix = {b: tok for b, (_, tok) in runs["off"]["by_batch_size"].items()}  # both off runs decode the same
    for r in runs.values():
        r["std_ms_per_token"] = standardized_ms_per_token(r["by_batch_size"], mix)
    off = median([runs["off"]["std_ms_per_token"], runs["off (again)"]["std_ms_per_token"]])
    for r in runs.values():
        r["speedup_vs_off"] = off / r["std_ms_per_token"]
    return {arm_key(a): runs[arm_key(a)]["std_ms_per_token"] for a in arms if a is not None} | {"off": off}


def _bandit_report(
    bandits: dict[str, BEGMABStrategy],
    runs: dict[str, dict[str, Any]],
    fixed: dict[str, float],
    warm_counts: dict[str, Any],
) -> dict[str, dict[str, Any]]:
    """Each bandit against the best and worst fixed arm, what it chose and why."""
    best, worst = min(fixed, key=fixed.get), max(fixed, key=fixed.get)
    return {
        name: {
            "vs_best_fixed": fixed[best] / runs[name]["std_ms_per_token"],
            "vs_worst_fixed": fixed[worst] / runs[name]["std_ms_per_token"],
            "best_arms": {k: arm_key(v) for k, v in bandit.best_arms().items()},
            "counts": bandit.counts,  # warm-up included
            "measured_counts": {
                label: {arm: c - warm_counts[name][label][arm] for arm, c in row.items()}
                for label, row in bandit.counts.items()
            },
            "values": bandit.values(),  # the statistic each bucket compares: why it chose what it chose
        }
        for name, bandit in bandits.items()
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    arms, bandits = _arms_and_bandits(args)
    loaded = load_model(args.model, dtype=args.dtype)
    if loaded.tokenizer is None:
        raise ValueError(f"--model {args.model!r} has no tokenizer: the benchmark needs real task prompts")
    target = HFTarget(loaded.model)
    target.set_weight_layout(args.weight_layout)
    drafter = load_drafter(args.drafter, target).eval()
    n = args.requests
    g = args.groups
    prompts = task_prompts(loaded.tokenizer, args.task, n * (g + args.warm_rollouts), seed=args.seed)
    measured, warm = [prompts[i * n : (i + 1) * n] for i in range(g)], prompts[g * n :]
    cfg = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)

    def rollout(strategy, prompts: list[list[int]], seed: int):
        loop = SpeculativeRolloutLoop(target, drafter, cfg, strategy, threshold=args.threshold)
        return timed(functools.partial(loop.generate, prompts, generator=torch.Generator().manual_seed(seed)))

    for name, bandit in bandits.items():  # the bandits keep learning across rollouts, as across RL steps
        for i in range(args.warm_rollouts):
            print(f"[bench strategies] {name}: warm-up rollout {i + 1}/{args.warm_rollouts} ...", flush=True)
            rollout(bandit, warm[i * n : (i + 1) * n], args.seed + 1 + i)
    warm_counts = {name: bandit.counts for name, bandit in bandits.items()}
    strategies = {arm_key(a): FixedStrategy(a) for a in arms if a is not None} | bandits
    acc = {name: {"by_batch_size": {}, "groups": []} for name in ("off", *strategies, "off (again)")}
    for k, group in enumerate(tqdm(measured, desc="bench strategies: prompt groups", unit="group")):
        # Every run rolls out this group before the next one starts, so a drift of the machine's
        # speed hits all runs alike; "SD off" brackets the group, the others alternate their order.
        middle = list(strategies) if k % 2 == 0 else list(reversed(strategies))
        for name in ("off", *middle, "off (again)"):
            strategy = FixedStrategy(None) if name.startswith("off") else strategies[name]
            _add_rollout(acc[name], *rollout(strategy, group, args.seed + 1000 * k))
    runs = {name: _summarize(a) for name, a in acc.items()}
    for name, r in runs.items():
        print(
            f"  {name}: {r['seconds']:.1f} s, {r['cpu_ms_per_token']:.2f} CPU ms/token raw, "
            f"accept {r['mean_accept_length']:.2f}",
            flush=True,
        )

    fixed = _standardize(runs, arms)
    best, worst = min(fixed, key=fixed.get), max(fixed, key=fixed.get)
    payload = {
        "benchmark": "strategies-long-tail",
        "command": "python -m benchmarks " + " ".join(getattr(args, "argv", [])),
        "model": args.model,
        "dtype": args.dtype,
        "weight_layout": target.weight_layout,
        "task": args.task,
        "drafter": str(args.drafter),
        "requests": n,
        "groups": g,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "threshold": args.threshold,
        "warm_rollouts": args.warm_rollouts,
        "machine": machine_info(),
        "best_fixed": best,
        "worst_fixed": worst,
        # How far apart the two identical "SD off" runs came out: the timing noise of this run.
        "off_runs_ratio": runs["off (again)"]["std_ms_per_token"] / runs["off"]["std_ms_per_token"],
        "bandits": _bandit_report(bandits, runs, fixed, warm_counts),
        "runs": runs,
    }
    json_path = write_json(args.json, payload)
    plot_path = Path(args.plot) if args.plot else json_path.with_suffix(".png")
    payload["plot"] = str(plot(payload, bandits[next(iter(bandits))], plot_path))  # the first one's heat map
    write_json(json_path, payload)
    for name, b in payload["bandits"].items():
        print(
            f"[bench strategies] {name}: {b['vs_best_fixed']:.3f}x of the best fixed arm ({best}), "
            f"{b['vs_worst_fixed']:.2f}x of the worst ({worst}), standardised ms/token",
            flush=True,
        )
    print(
        f"[bench strategies] the two SD-off runs differ by {payload['off_runs_ratio']:.3f}x; "
        f"wrote {json_path}",
        flush=True,
    )
    return payload
