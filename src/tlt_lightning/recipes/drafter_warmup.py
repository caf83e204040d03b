"""``tlt-lightning drafter warmup``: train a drafter from the target's own rollouts on a task.

The target samples responses to task prompts (temperature 1, as in RL), the rollout engine keeps
the hidden states of the forward passes it already runs, and the drafter learns to predict the
target's next feature and next-token distribution from them. A held-out tenth of the rollouts
measures top-1 agreement and acceptance at temperature 1 before and after. Output:
``model.safetensors`` + ``config.json`` (loadable with
:func:`~tlt_lightning.drafter.load_drafter`), ``warmup.json`` and ``warmup.png``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import yaml

from tlt_lightning.drafter import (
    Drafter,
    DrafterConfig,
    DrafterLoss,
    evaluate_drafter,
    load_drafter,
    make_batches,
    save_drafter,
    target_features,
    warmup_drafter,
)
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.reports import draw_or_skip, machine_info, write_json
from tlt_lightning.rl.tasks import TaskConfig, TaskDataset
from tlt_lightning.rollout import Rollout, RolloutConfig, RolloutEngine, load_rollouts, save_rollouts
from tlt_lightning.validation import UserError, check

__all__ = ["collect_rollouts", "run", "sampling_setup", "warmup_task"]


def collect_rollouts(
    engine: RolloutEngine,
    prompts: list[list[int]],
    chunk: int,
    seed: int,
    done: list[Rollout] | None = None,
    on_chunk: Callable[[list[Rollout], float], None] | None = None,
) -> tuple[list[Rollout], float]:
    """Sample every prompt in chunks of ``chunk`` requests; returns the rollouts and seconds taken.

    Chunk ``i`` (prompts ``i .. i + chunk``) draws from ``Generator().manual_seed(seed + i)``, so
    resuming from ``done`` (the first ``len(done)`` rollouts of an earlier call, a whole number of
    chunks) gives the same rollouts as an uninterrupted run. ``on_chunk(rollouts, seconds)`` is
    called after every chunk (e.g. to save them). Seconds count this call only.
    """
    rollouts: list[Rollout] = list(done or [])
    if len(rollouts) % chunk and len(rollouts) != len(prompts):
        raise ValueError(
            f"cannot resume from {len(rollouts)} rollouts: not a whole number of chunks of {chunk}"
        )
    start = time.perf_counter()
    for i in range(len(rollouts), len(prompts), chunk):
        gen = torch.Generator().manual_seed(seed + i)
        rollouts += engine.generate(prompts[i : i + chunk], generator=gen, progress=True).rollouts
        tokens = sum(r.length for r in rollouts)
        elapsed = time.perf_counter() - start
        print(f"  rollouts {len(rollouts)}/{len(prompts)}, {tokens} tokens, {elapsed:.0f} s", flush=True)
        if on_chunk is not None:
            on_chunk(rollouts, elapsed)
    return rollouts, time.perf_counter() - start


def _fill_features(target: HFTarget, rollouts: list[Rollout], layers: tuple[int, ...]) -> list[Rollout]:
    """``rollouts``, those without features replaced by copies with them recomputed."""
    filled = iter(target_features(target, [r for r in rollouts if r.features is None], layers, progress=True))
    return [next(filled) if r.features is None else r for r in rollouts]


_SAMPLING_KEYS = ("model", "dtype", "task", "max_new_tokens", "temperature", "feature_layers")
"""The cache-key entries that rollouts merged into one training set must share."""


def warmup_task(args: argparse.Namespace) -> TaskConfig:
    """The task whose prompts are sampled: ``--task`` with the default prompt, or the ``model.task`` of the
    fit config ``--task-config`` (its system prompt and settings), ``--prompts`` of them from ``--seed``."""
    if not getattr(args, "task_config", None):
        return TaskConfig(name=args.task, size=args.prompts, seed=args.seed)
    path = Path(args.task_config)
    if not path.is_file():
        raise UserError(f"--task-config {path}: no such file (a fit config, e.g. configs/grpo_smollm2.yaml)")
    settings = ((yaml.safe_load(path.read_text()) or {}).get("model") or {}).get("task")
    if not isinstance(settings, dict):
        raise UserError(f"--task-config {path}: it has no model.task mapping to render prompts with")
    return TaskConfig(**{**settings, "size": args.prompts, "seed": args.seed})


def _cache_key(args: argparse.Namespace, config: DrafterConfig) -> dict[str, Any]:
    """What the cached rollouts depend on (``task``: the task's settings when they come from a fit config)."""
    keys = ("model", "dtype", "task", "prompts", "samples", "max_new_tokens", "temperature", "seed")
    key = {k: getattr(args, k) for k in keys} | {"feature_layers": list(config.rollout_feature_layers)}
    if getattr(args, "task_config", None):
        key["task"] = asdict(warmup_task(args)) | {"size": None}  # --prompts is a key of its own
    return key


def sampling_setup(key: dict[str, Any]) -> dict[str, Any]:
    """The entries of a cache key that merged rollouts must share: a fit config's task settings less its
    ``seed`` and ``size`` (the prompts drawn, which other warm-ups are meant to vary)."""
    out = {k: key.get(k) for k in _SAMPLING_KEYS}
    if isinstance(out["task"], dict):
        out["task"] = {**out["task"], "seed": None, "size": None}
    return out


def load_more_rollouts(paths: list[str], key: dict[str, Any]) -> list[Rollout]:
    """Rollouts of other warm-up caches, checked to come from the same sampling setup."""
    rollouts: list[Rollout] = []
    mine = sampling_setup(key)
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"--more-rollouts {path}: no such file (make it with `drafter warmup --rollouts-cache`)"
            )
        more, meta = load_rollouts(path)
        saved = sampling_setup(meta.get("key", {}))
        differ = {k: saved[k] for k in _SAMPLING_KEYS if saved[k] != mine[k]}
        if differ:
            raise ValueError(
                f"--more-rollouts {path} was sampled with other settings: {differ}, this run: "
                f"{ {k: mine[k] for k in differ} }"
            )
        rollouts += more
    return rollouts


