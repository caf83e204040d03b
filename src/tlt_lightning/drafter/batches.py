"""Drafter training batches from rollouts: samples cut into chunks, collated (padded or packed), lazily.

See :mod:`tlt_lightning.drafter.train` for what a sample is (its input, features and targets).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from tlt_lightning.drafter.config import DrafterConfig
from tlt_lightning.rollout.types import Rollout

__all__ = ["Chunk", "DrafterBatch", "LazyBatches", "make_batches", "split_rollout", "unroll_mask"]


def unroll_mask(valid: torch.Tensor, step: int, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Attention mask of draft step ``step`` over the keys of steps ``1..step`` (concatenated).

    Query ``i`` of step ``k`` sees the step-1 keys ``j <= i - k + 1`` (true features) and, for each
    step ``2 <= s <= k``, the one key ``j = i - (k - s)`` (its own chain of drafted tokens).

    Args:
        valid: ``[B, S]`` bool real samples (right padding).
        step: ``k >= 1``.
        doc_ids: ``[B, S]`` document of each sample (packed rows): keys of other documents are
            hidden too. ``None``: one document per row.

    Returns:
        ``[B, 1, S, k * S]`` bool; every query sees at least itself.
    """
    S = valid.shape[1]
    i = torch.arange(S, device=valid.device)[:, None]
    j = torch.arange(S, device=valid.device)[None, :]
    blocks = [((j <= i - (step - 1)) & valid[:, None, :])]
    blocks += [(j == i - (step - s)).expand(valid.shape[0], S, S) for s in range(2, step + 1)]
    if doc_ids is not None:
        same = doc_ids[:, :, None] == doc_ids[:, None, :]
        blocks = [block & same for block in blocks]
    mask = torch.cat(blocks, dim=-1)
    mask[..., (step - 1) * S :] |= torch.eye(S, dtype=torch.bool, device=valid.device)
    return mask[:, None]


@dataclass
class DrafterBatch:
    """``B`` rows of ``S`` training samples: one right-padded sequence per row, or packed documents.

    Attributes:
        tokens: ``[B, S]`` int64 input tokens (``token_ids[i]``).
        features: ``[B, S, C, H]`` target features feeding the drafter (``features[i, :C]``).
        target_hidden: ``[B, S, H]`` the target's final state at ``i + 1``.
        positions: ``[B, S]`` int64 target positions of the input features (prompt length - 1 + i).
        mask: ``[B, S]`` bool, True for real samples (False for padding).
        doc_ids: ``[B, S]`` int64 document of each sample when several sequences are packed into a
            row (:func:`~tlt_lightning.drafter.pack_batches`; ``-1`` for padding): attention never
            crosses documents. ``None``: one sequence per row (:func:`make_batches`).
    """

    tokens: torch.Tensor
    features: torch.Tensor
    target_hidden: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    doc_ids: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        return int(self.mask.sum())

    @property
    def attention_mask(self) -> torch.Tensor:
        """``[B, 1, S, S]`` bool step-1 mask: causal within each document (block-diagonal when packed)."""
        return unroll_mask(self.mask, 1, self.doc_ids)

    def sample_index(self) -> torch.Tensor:
        """``[B, S]`` int64 index of each sample within its sequence (document)."""
        B, S = self.mask.shape
        idx = torch.arange(S, device=self.mask.device).expand(B, S)
        if self.doc_ids is None:
            return idx
        starts = torch.ones_like(self.mask)
        starts[:, 1:] = self.doc_ids[:, 1:] != self.doc_ids[:, :-1]
        return idx - torch.where(starts, idx, 0).cummax(dim=1).values

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> DrafterBatch:
        """This batch on ``device``, its features cast to ``dtype`` (when given)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return t.to(device, dtype) if dtype is not None and t.is_floating_point() else t.to(device)

        return DrafterBatch(**{f.name: move(getattr(self, f.name)) for f in fields(self)})


Chunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""One sequence's samples ``(tokens [n], features [n, C, H], target_hidden [n, H], positions [n])``."""


