"""``python -m benchmarks e2e``: GRPO steps with TLT against the identical run without it.

Two Lightning fits of :class:`~tlt_lightning.rl.GRPOModule` on the same model, task, prompts and
seeds; both sample on the same rollout precision (``--rollout-dtype``) and train with the same
Lightning precision (``--precision``; ``bf16-mixed`` autocasts the training forward and backward,
which AMX CPUs run several times faster than fp32):

* ``baseline``: plain decoding (``speculative=False``), no drafter, no callbacks.
* ``tlt``: speculative rollouts below ``--threshold`` active requests with the drafter of
  ``--drafter`` (or a fresh one), trained on the rollouts by
  :class:`~tlt_lightning.callbacks.SpotDrafterCallback`, the strategy chosen by
  :class:`~tlt_lightning.callbacks.BanditCallback` (``--bandit``) or fixed (``--depth``).

Per RL step: wall and CPU seconds, and their parts as the module and the callback log them
(rollout, reward, policy training, drafter training), reward, accuracy, response length, mean
accept length. The speedup is the ratio of median step times; with one torch thread the CPU-time
ratio is the steadier figure on a shared machine (both are reported), next to the baseline's rollout
share of the step (the ceiling of what a faster rollout can give). The reward curves of the
two runs are drawn together: speculative decoding is lossless, so they must agree within the
noise of sampling (the runs draw different random numbers once a draft is rejected, so they are
not identical sample for sample). ``--trl`` adds TRL's ``GRPOTrainer`` on the same model, task
and batch shape as a peer (needs the ``peers`` extra).

Goal (issue): >= 1.7x end to end against the run without TLT (TLT paper: 1.7-2.1x on GPUs).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import lightning as L

from benchmarks.common import machine_info, median, new_figure, save_figure, write_json
from tlt_lightning.rl.config import OptimConfig, SpeculativeConfig
from tlt_lightning.rl.module import GRPOModule
from tlt_lightning.rl.tasks import TaskConfig
from tlt_lightning.rollout import RolloutConfig

__all__ = ["StepRecorder", "run"]

PARTS = ("rollout_s", "reward_s", "train_s", "drafter_s")


class StepRecorder(L.Callback):
    """Times every RL step (wall and CPU) and keeps what the module and callbacks logged for it.

    Place it after the callbacks whose work should count in the step (drafter training runs in the
    module's training step, driven by :class:`~tlt_lightning.callbacks.SpotDrafterCallback`, whose
    ``on_train_batch_end`` logs and saves).
    """

    def __init__(self, name: str = "", verbose: bool = False) -> None:
        self.name, self.verbose = name, verbose
        self.steps: list[dict[str, float]] = []
        self._start = (0.0, 0.0)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = (time.perf_counter(), time.process_time())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        wall, cpu = time.perf_counter() - self._start[0], time.process_time() - self._start[1]
        m = {k: float(v) for k, v in trainer.callback_metrics.items()}
        stats = pl_module.last_rollout.stats
        self.steps.append(
            {
                "step": trainer.global_step,
                "wall_s": wall,
                "cpu_s": cpu,
                "rollout_s": m["time/rollout_s"],
                "reward_s": m["time/reward_s"],
                "train_s": m["time/train_s"],
                "drafter_s": m.get("drafter/paid_seconds", 0.0),
                "reward_mean": m["reward/mean"],
                "accuracy": m["reward/accuracy"],
                "length_mean": m["response/length_mean"],
                "tokens": stats.generated_tokens,
                "accept_length": stats.mean_accept_length,
                "sd_step_fraction": sum(stats.step_speculative) / max(1, stats.num_steps),
            }
        )
        if self.verbose:
            s = self.steps[-1]
            print(
                f"[bench e2e] {self.name} step {s['step']}/{trainer.max_steps}: {wall:.1f} s (rollout "
                f"{s['rollout_s']:.1f}, train {s['train_s']:.1f}, drafter {s['drafter_s']:.1f}), "
                f"reward {s['reward_mean']:.3f}, accept {s['accept_length']:.2f}",
                flush=True,
            )


def _fit(args: argparse.Namespace, name: str) -> dict[str, Any]:
    from tlt_lightning.callbacks import BanditCallback, DrafterDriftProbe, SpotDrafterCallback
    from tlt_lightning.spot import SpotConfig, SpotTrainerConfig

    tlt = name == "tlt"
    module = GRPOModule(
        model=args.model,
        rollout_dtype=args.rollout_dtype,
        rollout_decode=args.decode,
        task=TaskConfig(name=args.task),
        rollout=RolloutConfig(max_new_tokens=args.max_new_tokens),
        optim=OptimConfig(
            group_size=args.group_size,
            prompts_per_step=args.prompts_per_step,
            lr=args.lr,
            micro_batch_size=args.micro_batch_size,
        ),
        # without --bandit: a fixed chain of this depth
        speculative=SpeculativeConfig(enabled=tlt, threshold=args.threshold, sd_steps=args.depth),
        seed=args.seed,
    )
    recorder = StepRecorder(name, verbose=True)
    callbacks: list[L.Callback] = []
    if tlt:
        training = SpotTrainerConfig(
            max_steps_per_rollout=args.drafter_steps, max_seconds_per_rollout=None, seed=args.seed
        )
        config = SpotConfig(training, drafter_path=args.drafter, checkpoint_interval=None)
        callbacks.append(SpotDrafterCallback(config, timeline=False))
        if args.bandit:
            callbacks.append(BanditCallback())
    # The probe measures after the recorder has closed the step: its time is not the method's.
    probe = None
    if tlt and args.drift_every:
        probe = DrafterDriftProbe(
            max_new_tokens=args.drift_tokens, every_n_steps=args.drift_every, seed=args.seed
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        precision=args.precision,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=args.progress,
        num_sanity_val_steps=0,
        default_root_dir=str(Path(args.out) / name),
        callbacks=[*callbacks, recorder, *([probe] if probe else [])],
    )
    L.seed_everything(args.seed, verbose=False)
    print(f"[bench e2e] {name}: {args.steps} GRPO steps ...", flush=True)
    trainer.fit(module)
    steps = recorder.steps
    summary = {key: median([s[key] for s in steps]) for key in ("wall_s", "cpu_s", *PARTS)}
    summary["reward_mean"] = sum(s["reward_mean"] for s in steps) / len(steps)
    # The ceiling of any rollout speedup: the share of the step spent generating.
    summary["rollout_share"] = median([s["rollout_s"] / s["wall_s"] for s in steps])
    summary.update(per_token(steps))
    print(
        f"[bench e2e] {name}: median step {summary['wall_s']:.1f} s wall, {summary['cpu_s']:.1f} s CPU; "
        f"rollout share {summary['rollout_share']:.0%}; mean reward {summary['reward_mean']:.3f}",
        flush=True,
    )
    out = {"steps": steps, "median": summary}
    if probe is not None:
        out["drift"] = probe.history
    return out


def per_token(steps: list[dict[str, float]]) -> dict[str, float]:
    """Milliseconds per generated token over all steps: the runs sample responses of different
    lengths (T=1), so per-step times compare different amounts of work; these do not."""
    tokens = max(1, sum(s["tokens"] for s in steps))
    return {
        f"{key.removesuffix('_s')}_ms_per_token": 1e3 * sum(s[key] for s in steps) / tokens
        for key in ("wall_s", "cpu_s", *PARTS)
    }


def plot(payload: dict[str, Any], path: Path) -> Path:
    runs = payload["runs"]
    drift = runs["tlt"].get("drift")
    fig, axes = new_figure(1, 4 if drift else 3, figsize=(20 if drift else 15, 4.2))
    a, b, c = axes[:3]
    for name, run in runs.items():
        steps = [s["step"] for s in run["steps"]]
        a.plot(steps, [s["reward_mean"] for s in run["steps"]], marker="o", label=name)
        b.plot(steps, [s["wall_s"] for s in run["steps"]], marker="o", label=f"{name} wall")
        b.plot(steps, [s["cpu_s"] for s in run["steps"]], ls="--", label=f"{name} CPU")
    for name, peer in payload.get("peers", {}).items():
        steps = [s["step"] for s in peer["steps"]]
        a.plot(steps, [s["reward_mean"] for s in peer["steps"]], marker="^", ls=":", label=f"{name} (peer)")
        b.plot(steps, [s["wall_s"] for s in peer["steps"]], marker="^", ls=":", label=f"{name} wall (peer)")
    a.set(xlabel="RL step", ylabel="mean reward", title="Reward (lossless: equal within noise)")
    b.set(xlabel="RL step", ylabel="seconds", title="Step time")
    names = [n for n in runs if n in ("baseline", "tlt")]
    bottom = [0.0] * len(names)
    for part in PARTS:
        values = [runs[n]["median"][part] for n in names]
        c.bar(names, values, bottom=bottom, label=part.removesuffix("_s"))
        bottom = [x + y for x, y in zip(bottom, values)]
    ratio = payload["speedup"]
    c.set(
        ylabel="median seconds per step",
        title=f"Breakdown: {ratio['wall']:.2f}x wall, {ratio['cpu']:.2f}x CPU",
    )
    if drift:
        d = axes[3]
        d.plot([h["step"] for h in drift], [h["spot"] for h in drift], marker="o", label="spot-trained")
        d.plot([h["step"] for h in drift], [h["frozen"] for h in drift], marker="s", label="frozen")
        d.set(xlabel="RL step", ylabel="mean accept length (probe)", title="Drafter drift")
    for ax in axes:
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.config is not None:
        from benchmarks.e2e_config import run as run_config

        return run_config(args)
    for name in (
        "steps",
        "prompts_per_step",
        "group_size",
        "max_new_tokens",
        "threshold",
        "depth",
        "micro_batch_size",
    ):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.drift_every < 0:
        raise ValueError(f"--drift-every must be >= 0, got {args.drift_every}")
    if args.group_size < 2:
        raise ValueError(
            f"--group-size must be >= 2 (GRPO compares samples of a group), got {args.group_size}"
        )
    if args.drafter is not None and not Path(args.drafter).is_dir():
        raise ValueError(f"--drafter {args.drafter!r} is not a drafter directory (from `drafter warmup`)")
    TaskConfig(name=args.task)  # names the supported tasks before anything loads
    runs = {name: _fit(args, name) for name in ("baseline", "tlt")}
    base, tlt = runs["baseline"]["median"], runs["tlt"]["median"]
    payload: dict[str, Any] = {
        "command": "python -m benchmarks " + " ".join(getattr(args, "argv", [])),
        "machine": machine_info(),
        "config": {k: v for k, v in vars(args).items() if k not in ("argv", "func")},
        "runs": runs,
        "speedup": {
            "wall": base["wall_s"] / tlt["wall_s"],
            "cpu": base["cpu_s"] / tlt["cpu_s"],
            "rollout": base["rollout_s"] / tlt["rollout_s"],
            "per_token_wall": base["wall_ms_per_token"] / tlt["wall_ms_per_token"],
            "per_token_rollout": base["rollout_ms_per_token"] / tlt["rollout_ms_per_token"],
        },
        "goal": {"speedup": 1.7},
    }
    if args.trl:
        from benchmarks.trl_peer import run_trl_grpo

        write_json(args.json, payload)  # our two runs survive whatever happens to the peer's

        print(f"[bench e2e] TRL GRPOTrainer peer: {args.steps} steps ...", flush=True)
        peer = run_trl_grpo(
            args.model,
            TaskConfig(name=args.task),
            args.steps,
            args.prompts_per_step,
            args.group_size,
            args.max_new_tokens,
            args.lr,
            seed=args.seed,
            output_dir=Path(args.out) / "trl",
            bf16_mixed=args.precision == "bf16-mixed",
            micro_batch_size=args.micro_batch_size,
        )
        payload["peers"] = {"trl": peer}
        payload["speedup"]["tlt_vs_trl_wall"] = peer["median_step_s"] / tlt["wall_s"]
    path = write_json(args.json, payload)
    figure = plot(payload, Path(args.plot) if args.plot else path.with_suffix(".png"))
    s = payload["speedup"]
    print(
        f"[bench e2e] TLT vs baseline: {s['wall']:.2f}x wall, {s['cpu']:.2f}x CPU per step "
        f"(rollout {s['rollout']:.2f}x); per token {s['per_token_wall']:.2f}x (rollout "
        f"{s['per_token_rollout']:.2f}x); {path}, {figure}",
        flush=True,
    )
    return payload