def plot(history: list[dict[str, float]], path: Path) -> Path:
    from tlt_lightning.reports import new_figure, save_figure

    fig, (a, b) = new_figure(1, 2, figsize=(11, 4))
    steps = range(1, len(history) + 1)
    a.plot(steps, [h["loss"] for h in history], lw=0.8)
    a.set(xlabel="step", ylabel="loss", title="Drafter warm-up loss", yscale="log")
    b.plot(steps, [h["top1"] for h in history], lw=0.8, label="top-1 agreement (greedy acceptance)")
    b.plot(steps, [h["accept"] for h in history], lw=0.8, label="acceptance at T=1")
    b.set(xlabel="step", ylabel="train batch, draft step 1", title="Agreement with the target")
    b.legend()
    return save_figure(fig, path)


def _check_args(args: argparse.Namespace) -> None:
    for name in ("prompts", "samples", "max_new_tokens", "steps", "batch_size", "rollout_batch"):
        check(getattr(args, name) >= 1, f"--{name.replace('_', '-')}", getattr(args, name), ">= 1")
    check(args.pack >= 0, "--pack", args.pack, ">= 0 (0 = pad, no packing)")
    check(args.save_every >= 0, "--save-every", args.save_every, ">= 0 (0 = save at the end only)")


def _initial_drafter(args: argparse.Namespace, target: HFTarget) -> tuple[DrafterConfig, Drafter | None]:
    """The drafter's config, with the drafter of ``--init-from`` (``None``: built after sampling)."""
    if not args.init_from:
        config = DrafterConfig.from_target(target, kind=args.kind, draft_vocab_size=args.draft_vocab or None)
        return config, None
    drafter = load_drafter(args.init_from, target, dtype=torch.float32)
    config = drafter.config
    if config.kind != args.kind:
        raise ValueError(
            f"--init-from {args.init_from} is an {config.kind} drafter, but --kind is {args.kind}"
        )
    return config, drafter


