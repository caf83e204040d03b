"""Drafter training throughput with sequence packing vs padding (``python -m benchmarks spot --parts
packing``), on long-tailed synthetic rollouts or a real model's: :func:`benchmark_packing`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tlt_lightning.drafter import (
    Drafter,
    DrafterConfig,
    DrafterLoss,
    drafter_train_step,
    make_batches,
    pack_batches,
)
from tlt_lightning.drafter.packing import fill_ratio
from tlt_lightning.models import HFTarget
from tlt_lightning.reports import machine_info, median
from tlt_lightning.rollout.types import Rollout

__all__ = ["benchmark_packing"]


def _synthetic_rollouts(
    count: int, config: DrafterConfig, median: float, sigma: float, lo: int, hi: int, seed: int
) -> list[Rollout]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.empty(count, dtype=torch.float64).log_normal_(math.log(median), sigma, generator=g)
    lengths = lengths.round().clamp(lo, hi).long().tolist()
    C = len(config.rollout_feature_layers)
    return [
        Rollout(
            prompt_ids=torch.zeros(16, dtype=torch.long),
            token_ids=torch.randint(0, config.vocab_size, (T,), generator=g),
            logprobs=torch.zeros(T),
            finish_reason="length",
            first_token_time=0.0,
            finish_time=0.0,
            features=torch.randn(T, C, config.hidden_size, generator=g),
        )
        for T in lengths
    ]


def _check_packing(
    repeats: Any, rows: Any, target: Any, rollouts: Sequence[Rollout] | None, max_length: int, budget: int
) -> None:
    """Refuse :func:`benchmark_packing`'s settings that cannot run, naming the setting."""
    for name, value in (("repeats", repeats), ("rows", rows)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if rollouts is None and max_length - 1 > budget:
        raise ValueError(f"budget must hold the longest rollout's samples ({max_length - 1}), got {budget}")
    if (target is None) != (rollouts is None):
        raise ValueError("target and rollouts go together: pass both (a real model) or neither (synthetic)")
    if rollouts is not None and max(r.length for r in rollouts) - 1 > budget:
        raise ValueError(
            f"budget must hold the longest rollout's samples "
            f"({max(r.length for r in rollouts) - 1}), got {budget}"
        )


def _rows_like_padding(
    rollouts: Sequence[Rollout], config: DrafterConfig, budget: int, batch_size: int
) -> int:
    """Packed rows per step that take as many optimizer steps as padding ``batch_size`` sequences per
    step, so each step holds as many samples on average."""
    padded_steps = math.ceil(len(rollouts) / batch_size)
    return math.ceil(len(pack_batches(rollouts, config, budget, 1, False)) / padded_steps)


def _length_stats(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Median, 90th percentile, mean and longest of the rollouts' lengths."""
    lengths = torch.tensor([r.length for r in rollouts], dtype=torch.float64)
    return {
        "p50": float(lengths.median()),
        "p90": float(lengths.quantile(0.9)),
        "mean": float(lengths.mean()),
        "max": float(lengths.max()),
    }


def _random_target(hidden_size: int, vocab_size: int) -> HFTarget:
    """A random 4-layer Llama of ``hidden_size`` (only speed is measured on it)."""
    heads = max(1, hidden_size // 64)
    hf = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=4, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    return HFTarget(LlamaForCausalLM(hf).eval())


def _time_epochs(
    make: dict[str, Callable[[], list[Any]]], train_step: Callable[[Any], Any], repeats: int
) -> dict[str, dict[str, Any]]:
    """One epoch of each way's batches (``make``: name -> its epoch's batches), alternating ways
    ``repeats`` times after one warm-up step on the first way's first batch: per way the last epoch's
    batch statistics and the median epoch time."""
    train_step(next(iter(make.values()))()[0])  # warm-up
    times: dict[str, list[float]] = {k: [] for k in make}
    info: dict[str, dict[str, Any]] = {}
    for _ in range(repeats):
        for name, build in make.items():
            batches = build()
            start = time.perf_counter()
            for batch in batches:
                train_step(batch)
            times[name].append(time.perf_counter() - start)
            info[name] = {
                "steps": len(batches),
                "samples": sum(b.num_samples for b in batches),
                "fill_ratio": fill_ratio(batches),
                "max_width": max(b.mask.shape[1] for b in batches),
            }
    for name in make:
        info[name]["epoch_s"] = median(times[name])
        info[name]["samples_per_s"] = info[name]["samples"] / info[name]["epoch_s"]
        info[name]["epoch_s_all"] = times[name]
    return info


def benchmark_packing(
    num_rollouts: int = 64,
    budget: int = 512,
    batch_size: int = 8,
    rows: int | None = None,
    hidden_size: int = 256,
    vocab_size: int = 2048,
    kind: str = "eagle1",
    unroll_steps: int = 1,
    median_length: float = 80.0,
    sigma: float = 1.1,
    min_length: int = 10,
    max_length: int = 512,
    repeats: int = 3,
    seed: int = 0,
    target: Any = None,
    rollouts: Sequence[Rollout] | None = None,
    draft_vocab_size: int | None = None,
) -> dict[str, Any]:
    """Training throughput (samples/s) of packed vs padded batches on long-tailed lengths.

    Rollout lengths are lognormal (``median_length``, ``sigma``) clipped to ``min_length..max_length``
    (the defaults mimic SmolLM2 on countdown: p50 ~80, p90 ~330, a few percent at the cap). The
    target is a random 4-layer Llama of ``hidden_size`` (features are random too: only speed is
    measured). Padded: :func:`make_batches` with ``batch_size`` sequences per step. Packed:
    :func:`pack_batches` with ``rows`` rows of ``budget`` samples; by default as many rows as give
    the same number of optimizer steps per epoch as padding (so a step holds as many real samples
    on average: the comparison is per sample, not per step). One epoch over the same samples each,
    alternating padded / packed ``repeats`` times; medians.

    With ``target`` (a :class:`~tlt_lightning.models.TargetModel`, e.g. SmolLM2) and ``rollouts``
    (real rollouts of it with features, e.g. a ``drafter warmup`` rollouts cache) the real model
    and lengths are measured instead (``hidden_size``, ``vocab_size``, the length settings are then
    unused); ``draft_vocab_size`` sets the drafter's reduced vocabulary.

    Returns:
        ``{"padded": {...}, "packed": {...}, "speedup": packed/padded samples per second, ...}``.
    """
    _check_packing(repeats, rows, target, rollouts, max_length, budget)
    torch.manual_seed(seed)
    if target is None:
        target = _random_target(hidden_size, vocab_size)
    drafter = Drafter(DrafterConfig.from_target(target, kind, draft_vocab_size=draft_vocab_size), target)
    if rollouts is None:
        rollouts = _synthetic_rollouts(
            num_rollouts, drafter.config, median_length, sigma, min_length, max_length, seed
        )
    loss_cfg = DrafterLoss.for_kind(kind, unroll_steps)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seed)
    rows = rows or _rows_like_padding(rollouts, drafter.config, budget, batch_size)
    make = {
        "padded": lambda: make_batches(rollouts, drafter.config, batch_size, True, g),
        "packed": lambda: pack_batches(rollouts, drafter.config, budget, rows, True, g),
    }
    info = _time_epochs(
        make, lambda batch: drafter_train_step(drafter, target, batch, optimizer, loss_cfg), repeats
    )
    return {
        "padded": info["padded"],
        "packed": info["packed"],
        "speedup": info["packed"]["samples_per_s"] / info["padded"]["samples_per_s"],
        "lengths": _length_stats(rollouts),
        "settings": {
            "num_rollouts": len(rollouts),
            "budget": budget,
            "batch_size": batch_size,
            "rows": rows,
            "hidden_size": target.info.hidden_size,
            "vocab_size": target.info.vocab_size,
            "draft_vocab": drafter.config.draft_vocab,
            "kind": kind,
            "unroll_steps": unroll_steps,
            "median_length": median_length,
            "sigma": sigma,
            "repeats": repeats,
            "seed": seed,
        },
        "machine": machine_info(),
    }
