"""A simulated speculative-decoding environment with known best arms, and the bandit benchmark.

The model is parametric and pure Python, so the benchmark runs in seconds and its answer is known:

* accepted tokens per request and step: a chain of depth ``d`` with per-token acceptance ``a``
  emits ``(1 - a**(d+1)) / (1 - a)`` tokens (diminishing returns in ``d``); a tree of width
  ``w = min(topk, num_draft_tokens / num_steps)`` acts as a chain with acceptance
  ``1 - (1 - a) ** (w ** tree_width_exponent)``; SD off emits exactly 1.
* step time: ``base_time + token_time * B * (1 + verified)`` for the target (a fixed memory-bound
  part plus compute growing with batch x verified tokens) ``+ num_steps * (draft_time +
  draft_token_time * B * topk)`` for the drafter. So SD wins at small batch and loses at large.
* noise: log-normal, multiplicative, on accepted tokens (``noise``) and step time (``noise / 2``).
* at ``change_at`` the drafter gets worse (``acceptance`` -> ``acceptance_after_change``), which
  changes the best arm of some buckets.

``run_bandit_benchmark`` runs BEG-MAB, UCB and every fixed arm on the same batch sizes and noise.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tlt_lightning.scheduling.bandit import BEGMABStrategy
from tlt_lightning.scheduling.baselines import FixedStrategy, UCBStrategy
from tlt_lightning.scheduling.bucketed import BucketedStrategy, default_arms
from tlt_lightning.scheduling.heatmap import draw_heatmaps
from tlt_lightning.scheduling.step_cost import step_seconds
from tlt_lightning.speculative import Arm, arm_key

__all__ = ["SimulatedSDEnvironment", "main", "run_bandit_benchmark", "run_strategy"]


@dataclass
class SimulatedSDEnvironment:
    """Tokens/s of each arm at each batch size, with noise and a drafter that degrades mid-run.

    Args:
        batch_sizes: batch sizes drawn uniformly at random each step (one per default bucket).
        acceptance: drafter per-token acceptance before ``change_at``, in ``(0, 1)``.
        acceptance_after_change: acceptance from step ``change_at`` on, in ``(0, 1)``.
        change_at: step at which the drafter changes; ``None`` for never.
        noise: log-normal sigma of the accepted tokens (step time gets half), ``>= 0``.
        base_time, token_time, draft_time, draft_token_time: cost model, seconds (``>= 0``).
        tree_width_exponent: how much a tree's width helps acceptance, in ``(0, 1]``.
        seed: seeds the environment's own RNGs (batch sizes and noise are separate streams, so
            every strategy sees the same batch sizes and noise draws).

    Example:
        >>> env = SimulatedSDEnvironment(change_at=None)
        >>> arm_key(env.best_arm(1, step=0)), arm_key(env.best_arm(48, step=0))
        ('tree5x4/16', 'off')
    """

    batch_sizes: tuple[int, ...] = (1, 3, 12, 48)
    acceptance: float = 0.75
    acceptance_after_change: float = 0.45
    change_at: int | None = 4000
    noise: float = 0.1
    base_time: float = 0.04
    token_time: float = 0.0015
    draft_time: float = 0.006
    draft_token_time: float = 0.00005
    tree_width_exponent: float = 0.7
    seed: int = 0
    _batch_rng: random.Random = field(init=False, repr=False)
    _noise_rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(
            isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.batch_sizes
        ):
            raise ValueError(f"batch_sizes must be non-empty ints >= 1, got {self.batch_sizes!r}")
        for name in ("acceptance", "acceptance_after_change"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)!r}")
        if self.change_at is not None and self.change_at < 0:
            raise ValueError(f"change_at must be None or >= 0, got {self.change_at!r}")
        for name in ("noise", "base_time", "token_time", "draft_time", "draft_token_time"):
            if not 0.0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)!r}")
        if self.base_time == 0 and self.token_time == 0:
            raise ValueError("base_time and token_time cannot both be 0 (steps would take no time)")
        if not 0.0 < self.tree_width_exponent <= 1.0:
            raise ValueError(f"tree_width_exponent must be in (0, 1], got {self.tree_width_exponent!r}")
        self._batch_rng = random.Random(f"{self.seed}/batch")
        self._noise_rng = random.Random(f"{self.seed}/noise")

    def acceptance_at(self, step: int) -> float:
        changed = self.change_at is not None and step >= self.change_at
        return self.acceptance_after_change if changed else self.acceptance

    def expected_tokens(self, arm: Arm, step: int) -> float:
        """Mean tokens emitted per request in one step (noise-free)."""
        if arm is None:
            return 1.0
        width = min(arm.topk, arm.num_draft_tokens / arm.num_steps) ** self.tree_width_exponent
        a = 1.0 - (1.0 - self.acceptance_at(step)) ** width
        return (1.0 - a ** (arm.num_steps + 1)) / (1.0 - a)

    def expected_step_time(self, batch_size: int, arm: Arm) -> float:
        """Seconds of one step (noise-free)."""
        return step_seconds(self.base_time, self.token_time, self.draft_time, self.draft_token_time, batch_size, arm)

    def expected_reward(self, batch_size: int, arm: Arm, step: int) -> float:
        """Noise-free tokens/s; also the median of the noisy reward (the noise is log-normal)."""
        return self.expected_tokens(arm, step) * batch_size / self.expected_step_time(batch_size, arm)

    def best_arm(self, batch_size: int, step: int, arms: Sequence[Arm] | None = None) -> Arm:
        """The arm with the highest expected reward (first one on ties)."""
        arms = default_arms() if arms is None else arms
        return max(arms, key=lambda arm: self.expected_reward(batch_size, arm, step))

    def sample_batch_size(self) -> int:
        return self._batch_rng.choice(self.batch_sizes)

    def observe(self, batch_size: int, arm: Arm, step: int) -> tuple[float, float]:
        """One noisy step: ``(accepted_tokens, step_time)``; always draws the same amount of noise."""
        z_tokens, z_time = self._noise_rng.gauss(0.0, 1.0), self._noise_rng.gauss(0.0, 1.0)
        tokens = self.expected_tokens(arm, step)
        if arm is not None:  # plain decoding emits exactly one token; drafts may all be rejected
            tokens = max(1.0, tokens * math.exp(self.noise * z_tokens))
        seconds = self.expected_step_time(batch_size, arm) * math.exp(0.5 * self.noise * z_time)
        return tokens, seconds


def run_strategy(strategy: BucketedStrategy, env: SimulatedSDEnvironment, steps: int) -> list[dict[str, Any]]:
    """Run ``strategy`` for ``steps`` steps; per step: batch size, arm, mode, reward, oracle reward."""
    trace = []
    for t in range(steps):
        batch_size = env.sample_batch_size()
        arm = strategy.select(batch_size)
        tokens, seconds = env.observe(batch_size, arm, t)
        strategy.update(batch_size, arm, tokens, seconds)
        best = env.best_arm(batch_size, t)
        trace.append(
            {
                "step": t,
                "batch_size": batch_size,
                "arm": arm,
                "mode": strategy.last_decision.mode,
                "reward": tokens * batch_size / seconds,
                "best": best,
                "oracle": env.expected_reward(batch_size, best, t),
            }
        )
    return trace


def _summarise(
    trace: list[dict[str, Any]], strategy: BucketedStrategy, change_at: int | None, majority: int, burn_in: int
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
    strategies: dict[str, BucketedStrategy] = {
        "begmab": BEGMABStrategy(epsilon=epsilon, window=window, seed=seed),
        # Exploration decaying per bucket to a 1% floor: cheaper once known, slower to follow a change.
        "begmab-decay": BEGMABStrategy(epsilon=epsilon, window=window, seed=seed, epsilon_half_life=window,
                                       epsilon_floor=min(0.01, epsilon)),
        "ucb": UCBStrategy(c=ucb_c, window=window),
        **{f"fixed:{arm_key(arm)}": FixedStrategy(arm) for arm in default_arms()},
    }
    env = SimulatedSDEnvironment(**env_args)
    probe = strategies["begmab"]
    best = {
        phase: {
            probe.bucket_labels[probe.bucket_of(bs)]: arm_key(env.best_arm(bs, t)) for bs in env.batch_sizes
        }
        for phase, t in (("before_change", 0), ("after_change", change_at))
    }
    results: dict[str, Any] = {}
    traces: dict[str, list[dict[str, Any]]] = {}
    for name, strategy in strategies.items():
        trace = traces[name] = run_strategy(strategy, SimulatedSDEnvironment(**env_args), steps)
        # Fixed arms have one bucket; judge every strategy on the bandit's buckets.
        fractions, follow = _summarise(
            trace, strategies["begmab"] if name.startswith("fixed") else strategy, change_at, majority, burn_in
        )
        results[name] = {
            "total_reward": sum(r["reward"] for r in trace),
            "reward_vs_oracle": statistics.fmean(r["reward"] / r["oracle"] for r in trace),
            "best_arm_fraction": fractions,
            "steps_to_follow_change": follow,
        }
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
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    traces, bandit = result["traces"], result["strategy_objects"]["begmab"]
    edges, rows = bandit.heatmap_data(num_bins=40)
    fig = Figure(figsize=(4 * len(rows), 8), layout="constrained")
    FigureCanvasAgg(fig)
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
