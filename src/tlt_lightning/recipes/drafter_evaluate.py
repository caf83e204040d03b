"""``tlt-lightning drafter evaluate``: compare drafters offline on the same stored rollouts.

Every drafter drafts at every position of the same rollouts (teacher-forced, with the multi-step
unroll, as :func:`~tlt_lightning.drafter.evaluate_drafter` does for the warm-up's held-out tenth),
and the table says how much the target would accept: ``accept`` / ``accept_step{k}`` is
``sum(min(p, q))``, the probability that a draft sampled at temperature 1 is accepted at draft step
``k``, with ``p`` the target's distribution on its whole vocabulary (``1 - vocab_mass``, its mean
probability outside a reduced draft vocabulary, no draft can win; ``--renormalise``: ``p``
renormalised on the draft vocabulary, the warm-up's training metric); ``top1`` / ``top1_step{k}``
is the greedy agreement. Steadier and far cheaper than an end-to-end benchmark on a noisy
machine: use it to pick a drafter, then benchmark that one.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

import torch

from tlt_lightning.drafter import DrafterLoss, evaluate_drafter, load_drafter, make_batches, target_features
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.reports import machine_info, write_json
from tlt_lightning.rollout import Rollout, load_rollouts
from tlt_lightning.validation import check

__all__ = ["run"]

COLUMNS = (
    "accept",
    "accept_step2",
    "accept_step3",
    "top1",
    "top1_step2",
    "top1_step3",
    "vocab_mass",
    "ce_loss",
)


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name, low in {"first": 0, "unroll": 1, "max_len": 1, "batch_size": 1}.items():
        check(getattr(args, name) >= low, f"--{name.replace('_', '-')}", getattr(args, name), f">= {low}")
    if not Path(args.rollouts).is_file():
        raise FileNotFoundError(
            f"--rollouts {args.rollouts}: no such file (make one with `drafter warmup --rollouts-cache`)"
        )
    rollouts, meta = load_rollouts(args.rollouts)
    key = meta.get("key", {})
    model = args.model or key.get("model")
    if model is None:
        raise ValueError(f"--rollouts {args.rollouts} does not say which model sampled it: pass --model")
    rollouts = rollouts[: args.first or max(1, len(rollouts) // 10)]
    target = HFTarget(load_model(model).model)
    dtype = key.get("dtype", "float32")  # features as the warm-up computes them: by the sampling model
    stored = tuple(key.get("feature_layers", ()))

    @functools.cache
    def with_features(layers: tuple[int, ...]) -> list[Rollout]:
        """The rollouts with features of ``layers``: as stored, or recomputed (once per layer set)."""
        if layers == stored and all(r.features is not None for r in rollouts):
            return rollouts
        print(
            f"[drafter evaluate] computing target features (layers {list(layers)}) of {len(rollouts)} "
            "rollouts ...",
            flush=True,
        )
        sampler = target if dtype == "float32" else HFTarget(load_model(model, dtype=dtype).model)
        return target_features(sampler, rollouts, layers, progress=True)

    results: dict[str, dict[str, float]] = {}
    for path in args.drafter:
        drafter = load_drafter(path, target, dtype=torch.float32)
        config = drafter.config
        batches = make_batches(
            with_features(config.rollout_feature_layers),
            config,
            args.batch_size,
            shuffle=False,
            max_len=args.max_len,
        )
        with torch.no_grad():
            results[path] = evaluate_drafter(
                drafter,
                target,
                batches,
                DrafterLoss.for_kind(config.kind, unroll_steps=args.unroll),
                full_vocab=not args.renormalise,
            )
    positions = sum(min(r.length, args.max_len) for r in rollouts)
    print(f"[drafter evaluate] {len(rollouts)} rollouts, {positions} positions of {args.rollouts}")
    print(" | ".join(["drafter", *COLUMNS]))
    for path, metrics in results.items():
        print(" | ".join([path, *(f"{metrics[c]:.3f}" if c in metrics else "-" for c in COLUMNS)]))
    payload = {
        "command": "tlt-lightning " + " ".join(getattr(args, "argv", [])),
        "model": model,
        "rollouts_file": args.rollouts,
        "rollouts": len(rollouts),
        "positions": positions,
        "unroll": args.unroll,
        "max_len": args.max_len,
        "renormalised": args.renormalise,
        "sampling": key,
        "machine": machine_info(),
        "drafters": results,
    }
    if args.json:
        write_json(args.json, payload)
    return payload
