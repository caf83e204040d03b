"""``python -m benchmarks efficiency --part sampler|distill|qat``: items 3-5 of the efficiency toolkit.

Each part trains tiny randomly initialised Llama models (transformers ``LlamaConfig``, 0.1-1.1M
parameters by default, CPU) on a reasoning-gym SFT task (:mod:`.efficiency_data`) and
compares a method with its baseline (:mod:`.efficiency_parts` says what each part runs):

* ``sampler``: importance sampling and RHO-LOSS vs uniform batches, at an equal number of
  training tokens;
* ``distill``: hierarchical distillation vs logits-only KD (and label CE alone), at equal steps;
* ``qat``: INT4 QAT with distillation, converted, vs post-training INT4 vs the unquantized model.

Each writes a JSON (machine, settings, curves, final numbers) and a PNG. Sized to finish in a
few minutes on one thread: ``python -m benchmarks --threads 1 efficiency --part sampler``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info, new_figure, save_figure, write_json

__all__ = ["run"]

PARTS = ("sampler", "distill", "qat")
COLORS = {
    "uniform": "tab:gray",
    "importance": "tab:blue",
    "rho": "tab:green",
    "ce": "tab:gray",
    "logits-kd": "tab:orange",
    "hierarchical-mse": "tab:blue",
    "hierarchical-cosine": "tab:green",
    "hierarchical-mse-raw": "tab:red",
    "fp32": "tab:gray",
    "ptq": "tab:red",
    "qat": "tab:blue",
    "scratch-fp32": "silver",
    "scratch-ptq": "salmon",
    "scratch-qat": "tab:purple",
}


def _defaults(args: argparse.Namespace) -> None:
    sampler = args.part == "sampler"
    for name, value in (
        ("steps", 400 if sampler else 300),
        ("hidden", 128 if sampler else 64),
        ("layers", 4 if sampler else 3),
    ):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.group_size < 0:
        raise SystemExit(f"--group-size must be >= 0 (0: per output channel), got {args.group_size}")
    for name in (
        "steps",
        "batch_size",
        "evals",
        "seeds",
        "train_size",
        "eval_size",
        "teacher_steps",
        "qat_steps",
        "holdout_steps",
    ):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks import efficiency_parts as parts
    from benchmarks.efficiency_data import build_sft_data

    _defaults(args)
    kwargs = json.loads(args.task_kwargs) if args.task_kwargs else None
    data = build_sft_data(
        args.task, train=args.train_size, eval_size=args.eval_size, seed=args.seed, task_kwargs=kwargs
    )
    runner = {"sampler": parts.run_sampler, "distill": parts.run_distill, "qat": parts.run_qat}[args.part]
    result = runner(args, data)
    settings = {k: v for k, v in vars(args).items() if k not in ("argv", "json", "plot", "command", "bench")}
    payload = {
        "benchmark": f"efficiency-{args.part}",
        "command": "python -m benchmarks " + " ".join(getattr(args, "argv", [])),
        "machine": machine_info(),
        "task": data.task,
        "vocab_size": data.tokenizer.vocab_size,
        "settings": settings,
        **result,
    }
    json_path = Path(args.json or f"runs/bench/efficiency_{args.part}.json")
    write_json(json_path, payload)
    plot_path = {"sampler": plot_sampler, "distill": plot_distill, "qat": plot_qat}[args.part](
        payload, Path(args.plot or json_path.with_suffix(".png"))
    )
    print(f"[bench efficiency] wrote {json_path} and {plot_path}")
    return payload


def _axes(ncols: int, width: float = 5.2) -> tuple[Any, Any]:
    return new_figure(1, ncols, figsize=(width * ncols, 4.2))


def plot_sampler(payload: dict[str, Any], path: Path) -> Path:
    """Eval loss and accuracy against training tokens, per variant and seed."""
    fig, (a, b) = _axes(2)
    for r in payload["runs"]:
        xs = [c["tokens"] / 1e3 for c in r["curve"]]
        label = r["variant"] if r["seed"] == payload["settings"]["seed"] else None
        a.plot(xs, [c["loss"] for c in r["curve"]], "o-", color=COLORS[r["variant"]], label=label)
        b.plot(xs, [c["accuracy"] for c in r["curve"]], "o-", color=COLORS[r["variant"]], label=label)
    a.set(
        xlabel="training tokens (thousands)",
        ylabel="eval answer loss (nats/token)",
        title="Loss at equal tokens",
    )
    b.set(
        xlabel="training tokens (thousands)",
        ylabel="eval exact-match accuracy",
        title="Accuracy at equal tokens",
    )
    a.legend()
    return save_figure(fig, path)


def plot_distill(payload: dict[str, Any], path: Path) -> Path:
    """Eval loss, accuracy and KL to the teacher against student steps."""
    fig, axes = _axes(3, 4.8)
    keys = (
        ("loss", "eval answer loss"),
        ("accuracy", "eval exact-match accuracy"),
        ("kl_to_teacher", "KL(teacher || student)"),
    )
    for name, v in payload["variants"].items():
        for ax, (key, _) in zip(axes, keys):
            ax.plot(
                [c["steps"] for c in v["curve"]],
                [c[key] for c in v["curve"]],
                "o-",
                color=COLORS[name],
                label=name,
            )
    teacher = payload["teacher"]["eval"]
    for ax, (key, label) in zip(axes, keys):
        if key in teacher:
            ax.axhline(teacher[key], color="k", ls="--", lw=1, label="teacher")
        ax.set(xlabel="student steps", ylabel=label)
    axes[0].legend()
    return save_figure(fig, path)


def plot_qat(payload: dict[str, Any], path: Path) -> Path:
    """Final eval loss and accuracy of the unquantized, post-training INT4 and QAT INT4 students."""
    from benchmarks.efficiency_parts import QAT_VARIANTS

    fig, (a, b) = _axes(2, 6.5)
    names = [n for n in QAT_VARIANTS if n in payload["variants"]]
    finals = [payload["variants"][n]["final"] for n in names]
    labels = {
        "fp32": "fp32",
        "ptq": "INT4 PTQ",
        "qat": "INT4 QAT+KD",
        "scratch-fp32": "fp32\n(1 schedule)",
        "scratch-ptq": "INT4 PTQ\n(1 schedule)",
        "scratch-qat": "INT4 QAT+KD\nfrom start",
    }
    colors = [COLORS[n] for n in names]
    a.bar_label(
        a.bar([labels[n] for n in names], [f["loss"] for f in finals], color=colors), fmt="%.3f", fontsize=8
    )
    b.bar_label(
        b.bar([labels[n] for n in names], [f["accuracy"] for f in finals], color=colors),
        fmt="%.3f",
        fontsize=8,
    )
    teacher = payload["teacher"]["eval"]
    a.axhline(teacher["loss"], color="k", ls="--", lw=1, label="fp32 teacher")
    b.axhline(teacher["accuracy"], color="k", ls="--", lw=1, label="fp32 teacher")
    a.set(
        ylabel="eval answer loss (nats/token)",
        title=f"INT4 weights, group size {payload['int4']['group_size']}",
    )
    b.set(ylabel="eval exact-match accuracy")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
        ax.legend()
    return save_figure(fig, path)
