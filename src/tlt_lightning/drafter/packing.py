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
from collections.abc import Sequence

import torch

from tlt_lightning.drafter.batches import DrafterBatch, LazyBatches, split_rollout
from tlt_lightning.drafter.config import DrafterConfig
from tlt_lightning.rollout.types import Rollout
from tlt_lightning.validation import positive_int

__all__ = ["fill_ratio", "pack_batches", "pack_bins"]


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
    positive_int("budget", budget)
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
        rollouts: rollouts (or :class:`~tlt_lightning.spot.DrafterSample`) with features.
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
    positive_int("budget", budget)
    positive_int("rows", rows)
    docs = [chunk for i, r in enumerate(rollouts) for chunk in split_rollout(r, i, config, budget)]
    bins = pack_bins([d[0].shape[0] for d in docs], budget)
    if shuffle:
        bins = [bins[i] for i in torch.randperm(len(bins), generator=generator).tolist()]
    groups = [[[docs[i] for i in b] for b in bins[at : at + rows]] for at in range(0, len(bins), rows)]
    return LazyBatches(groups, budget if pad_to_budget else None, packed=True)


def fill_ratio(batches: Sequence[DrafterBatch]) -> float:
    """Real samples over sample slots (``1 - padding fraction``) of ``batches``."""
    slots = sum(b.mask.numel() for b in batches)
    return sum(b.num_samples for b in batches) / slots if slots else 0.0
