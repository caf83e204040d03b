"""``python -m benchmarks spot``: what spot training of the drafter recovers and what it costs.

The parts, on SmolLM2-135M and countdown unless told otherwise:

- ``packing``: drafter training throughput (samples/s) with sequence packing vs padding, on real
  rollouts of the target (a ``drafter warmup`` rollouts cache, or freshly sampled ones) with the
  real drafter and its reduced vocabulary (:func:`~benchmarks.spot_parts.benchmark_packing`).
- ``preemption``: latency from "the rollout is over everywhere" to a training worker leaving
  TRAINING, over many windows with 2 gloo processes and a tiny drafter step
  (:func:`~benchmarks.spot_parts.benchmark_preemption`): the coordinator's own latency.
- ``checkpoint``: how long the training loop blocks per drafter checkpoint, asynchronous vs
  synchronous save, with a drafter of the target's size
  (:func:`~benchmarks.spot_parts.benchmark_checkpoint`).
- ``ddp``: two GRPO fits with 2 DDP processes on gloo (one CPU core each), speculative rollouts
  with the same warmed-up drafter, identical but for :class:`~tlt_lightning.callbacks.SpotDrafterCallback`:
  on (the drafter trains in the other rank's tail) vs off (the drafter stays frozen). Reports the
  step-time overhead (per step and per generated token: the runs sample different lengths), the
  idle fraction recovered, the real preemption latency per window and the per-worker Gantt chart.
- ``contention``: a batch-1 decode step alone vs with a drafter training in another process
  (:func:`~benchmarks.spot_contention.benchmark_contention`): what spot training costs the tail on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.common import machine_info, median, new_figure, save_figure, write_json
from benchmarks.e2e import StepRecorder, per_token

__all__ = ["run"]

PARTS = ("packing", "preemption", "checkpoint", "ddp", "contention")


# ---------------------------------------------------------------------------------- packing
def _packing(args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import replace

    from benchmarks.spot_packing import benchmark_packing
    from tlt_lightning.drafter import DrafterConfig, read_drafter_config
    from tlt_lightning.models import HFTarget, load_model

    loaded = load_model(args.model)
    target = HFTarget(loaded.model)
    vocab = read_drafter_config(args.drafter).draft_vocab_size if args.drafter else 8192
    if args.rollouts_cache:
        from tlt_lightning.drafter import target_features
        from tlt_lightning.rollout import load_rollouts

        stored = load_rollouts(args.rollouts_cache)[0][: args.packing_rollouts]
        rollouts = target_features(target, stored, DrafterConfig.from_target(target).rollout_feature_layers)
    else:
        from benchmarks.common import task_prompts
        from tlt_lightning.rollout import RolloutConfig, RolloutEngine

        print(f"[bench spot] packing: sampling {args.packing_rollouts} rollouts ...", flush=True)
        engine = RolloutEngine(
            HFTarget(load_model(args.model, dtype="bfloat16").model),
            RolloutConfig(
                max_new_tokens=args.packing_budget,
                feature_layers=DrafterConfig.from_target(target).rollout_feature_layers,
            ),
        )
        prompts = task_prompts(loaded.tokenizer, args.task, args.packing_rollouts, seed=args.seed)
        result = engine.generate(prompts, generator=torch.Generator().manual_seed(args.seed), progress=True)
        rollouts = [replace(r, features=r.features.float()) for r in result.rollouts]
    print(f"[bench spot] packing: {len(rollouts)} rollouts, budget {args.packing_budget} ...", flush=True)
    out = benchmark_packing(
        budget=args.packing_budget,
        repeats=args.packing_repeats,
        seed=args.seed,
        target=target,
        rollouts=rollouts,
        draft_vocab_size=vocab,
    )
    print(
        f"[bench spot] packing: {out['speedup']:.2f}x samples/s over padding (fill "
        f"{out['padded']['fill_ratio']:.0%} padded vs {out['packed']['fill_ratio']:.0%} packed)",
        flush=True,
    )
    return out


# ---------------------------------------------------------------------------------- preemption
def _preemption(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.spot_parts import benchmark_preemption

    print(f"[bench spot] preemption: {args.windows} windows, 2 gloo processes ...", flush=True)
    out = benchmark_preemption(
        rollouts=args.windows, seed=args.seed, plot_path=Path(args.out) / "preemption_timeline.png"
    )
    print(
        f"[bench spot] preemption latency p50 {out['latency_p50_s'] * 1e3:.1f} ms, p99 "
        f"{out['latency_p99_s'] * 1e3:.1f} ms ({out['latency_p99_steps']:.2f} drafter steps)",
        flush=True,
    )
    return out


# ---------------------------------------------------------------------------------- contention
def _contention(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.common import task_prompts
    from benchmarks.spot_contention import benchmark_contention
    from tlt_lightning.models import load_tokenizer, model_dir

    pairs = args.contention_repeats
    print(f"[bench spot] contention: a decode alone / beside a drafter trainer, {pairs} pairs", flush=True)
    tokenizer = load_tokenizer(model_dir(args.model))
    if tokenizer is None:
        raise ValueError(f"--parts contention decodes a {args.task} prompt: {args.model!r} has no tokenizer")
    (prompt,) = task_prompts(tokenizer, args.task, 1, seed=args.seed)
    out = benchmark_contention(
        prompt,
        args.model,
        args.drafter,
        tokens=args.max_new_tokens,
        decode=args.contention_decode,
        repeats=pairs,
        train_dtype=args.contention_train_dtype,
        arm=args.contention_arm,
        seed=args.seed,
    )
    print(
        f"[bench spot] decode step {out['alone_ms']:.1f} ms alone, {out['beside_ms']:.1f} ms beside drafter "
        f"training ({out['slowdown']:.2f}x; {out['trainer_steps_per_s']:.1f} drafter steps/s)",
        flush=True,
    )
    return out


# ---------------------------------------------------------------------------------- checkpoint
def _checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.spot_parts import benchmark_checkpoint
    from tlt_lightning.models import load_model

    info = load_model(args.model).model.config
    print(
        f"[bench spot] checkpoint: {args.checkpoint_repeats} sync / async saves, "
        f"hidden {info.hidden_size} ...",
        flush=True,
    )
    out = benchmark_checkpoint(
        hidden_size=info.hidden_size,
        vocab_size=info.vocab_size,
        repeats=args.checkpoint_repeats,
        directory=args.out,
        seed=args.seed,
    )
    print(
        f"[bench spot] checkpoint: the loop blocks {out['async_blocking_s'] * 1e3:.0f} ms (async) vs "
        f"{out['sync_s'] * 1e3:.0f} ms (sync), {out['checkpoint_mb']:.0f} MB",
        flush=True,
    )
    return out


# ---------------------------------------------------------------------------------- ddp
class _RankRecorder(StepRecorder):
    """Times every RL step on each rank and writes the rank's record to ``directory`` at the end
    (spawned processes: the parent sees nothing else)."""

    def __init__(self, directory: Path, spot: Any = None) -> None:
        super().__init__()
        self.directory, self.spot, self.spot_steps = directory, spot, []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.spot is not None:
            self.spot_steps.append(
                {**self.spot.spot.local_stats, **{f"all/{k}": v for k, v in self.spot.last_metrics.items()}}
            )
        s = self.steps[-1]
        print(
            f"[bench spot] rank {trainer.global_rank} step {s['step']}: {s['wall_s']:.1f} s (rollout "
            f"{s['rollout_s']:.1f}, train {s['train_s']:.1f}), {s['tokens']} tokens",
            flush=True,
        )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record = {"steps": self.steps, "spot_steps": self.spot_steps}
        if self.spot is not None:
            record["latencies_s"] = list(self.spot.spot.coordinator.latencies)
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _ddp_fit(args: argparse.Namespace, name: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    from tlt_lightning.callbacks import SpotDrafterCallback
    from tlt_lightning.rl import GRPOModule, OptimConfig, SpeculativeConfig, TaskConfig
    from tlt_lightning.rollout import RolloutConfig
    from tlt_lightning.spot import SpotConfig, SpotTrainerConfig

    spot_on = name == "spot"
    root = Path(args.out) / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    module = GRPOModule(
        model=args.model,
        rollout_dtype="bfloat16",
        rollout_decode=args.decode,
        task=TaskConfig(name=args.task),
        rollout=RolloutConfig(max_new_tokens=args.max_new_tokens),
        optim=OptimConfig(
            group_size=args.group_size, prompts_per_step=args.prompts_per_step, lr=2e-5, micro_batch_size=4
        ),
        # Off: the same drafter, frozen. On: the callback loads it and trains it.
        speculative=SpeculativeConfig(
            threshold=args.threshold,
            sd_steps=args.depth,
            drafter_path=None if spot_on else args.drafter,
            drafter_kind=None if spot_on or args.drafter else "eagle1",
        ),
        seed=args.seed,
    )
    config = SpotConfig(SpotTrainerConfig(seed=args.seed), drafter_path=args.drafter)
    spot = SpotDrafterCallback(config) if spot_on else None
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo", start_method="spawn"),
        max_steps=args.steps,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
        callbacks=[*([spot] if spot else []), _RankRecorder(root, spot)],
    )
    print(f"[bench spot] ddp {name}: 2 processes x {args.steps} GRPO steps ...", flush=True)
    trainer.fit(module)
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    # A DDP step ends together on both ranks (gradient all-reduce): the step is the slower rank's.
    # The module's time/* metrics are already averaged over ranks (sync_dist); tokens are per rank.
    steps = [
        {
            **a,
            "wall_s": max(a["wall_s"], b["wall_s"]),
            "cpu_s": a["cpu_s"] + b["cpu_s"],
            "tokens": a["tokens"] + b["tokens"],
        }
        for a, b in zip(ranks[0]["steps"], ranks[1]["steps"])
    ]
    timed = steps[1:] if len(steps) > 1 else steps  # step 0 also pays one-time warm-up
    out: dict[str, Any] = {
        "steps": steps,
        "median": {"wall_s": median([s["wall_s"] for s in timed]), **per_token(timed)},
    }
    if spot_on:
        out["spot_training"] = _spot_training(root, ranks)
    m = out["median"]
    print(
        f"[bench spot] ddp {name}: median step {m['wall_s']:.1f} s, "
        f"{m['wall_ms_per_token']:.1f} ms per token",
        flush=True,
    )
    return out


def _spot_training(root: Path, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The spot run's drafter training: idle time recovered, steps, preemption latencies, accuracy."""
    (run,) = root.glob("version_*")  # the fit's own directory (tracking.run_dir; no logger: version_0)
    summary = json.loads((run / "drafter" / "summary.json").read_text())
    latencies = sorted(x for r in ranks for x in r["latencies_s"])
    # No latency when no rank was preempted while training (a tail shorter than min_idle_s).
    p50, p99 = (
        torch.tensor(latencies, dtype=torch.float64)
        .quantile(torch.tensor([0.5, 0.99], dtype=torch.float64))
        .tolist()
        if latencies
        else (None, None)
    )
    step_s = [s["tail_s"] / s["tail_steps"] for r in ranks for s in r["spot_steps"] if s["tail_steps"]]
    return {
        "idle_fraction_recovered": summary["idle_fraction_recovered"],
        "tail_steps_per_rank": [[s["tail_steps"] for s in r["spot_steps"]] for r in ranks],
        "paid_steps": summary["paid_steps"],
        "tail_seconds_per_rank": [sum(s["tail_s"] for s in r["spot_steps"]) for r in ranks],
        "idle_seconds_per_rank": [sum(s["idle_s"] for s in r["spot_steps"]) for r in ranks],
        "drafter_step_s": median(step_s),
        "preemption_latency_s": latencies,
        "preemption_latency_p50_s": p50,
        "preemption_latency_p99_s": p99,
        "top1": [s.get("all/drafter/top1") for s in ranks[0]["spot_steps"]],
        "accept_length": [s.get("all/drafter/accept_length") for s in ranks[0]["spot_steps"]],
        "timeline": str(run / "drafter" / "timeline" / "fit.png"),
    }


