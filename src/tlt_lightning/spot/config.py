"""SpotConfig: the settings of a :class:`~tlt_lightning.spot.SpotDrafter`, validated."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tlt_lightning.drafter import DRAFTER_KINDS, SpotTrainerConfig
from tlt_lightning.drafter.spot_trainer import _check, _is_int, _is_number

__all__ = ["SpotConfig"]


@dataclass(frozen=True)
class SpotConfig:
    """What the spot drafter keeps, builds and saves; the drafter's optimizer settings are ``training``.

    Args:
        training: optimizer, packing, paid budget and seed of the drafter training.
        buffer_mb: memory bound of the rollout buffer in MiB (``> 0``); oldest rollouts are evicted.
        recency_decay: buffer sampling weight ``recency_decay ** age`` in policy steps, in ``(0, 1]``.
        min_idle_s: train in a tail only if it lasts at least this long (``>= 0`` seconds).
        checkpoint_interval: save the drafter asynchronously every this many RL steps (``>= 1``);
            ``None``: only when asked (:meth:`SpotDrafter.save`).
        kind: drafter kind built when none is given, ``"eagle1"`` or ``"eagle3"``.
        draft_vocab_size: draft vocabulary of a built drafter, capped at the target's vocabulary
            (``>= 1``; ``None``: full vocabulary).
        drafter_path: load the drafter from this directory or ``models:/`` / ``runs:/`` URI instead
            of building one.
    """

    training: SpotTrainerConfig = field(default_factory=SpotTrainerConfig)
    buffer_mb: float = 256.0
    recency_decay: float = 0.5
    min_idle_s: float = 0.05
    checkpoint_interval: int | None = 10
    kind: str = "eagle1"
    draft_vocab_size: int | None = 8192
    drafter_path: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        interval, vocab, path = self.checkpoint_interval, self.draft_vocab_size, self.drafter_path
        for name, value, ok, allowed in (
            ("training", self.training, isinstance(self.training, SpotTrainerConfig), "a SpotTrainerConfig"),
            ("buffer_mb", self.buffer_mb, _is_number(self.buffer_mb) and self.buffer_mb > 0,
             "a finite number > 0 (MiB)"),
            ("checkpoint_interval", interval, interval is None or (_is_int(interval) and interval >= 1),
             "an int >= 1 or None"),
            ("min_idle_s", self.min_idle_s, _is_number(self.min_idle_s) and self.min_idle_s >= 0,
             "a finite number >= 0"),
            ("kind", self.kind, self.kind in DRAFTER_KINDS, f"one of {DRAFTER_KINDS}"),
            ("draft_vocab_size", vocab, vocab is None or (_is_int(vocab) and vocab >= 1), "an int >= 1 or None"),
            ("drafter_path", path, path is None or isinstance(path, (str, os.PathLike)),
             "a directory path, a models:/ or runs:/ URI, or None"),
            ("recency_decay", self.recency_decay,
             _is_number(self.recency_decay) and 0 < self.recency_decay <= 1, "in (0, 1]"),
        ):
            _check(ok, name, value, allowed)