def split_rollout(rollout: Rollout, index: int, config: DrafterConfig, max_len: int | None) -> list[Chunk]:
    """The samples of one rollout as ``(tokens, features, target_hidden, positions)`` chunks.

    Args:
        rollout: one rollout with its target features (``RolloutConfig.feature_layers``).
        index: its index among the rollouts, named in errors.
        config: the drafter's config (its feature layers and hidden size).
        max_len: the most samples per chunk; ``None``: one chunk.

    Raises:
        ValueError: the rollout has no features, or not the drafter's.
    """
    feats = rollout.features
    if feats is None:
        raise ValueError(
            f"rollouts[{index}] has no features: generate with RolloutConfig.feature_layers="
            f"{config.rollout_feature_layers} (drafter.config.rollout_feature_layers)"
        )
    C, H, T = config.num_features, config.hidden_size, rollout.length
    final_in_inputs = config.feature_layers[-1] == config.num_target_layers
    if (
        feats.dim() != 3
        or feats.shape[2] != H
        or not (feats.shape[1] == C + 1 or (feats.shape[1] == C and final_in_inputs))
    ):
        raise ValueError(
            f"rollouts[{index}].features must be [T, {C + 1}, {H}] (the drafter's feature layers "
            f"{config.feature_layers} then the final state), got {list(feats.shape)}"
        )
    if T < 2:
        return []
    S = T - 1
    start = rollout.prompt_ids.numel() - 1
    sample = (
        rollout.token_ids[:S],
        feats[:S, :C],
        feats[1:, -1],
        torch.arange(start, start + S, device=feats.device),
    )
    step = max_len or S
    return [tuple(t[i : i + step] for t in sample) for i in range(0, S, step)]


def _collate(rows: Sequence[Sequence[Chunk]], width: int | None = None, packed: bool = False) -> DrafterBatch:
    """Copy the chunks of each row side by side into one right-padded :class:`DrafterBatch`.

    Args:
        rows: ``B`` rows, each a list of chunks (one chunk per row unless packed).
        width: samples per row (default: the fullest row's).
        packed: set :attr:`DrafterBatch.doc_ids` (each chunk its own document).

    Returns:
        A batch of ``[B, width]`` samples in the chunks' dtype.
    """
    fill = [sum(chunk[0].shape[0] for chunk in row) for row in rows]
    S = width or max(fill)
    tokens, feats, final, pos = (
        torch.zeros((len(rows), S, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in rows[0][0]
    )
    mask = torch.zeros(len(rows), S, dtype=torch.bool, device=tokens.device)
    doc_ids = torch.full((len(rows), S), -1, dtype=torch.long, device=tokens.device)
    doc = 0
    for r, row in enumerate(rows):
        at = 0
        for tok, f, h, p in row:
            sl = slice(at, at + tok.shape[0])
            tokens[r, sl], feats[r, sl], final[r, sl], pos[r, sl] = tok, f, h, p
            mask[r, sl], doc_ids[r, sl] = True, doc
            at, doc = sl.stop, doc + 1
        if at < S:  # padding continues the positions (any value works: it is masked)
            pos[r, at:] = pos[r, at - 1] + torch.arange(1, S - at + 1, device=pos.device)
    return DrafterBatch(tokens, feats, final, pos, mask, doc_ids if packed else None)


class LazyBatches(Sequence[DrafterBatch]):
    """Batches collated on access from views of the rollouts' tensors.

    An epoch of padded copies never sits in memory at once (on a large warm-up set it would
    double the features' footprint): only the batch being trained on is materialised.

    Args:
        groups: per batch, its rows of chunks (see :func:`_collate`).
        width: samples per row (``None``: each batch as wide as its fullest row).
        packed: batches carry ``doc_ids``.
    """

    def __init__(self, groups: list[list[list[Chunk]]], width: int | None = None, packed: bool = False):
        self._groups, self._width, self._packed = groups, width, packed

    def __len__(self) -> int:
        return len(self._groups)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return _collate(self._groups[index], self._width, self._packed)


def make_batches(
    rollouts: Sequence[Rollout],
    config: DrafterConfig,
    batch_size: int,
    shuffle: bool = True,
    generator: torch.Generator | None = None,
    max_len: int | None = None,
) -> LazyBatches:
    """Turn rollouts (with features) into padded training batches (one sequence per row).

    Args:
        rollouts: rollouts generated with ``feature_layers = config.rollout_feature_layers``.
        config: the drafter's config (which feature channels are inputs).
        batch_size: sequences per batch.
        shuffle: shuffle the sequences (with ``generator``) before batching.
        generator: CPU random source for the shuffle.
        max_len: split sequences longer than this many samples (bounds the padded width).

    Returns:
        Batches of at most ``batch_size`` sequences, each built when accessed; rollouts with fewer
        than 2 tokens are skipped. Bad rollouts raise here, not on access.

    Example:
        >>> # engine = engine.with_config(feature_layers=cfg.rollout_feature_layers)
        >>> # rollouts = engine.generate(prompts).rollouts
        >>> # batches = make_batches(rollouts, cfg, batch_size=8)
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if max_len is not None and (not isinstance(max_len, int) or max_len <= 0):
        raise ValueError(f"max_len must be a positive int or None, got {max_len!r}")
    seqs = [chunk for i, r in enumerate(rollouts) for chunk in split_rollout(r, i, config, max_len)]
    if shuffle:
        seqs = [seqs[i] for i in torch.randperm(len(seqs), generator=generator).tolist()]
    return LazyBatches([[[s] for s in seqs[i : i + batch_size]] for i in range(0, len(seqs), batch_size)])