def _sample(
    args: argparse.Namespace, target: HFTarget, config: DrafterConfig, prompts: list[list[int]]
) -> tuple[list[Rollout], float]:
    """The rollouts of ``prompts`` and the seconds they took: from ``--rollouts-cache``, completed there."""
    cache = Path(args.rollouts_cache) if args.rollouts_cache else None
    key = _cache_key(args, config)
    done, seconds, chunk = [], 0.0, args.rollout_batch
    if cache is not None and cache.is_file():
        done, saved = load_rollouts(cache)
        if saved["key"] != key:
            raise ValueError(f"--rollouts-cache {cache} was made with other settings: {saved['key']}")
        seconds, chunk = (
            saved["seconds"],
            saved["chunk"],
        )  # the same chunks: the same seeds, the same rollouts
    if done and len(done) == len(prompts):
        print(f"[drafter warmup] reusing {len(done)} rollouts from {cache}", flush=True)
        rollouts, rollout_s = done, seconds
    else:
        print(
            f"[drafter warmup] sampling {len(prompts) - len(done)} of {len(prompts)} rollouts of "
            f"{args.model} ({args.dtype}) on {warmup_task(args).name} ...",
            flush=True,
        )
        sampler = (
            target if args.dtype == "float32" else HFTarget(load_model(args.model, dtype=args.dtype).model)
        )
        engine = RolloutEngine(
            sampler,
            RolloutConfig(
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                feature_layers=config.rollout_feature_layers,
            ),
        )

        def save_chunk(so_far: list[Rollout], elapsed: float) -> None:  # Ctrl-C or a crash keeps these
            features = not args.cache_tokens_only and all(r.features is not None for r in so_far)
            save_rollouts(cache, so_far, {"key": key, "seconds": seconds + elapsed, "chunk": chunk}, features)

        rollouts, rollout_s = collect_rollouts(
            engine, prompts, chunk, args.seed, done, None if cache is None else save_chunk
        )
        rollout_s += seconds
        del sampler, engine
    return rollouts, rollout_s


def _rollouts(
    args: argparse.Namespace, tokenizer: Any, target: HFTarget, config: DrafterConfig
) -> tuple[list[Rollout], list[Rollout], float]:
    """``(sampled rollouts, --more-rollouts, sampling seconds)``, all with the target's features."""
    dataset = TaskDataset(warmup_task(args), tokenizer)
    prompts = [list(dataset[i].input_ids) for i in range(args.prompts) for _ in range(args.samples)]
    more = load_more_rollouts(args.more_rollouts, _cache_key(args, config))  # before sampling: fail fast
    rollouts, rollout_s = _sample(args, target, config, prompts)
    lacking = sum(r.features is None for r in rollouts + more)
    if lacking:  # read from tokens-only files
        print(f"[drafter warmup] recomputing target features of {lacking} stored rollouts ...", flush=True)
        model = (
            target if args.dtype == "float32" else HFTarget(load_model(args.model, dtype=args.dtype).model)
        )
        rollouts, more = (_fill_features(model, rs, config.rollout_feature_layers) for rs in (rollouts, more))
    return rollouts, more, rollout_s


