"""``tlt-lightning bench strategies``: BEG-MAB vs every fixed SD arm vs no SD on a real long-tail rollout.

The same prompts, seeds, model and drafter for every run; only the strategy chooser differs. Each
fixed arm is applied at every step below ``--threshold`` active requests (above it every run
decodes plainly), and the bandit chooses among the same arms. The bandit keeps its state across
rollouts, as it does across RL steps: it first learns on ``--warm-rollouts`` rollouts of other
prompts of the task, then the measured rollout runs (cold numbers are reported too). "SD off" runs
first and last, so a drift of the machine's speed during the benchmark shows in the JSON. Times are
CPU times (one torch thread): on a shared machine the wall clock of runs made minutes apart is not
comparable, the work done is. Wall-clock figures are reported alongside.

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

from tlt_lightning.bench.common import machine_info, median, task_prompts, timed, write_json
from tlt_lightning.drafter import load_drafter
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.scheduling.bandit import BEGMABStrategy, arm_key, default_arms, parse_arm
from tlt_lightning.scheduling.baselines import FixedStrategy

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, help="drafter checkpoint directory (from `drafter warmup`)")
    p.add_argument("--model", default="smollm2-135m", help="registry name or local HF directory")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--task", default="countdown", help="reasoning-gym task for the prompts")
    p.add_argument("--requests", type=int, default=128, help="prompts in the long-tail rollout")
    p.add_argument("--groups", type=int, default=1,
                   help="prompt groups of --requests each: every run rolls out all of them (totals reported)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threshold", type=int, default=32, help="strategies apply below this many active requests")
    p.add_argument("--warm-rollouts", type=int, default=1, help="bandit rollouts on other prompts before the measured one")
    p.add_argument("--epsilon", type=float, default=0.1, help="BEG-MAB exploration probability")
    p.add_argument("--epsilon-half-life", type=int, default=None,
                   help="decay each bucket's epsilon with this half-life in decisions (default: constant)")
    p.add_argument("--per-request", action="store_true",
                   help="BEG-MAB compares arms on tokens/s per request (see BucketedChooser's per_request)")
    p.add_argument("--arms", nargs="+", default=None, metavar="ARM",
                   help="candidate arms of every bucket and the fixed runs, e.g. off chain2 chain4 chain6 chain8 "
                        "(default: default_arms(): off, chains of 2/4/6, trees 4x2/8 and 5x4/16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="runs/bench/strategies.json")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")


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


def _measure(loop: SpeculativeRolloutLoop, groups: list[list[list[int]]], seed: int) -> dict[str, Any]:
    """One rollout per prompt group (group ``g`` seeded ``seed + 1000 g``); totals over the groups.

    Also the decode CPU seconds and tokens per batch size over all groups (``by_batch_size``), for
    :func:`standardized_ms_per_token`.
    """
    parts = []
    by_batch: dict[int, list[float]] = {}  # batch size -> [decode CPU seconds, tokens], all groups
    for g, prompts in enumerate(groups):
        gen = torch.Generator().manual_seed(seed + 1000 * g)
        result, wall, cpu = timed(functools.partial(loop.generate, prompts, generator=gen))
        stats = result.stats
        for b, sec, tok in zip(stats.step_batch_sizes, stats.step_cpu_times, stats.step_tokens):
            acc = by_batch.setdefault(b, [0.0, 0])
            acc[0] += sec
            acc[1] += tok
        parts.append({
            "seconds": wall, "cpu_seconds": cpu, "tokens": stats.generated_tokens, "steps": stats.num_steps,
            "sd_steps": sum(stats.step_speculative), "mean_accept_length": stats.mean_accept_length,
        })
    total = {k: sum(p[k] for p in parts) for k in ("seconds", "cpu_seconds", "tokens", "steps", "sd_steps")}
    accepts = [p["mean_accept_length"] for p in parts if p["sd_steps"]]
    return total | {
        "mean_accept_length": sum(accepts) / len(accepts) if accepts else 0.0,
        "cpu_ms_per_token": 1e3 * total["cpu_seconds"] / max(1, total["tokens"]),
        "by_batch_size": {b: by_batch[b] for b in sorted(by_batch)},
        "groups": parts,
    }


def plot(payload: dict[str, Any], bandit: BEGMABStrategy, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tlt_lightning.scheduling.bandit import draw_heatmaps

    runs = payload["runs"]
    names = list(runs)
    edges, rows = bandit.heatmap_data(num_bins=10)
    fig = plt.figure(figsize=(6 + 3.2 * len(rows), 4.2), layout="constrained")
    grid = fig.add_gridspec(1, 1 + len(rows), width_ratios=[2] + [1] * len(rows))
    a = fig.add_subplot(grid[0])
    colors = ["tab:red" if n.startswith("BEG-MAB") else "tab:gray" if n.startswith("off") else "tab:blue"
              for n in names]
    a.barh(names, [runs[n]["std_ms_per_token"] for n in names], color=colors)
    for i, n in enumerate(names):
        label = f" {runs[n]['speedup_vs_off']:.2f}x (raw {runs[n]['cpu_ms_per_token']:.2f})"
        a.text(runs[n]["std_ms_per_token"], i, label, va="center", fontsize=8)
    a.invert_yaxis()
    a.set(xlabel="decode ms per token on the off runs' batch-size mix (lower is better)",
          title=f"{payload['groups']} x {payload['requests']} requests, SD below {payload['threshold']} active")
    draw_heatmaps([fig.add_subplot(grid[1 + i]) for i in range(len(rows))], edges, rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)  # not save_figure: its tight_layout would undo the constrained layout
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("requests", "groups", "max_new_tokens", "threshold"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warm_rollouts < 0:
        raise ValueError(f"--warm-rollouts must be >= 0, got {args.warm_rollouts}")
    arms = default_arms() if args.arms is None else tuple(dict.fromkeys(parse_arm(a) for a in args.arms))
    if None not in arms:
        raise ValueError(f"--arms must include 'off' (the baseline every arm is compared with), got {args.arms}")
    loaded = load_model(args.model, dtype=args.dtype)
    if loaded.tokenizer is None:
        raise ValueError(f"--model {args.model!r} has no tokenizer: the benchmark needs real task prompts")
    target = HFTarget(loaded.model)
    drafter = load_drafter(args.drafter, target).eval()
    n = args.requests
    g = args.groups
    prompts = task_prompts(loaded.tokenizer, args.task, n * (g + args.warm_rollouts), seed=args.seed)
    measured, warm = [prompts[i * n : (i + 1) * n] for i in range(g)], prompts[g * n :]
    cfg = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)

    def loop(chooser) -> SpeculativeRolloutLoop:
        return SpeculativeRolloutLoop(target, drafter, cfg, chooser, threshold=args.threshold)

    runs: dict[str, dict[str, Any]] = {}
    order = [("off", None), *((arm_key(a), a) for a in arms if a is not None), ("off (again)", None)]
    for name, arm in order:
        print(f"[bench strategies] {name} ...", flush=True)
        runs[name] = _measure(loop(FixedStrategy(arm)), measured, args.seed)
        print(f"  {runs[name]['seconds']:.1f} s, {runs[name]['cpu_ms_per_token']:.2f} CPU ms/token, "
              f"accept {runs[name]['mean_accept_length']:.2f}", flush=True)
        if name == "off":  # the bandit goes in the middle of the fixed arms' runs
            bandit = BEGMABStrategy(arms, epsilon=args.epsilon, seed=args.seed,
                                    epsilon_half_life=args.epsilon_half_life, per_request=args.per_request)
            cold = _measure(loop(bandit), measured, args.seed)
            for i in range(args.warm_rollouts):
                print(f"[bench strategies] BEG-MAB warm-up rollout {i + 1}/{args.warm_rollouts} ...", flush=True)
                loop(bandit).generate(warm[i * n : (i + 1) * n], generator=torch.Generator().manual_seed(args.seed + 1 + i))
            runs["BEG-MAB"] = _measure(loop(bandit), measured, args.seed)
            runs["BEG-MAB (cold)"] = cold
            print(f"  BEG-MAB {runs['BEG-MAB']['seconds']:.1f} s (cold {cold['seconds']:.1f} s)", flush=True)

    mix = {b: tok for b, (_, tok) in runs["off"]["by_batch_size"].items()}  # both off runs decode the same
    for r in runs.values():
        r["std_ms_per_token"] = standardized_ms_per_token(r["by_batch_size"], mix)
    off = median([runs["off"]["std_ms_per_token"], runs["off (again)"]["std_ms_per_token"]])
    for r in runs.values():
        r["speedup_vs_off"] = off / r["std_ms_per_token"]
    fixed = {arm_key(a): runs[arm_key(a)]["std_ms_per_token"] for a in arms if a is not None} | {"off": off}
    best, worst = min(fixed, key=fixed.get), max(fixed, key=fixed.get)
    payload = {
        "benchmark": "strategies-long-tail",
        "command": "tlt-lightning " + " ".join(getattr(args, "argv", [])),
        "model": args.model, "dtype": args.dtype, "task": args.task, "drafter": str(args.drafter),
        "requests": n, "groups": g, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "threshold": args.threshold, "warm_rollouts": args.warm_rollouts, "per_request": args.per_request,
        "machine": machine_info(),
        "best_fixed": best, "worst_fixed": worst,
        "bandit_vs_best_fixed": fixed[best] / runs["BEG-MAB"]["std_ms_per_token"],
        "bandit_vs_worst_fixed": fixed[worst] / runs["BEG-MAB"]["std_ms_per_token"],
        "cold_bandit_vs_best_fixed": fixed[best] / runs["BEG-MAB (cold)"]["std_ms_per_token"],
        "bandit_best_arms": {k: arm_key(v) for k, v in bandit.best_arms().items()},
        "bandit_counts": bandit.counts,
        "bandit_values": bandit.values(),  # median tokens/s per bucket and arm: why it chose what it chose
        "runs": runs,
    }
    json_path = write_json(args.json, payload)
    payload["plot"] = str(plot(payload, bandit, Path(args.plot) if args.plot else json_path.with_suffix(".png")))
    write_json(json_path, payload)
    print(f"[bench strategies] best fixed {best}, BEG-MAB at {payload['bandit_vs_best_fixed']:.3f}x of it "
          f"(standardised ms/token) "
          f"({payload['bandit_vs_worst_fixed']:.2f}x the worst); wrote {json_path}", flush=True)
    return payload
