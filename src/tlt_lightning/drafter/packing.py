"""Sequence packing of drafter training samples into fixed token budgets.

Rollout lengths have a long tail (p50 ~80 tokens, p90 up to the 512 cap on countdown): padding a
batch to its longest sequence wastes most of the compute. :func:`pack_batches` puts several
sequences ("documents") into each row of ``budget`` samples (best-fit decreasing) and marks each
sample's document in :attr:`DrafterBatch.doc_ids`; :func:`~tlt_lightning.drafter.drafter_losses`
then uses a block-diagonal causal mask (no attention across documents) and positions restart per
document at each sample's true target position, so a packed batch has exactly the loss of the
same samples padded (tested).

Multi-step unrolling (``DrafterLoss.unroll_steps > 1``) works with packing too: the step-``k``
mask is restricted to the query's document, and a step only trains samples with ``k - 1``
earlier samples in their own document, so nothing leaks across the seams.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from tlt_lightning.drafter.config import DrafterConfig
from tlt_lightning.drafter.train import DrafterBatch, LazyBatches, _split, make_batches
from tlt_lightning.rollout.types import Rollout

__all__ = ["benchmark_packing", "fill_ratio", "pack_batches", "pack_bins"]


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def pack_bins(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Assign items of the given lengths to bins of capacity ``budget`` (best-fit decreasing).

    Items are placed longest first, each into the fullest bin that still has room (a new bin if
    none has): the same worst case as first-fit decreasing (11/9 OPT + 1 bins), in ``O(n log n)``.

    Args:
        lengths: item sizes, each in ``1..budget``.
        budget: bin capacity.

    Returns:
        Lists of item indices per bin, bins in creation order.

    Example:
        >>> pack_bins([5, 3, 4, 2], budget=7)
        [[0, 3], [2, 1]]
    """
    _positive_int("budget", budget)
    bad = [n for n in lengths if not 1 <= n <= budget]
    if bad:
        raise ValueError(f"lengths must lie in 1..budget={budget}, got {bad[:5]}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining room, bin id)
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))  # the tightest bin with room >= n
        if at == len(free):
            bins.append([i])
            room, b = budget - n, len(bins) - 1
        else:
            room, b = free.pop(at)
            bins[b].append(i)
            room -= n
        if room > 0:
            bisect.insort(free, (room, b))
    return bins


def pack_batches(
    rollouts: Sequence[Rollout],
    config: DrafterConfig,
    budget: int,
    rows: int = 1,
    shuffle: bool = True,
    generator: torch.Generator | None = None,
    pad_to_budget: bool = False,
) -> LazyBatches:
    """Turn rollouts (with features) into packed training batches of ``rows x budget`` samples.

    A rollout of ``T`` tokens gives ``T - 1`` samples; longer than ``budget`` it is split into
    chunks of ``budget`` (as ``make_batches(max_len=budget)``), each its own document.

    Args:
        rollouts: rollouts (or :class:`~tlt_lightning.drafter.DrafterSample`) with features.
        config: the drafter's config (which feature channels are inputs).
        budget: samples (tokens) per row.
        rows: rows per batch (a batch holds at most ``rows * budget`` samples).
        shuffle: shuffle the packed rows (with ``generator``) before grouping them into batches.
        generator: CPU random source for the shuffle.
        pad_to_budget: pad every row to exactly ``budget`` (static shapes, e.g. for CUDA graphs);
            otherwise a batch is as wide as its fullest row.

    Returns:
        :class:`DrafterBatch` es with ``doc_ids`` set (``-1`` on padding), each built when accessed.

    Example:
        >>> # batches = pack_batches(buffer.sample(64, g), drafter.config, budget=512, rows=8)
        >>> # drafter_train_step(drafter, target, batches[0], optimizer)
    """
    _positive_int("budget", budget)
    _positive_int("rows", rows)
    docs = [chunk for i, r in enumerate(rollouts) for chunk in _split(r, i, config, budget)]
    bins = pack_bins([d[0].shape[0] for d in docs], budget)
    if shuffle:
        bins = [bins[i] for i in torch.randperm(len(bins), generator=generator).tolist()]
    groups = [[[docs[i] for i in b] for b in bins[at : at + rows]] for at in range(0, len(bins), rows)]
    return LazyBatches(groups, budget if pad_to_budget else None, packed=True)


def fill_ratio(batches: Sequence[DrafterBatch]) -> float:
    """Real samples over sample slots (``1 - padding fraction``) of ``batches``."""
    slots = sum(b.mask.numel() for b in batches)
    return sum(b.num_samples for b in batches) / slots if slots else 0.0


# ---------------------------------------------------------------------------------- benchmark
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
    target is a random 2-layer Llama of ``hidden_size`` (features are random too: only speed is
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
    from transformers import LlamaConfig, LlamaForCausalLM

    from tlt_lightning.reports import machine_info, median
    from tlt_lightning.drafter.losses import DrafterLoss
    from tlt_lightning.drafter.model import Drafter
    from tlt_lightning.drafter.train import drafter_train_step
    from tlt_lightning.models.target import HFTarget

    _positive_int("repeats", repeats)
    if rows is not None:
        _positive_int("rows", rows)
    if rollouts is None and max_length - 1 > budget:
        raise ValueError(f"budget must hold the longest rollout's samples ({max_length - 1}), got {budget}")
    if (target is None) != (rollouts is None):
        raise ValueError("target and rollouts go together: pass both (a real model) or neither (synthetic)")
    torch.manual_seed(seed)
    if target is None:
        heads = max(1, hidden_size // 64)
        hf = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=4, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
            max_position_embeddings=2048, tie_word_embeddings=True,
        )  # fmt: skip
        target = HFTarget(LlamaForCausalLM(hf).eval())
    drafter = Drafter(DrafterConfig.from_target(target, kind, draft_vocab_size=draft_vocab_size), target)
    if rollouts is None:
        rollouts = _synthetic_rollouts(
            num_rollouts, drafter.config, median_length, sigma, min_length, max_length, seed
        )
    elif max(r.length for r in rollouts) - 1 > budget:
        raise ValueError(f"budget must hold the longest rollout's samples "
                         f"({max(r.length for r in rollouts) - 1}), got {budget}")
    loss_cfg = DrafterLoss.for_kind(kind, unroll_steps)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seed)
    if rows is None:  # as many optimizer steps as padding takes, so each step holds as many samples
        padded_steps = math.ceil(len(rollouts) / batch_size)
        rows = math.ceil(len(pack_batches(rollouts, drafter.config, budget, 1, False)) / padded_steps)
    make = {
        "padded": lambda: make_batches(rollouts, drafter.config, batch_size, True, g),
        "packed": lambda: pack_batches(rollouts, drafter.config, budget, rows, True, g),
    }
    times: dict[str, list[float]] = {k: [] for k in make}
    info: dict[str, dict[str, Any]] = {}
    drafter_train_step(drafter, target, make["padded"]()[0], optimizer, loss_cfg)  # warm-up
    for _ in range(repeats):
        for name, build in make.items():
            batches = build()
            start = time.perf_counter()
            for batch in batches:
                drafter_train_step(drafter, target, batch, optimizer, loss_cfg)
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
    lengths = torch.tensor([r.length for r in rollouts], dtype=torch.float64)
    return {
        "padded": info["padded"],
        "packed": info["packed"],
        "speedup": info["packed"]["samples_per_s"] / info["padded"]["samples_per_s"],
        "lengths": {
            "p50": float(lengths.median()),
            "p90": float(lengths.quantile(0.9)),
            "mean": float(lengths.mean()),
            "max": float(lengths.max()),
        },
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