def _train(
    args: argparse.Namespace,
    drafter: Drafter,
    target: HFTarget,
    train: list[Rollout],
    loss_cfg: DrafterLoss,
    out: Path,
) -> tuple[list[dict[str, float]], float]:
    """``(the training metrics of each step, seconds)``; saves to ``out`` every ``--save-every`` steps."""

    def checkpoint(step: int, metrics: dict[str, float]) -> None:
        if args.save_every and step % args.save_every == 0 and step < args.steps:
            save_drafter(drafter, out)  # atomic: a crash leaves the previous save whole

    start = time.perf_counter()
    history = warmup_drafter(
        drafter,
        target,
        train,
        args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        loss_cfg=loss_cfg,
        seed=args.seed,
        max_len=args.max_len,
        lr_warmup=args.lr_warmup,
        pack_budget=args.pack or None,
        on_step=checkpoint,
        autocast_dtype=torch.bfloat16 if args.train_dtype == "bfloat16" else None,
    )
    return history, time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    _check_args(args)
    loaded = load_model(args.model)
    if loaded.tokenizer is None:
        raise ValueError(f"--model {args.model!r} has no tokenizer: warm-up samples real task prompts")
    target = HFTarget(loaded.model)
    config, drafter = _initial_drafter(args, target)
    rollouts, more, rollout_s = _rollouts(args, loaded.tokenizer, target, config)
    held_out = max(1, len(rollouts) // 10)
    train, valid = rollouts[held_out:] + more, rollouts[:held_out]

    counts = torch.bincount(torch.cat([r.token_ids for r in train]), minlength=target.info.vocab_size)
    if drafter is None:
        drafter = Drafter(config, target, token_counts=counts if config.reduced_vocab else None)
    loss_cfg = DrafterLoss.for_kind(args.kind, unroll_steps=args.unroll, accept_weight=args.accept_weight)
    valid_batches = make_batches(valid, config, args.batch_size, shuffle=False, max_len=args.max_len)
    before = evaluate_drafter(drafter, target, valid_batches, loss_cfg)
    print(
        f"[drafter warmup] {drafter.num_trainable_parameters() / 1e6:.2f}M trainable parameters "
        f"(target {sum(p.numel() for p in loaded.model.parameters()) / 1e6:.1f}M); "
        f"training {args.steps} steps on {sum(r.length for r in train)} tokens ...",
        flush=True,
    )
    out = Path(args.out)
    history, train_s = _train(args, drafter, target, train, loss_cfg, out)
    after = evaluate_drafter(drafter, target, valid_batches, loss_cfg)
    # Renormalised on the draft vocabulary above, as the training metrics; this is what sampling accepts.
    after_sd = evaluate_drafter(drafter, target, valid_batches, loss_cfg, full_vocab=True)
    save_drafter(drafter, out)
    coverage = float(counts[drafter.draft_ids.cpu()].sum() / counts.sum()) if config.reduced_vocab else 1.0
    payload = {
        "command": "tlt-lightning " + " ".join(getattr(args, "argv", [])),
        "model": args.model,
        "dtype": args.dtype,
        "train_dtype": args.train_dtype,
        "init_from": args.init_from,
        "unroll": args.unroll,
        "accept_weight": args.accept_weight,
        "pack": args.pack,
        "task": asdict(warmup_task(args)) if getattr(args, "task_config", None) else args.task,
        "kind": args.kind,
        "machine": machine_info(),
        "rollouts": len(rollouts),
        "more_rollouts": len(more),
        "train_tokens": sum(r.length for r in train),
        "rollout_seconds": rollout_s,
        "train_seconds": train_s,
        "trainable_parameters": drafter.num_trainable_parameters(),
        "draft_vocab": config.draft_vocab,
        "draft_vocab_token_coverage": coverage,
        "held_out_before": before,
        "held_out_after": after,
        "held_out_after_full_vocab": after_sd,
        "final_train_metrics": history[-1],
    }
    write_json(out / "warmup.json", payload)
    draw_or_skip(plot, history, out / "warmup.png")  # the drafter is saved: a missing matplotlib only warns
    print(
        f"[drafter warmup] held-out top-1 {before['top1']:.3f} -> {after['top1']:.3f}, acceptance at T=1 "
        f"{before['accept']:.3f} -> {after['accept']:.3f} on the draft vocabulary, {after_sd['accept']:.3f} "
        f"against the target's whole vocabulary (what sampling accepts); saved to {out}",
        flush=True,
    )
    return payload
