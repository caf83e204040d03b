"""SpotConfig: the settings of a :class:`~tlt_lightning.spot.SpotDrafter`, validated."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from tlt_lightning.drafter.config import DRAFTER_KINDS
from tlt_lightning.drafter.location import DrafterLocation, drafter_location
from tlt_lightning.spot.trainer import SpotTrainerConfig
from tlt_lightning.validation import check, is_int, is_number

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
            of building one (relative to the config file that names it:
            :mod:`~tlt_lightning.drafter.location`); kept as a string.

    Example:
        >>> config = SpotConfig.from_dict({"buffer_mb": 64, "training": {"max_steps_per_rollout": 2}})
        >>> config.buffer_mb, config.training.max_steps_per_rollout
        (64, 2)
    """

    training: SpotTrainerConfig = field(default_factory=SpotTrainerConfig)
    buffer_mb: float = 256.0
    recency_decay: float = 0.5
    min_idle_s: float = 0.05
    checkpoint_interval: int | None = 10
    kind: str = "eagle1"
    draft_vocab_size: int | None = 8192
    drafter_path: DrafterLocation | None = None

    def __post_init__(self) -> None:
        interval, vocab, path = self.checkpoint_interval, self.draft_vocab_size, self.drafter_path
        for name, value, ok, allowed in (
            ("training", self.training, isinstance(self.training, SpotTrainerConfig), "a SpotTrainerConfig"),
            (
                "buffer_mb",
                self.buffer_mb,
                is_number(self.buffer_mb) and self.buffer_mb > 0,
                "a finite number > 0 (MiB)",
            ),
            (
                "checkpoint_interval",
                interval,
                interval is None or (is_int(interval) and interval >= 1),
                "an int >= 1 or None",
            ),
            (
                "min_idle_s",
                self.min_idle_s,
                is_number(self.min_idle_s) and self.min_idle_s >= 0,
                "a finite number >= 0",
            ),
            ("kind", self.kind, self.kind in DRAFTER_KINDS, f"one of {DRAFTER_KINDS}"),
            (
                "draft_vocab_size",
                vocab,
                vocab is None or (is_int(vocab) and vocab >= 1),
                "an int >= 1 or None",
            ),
            (
                "drafter_path",
                path,
                path is None or isinstance(path, (str, os.PathLike)),
                "a directory path, a models:/ or runs:/ URI, or None",
            ),
            (
                "recency_decay",
                self.recency_decay,
                is_number(self.recency_decay) and 0 < self.recency_decay <= 1,
                "in (0, 1]",
            ),
        ):
            check(ok, name, value, allowed)
        object.__setattr__(self, "drafter_path", drafter_location(path))  # a string (absolute once resolved)

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any]) -> SpotConfig:
        """A config of a mapping of its fields, ``training`` a :class:`SpotTrainerConfig` or a mapping of its
        fields (as a YAML config gives them).

        Raises:
            ValueError: an unknown field; one of ``training`` given at the top names where it belongs.
        """
        settings = dict(settings)
        own, training = {f.name for f in fields(cls)}, {f.name for f in fields(SpotTrainerConfig)}
        for name in sorted(settings.keys() - own):
            if name in training:
                raise ValueError(
                    f"{name} is a setting of SpotConfig.training: pass {{'training': {{{name!r}: ...}}}}"
                )
            raise ValueError(f"{name} is not a field of SpotConfig; its fields are {sorted(own)}")
        if isinstance(settings.get("training"), Mapping):
            settings["training"] = SpotTrainerConfig(**settings["training"])
        return cls(**settings)