def _ddp(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["OMP_NUM_THREADS"] = "1"  # one core per spawned rank
    fits = {name: _ddp_fit(args, name) for name in ("frozen", "spot")}
    off, on = fits["frozen"]["median"], fits["spot"]["median"]
    fits["overhead"] = {
        "per_step": on["wall_s"] / off["wall_s"] - 1,
        "per_token": on["wall_ms_per_token"] / off["wall_ms_per_token"] - 1,
        "goal": 0.02,
    }
    return fits


def plot(payload: dict[str, Any], path: Path) -> Path | None:
    """Step times of the two DDP fits and the spot-trained drafter's accept length (when measured)."""
    if "ddp" not in payload:
        return None
    ddp = payload["ddp"]
    fig, (a, b) = new_figure(1, 2, figsize=(11, 4))
    for name in ("frozen", "spot"):
        steps = ddp[name]["steps"]
        a.plot([s["step"] for s in steps], [s["wall_s"] for s in steps], marker="o", label=f"drafter {name}")
        b.plot(
            [s["step"] for s in steps],
            [s["accept_length"] for s in steps],
            marker="o",
            label=f"drafter {name}",
        )
    o = ddp["overhead"]
    a.set(
        xlabel="RL step",
        ylabel="step seconds (2 DDP ranks)",
        title=f"spot training overhead: {o['per_step']:+.1%} per step, {o['per_token']:+.1%} per token",
    )
    b.set(xlabel="RL step", ylabel="mean accept length (rank 0 rollout)", title="speculative rollouts")
    for ax in (a, b):
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in (
        "packing_rollouts",
        "packing_budget",
        "packing_repeats",
        "windows",
        "checkpoint_repeats",
        "steps",
        "prompts_per_step",
        "max_new_tokens",
        "threshold",
        "depth",
        "contention_repeats",
    ):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prompts_per_step % 2:
        raise ValueError(
            f"--prompts-per-step is split over 2 ranks: it must be even, got {args.prompts_per_step}"
        )
    if args.drafter is not None and not Path(args.drafter).is_dir():
        raise ValueError(f"--drafter {args.drafter!r} is not a drafter directory (from `drafter warmup`)")
    if args.rollouts_cache is not None and not Path(args.rollouts_cache).is_file():
        raise ValueError(f"--rollouts-cache {args.rollouts_cache!r} is not a file")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {
        "command": "python -m benchmarks " + " ".join(getattr(args, "argv", [])),
        "machine": machine_info(),
        "config": {k: v for k, v in vars(args).items() if k not in ("argv", "func")},
    }
    for part, fn in (
        ("packing", _packing),
        ("preemption", _preemption),
        ("checkpoint", _checkpoint),
        ("ddp", _ddp),
        ("contention", _contention),
    ):
        if part in args.parts:
            payload[part] = fn(args)
            write_json(args.json, payload)  # what is measured so far survives a later crash
    path = write_json(args.json, payload)
    figure = plot(payload, Path(args.plot) if args.plot else path.with_suffix(".png"))
    if "ddp" in payload:
        o, s = payload["ddp"]["overhead"], payload["ddp"]["spot"]["spot_training"]
        print(
            f"[bench spot] overhead {o['per_step']:+.1%} per step, {o['per_token']:+.1%} per token; idle "
            f"recovered {s['idle_fraction_recovered']:.0%}; preemption p50 "
            f"{(s['preemption_latency_p50_s'] or float('nan')) * 1e3:.0f} ms",
            flush=True,
        )
    print(f"[bench spot] wrote {path}" + (f" and {figure}" if figure else ""), flush=True)
    return payload
