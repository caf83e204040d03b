"""Resuming ``tlt-lightning fit --ckpt_path``: what the checkpoint was trained with, and what changed.

Lightning's ``LightningCLI`` silently replaces the ``model:`` section by the hyper-parameters saved in
the checkpoint, so ``--model.*`` overrides and config edits are dropped on resume. ``tlt-lightning
fit`` compares them instead (:func:`resume_conflicts`) and, by default, refuses to resume with
settings that differ from the checkpoint's, listing each one as ``old -> new`` and how to proceed
(:func:`check_resume`): ``--resume_overrides=apply`` applies them (the run then differs from the
uninterrupted one), ``--resume_overrides=checkpoint`` keeps the checkpoint's (Lightning's behaviour).
What is known once the fit has started is compared as the checkpoint loads, with the same choice
(:func:`~tlt_lightning.validation.check_resumed_settings`): the prompt source (the module) and the
callbacks' settings (spot drafter, bandit, efficiency callbacks); those are applied or refused (the
checkpoint's values cannot be restored into objects built from the config), never mixed.

Example:
    >>> resume_conflicts({"optim": {"lr": 0.01}, "seed": 0}, {"optim": {"lr": 0.5}, "seed": 0})
    {'optim.lr': (0.01, 0.5)}
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from tlt_lightning.rl.config import OptimConfig, SpeculativeConfig
from tlt_lightning.rl.tasks import TaskConfig
from tlt_lightning.rollout import RolloutConfig
from tlt_lightning.safe_load import TRUST_ENV, load_torch_file, trusts_checkpoints
from tlt_lightning.tracking.mlflow_resume import LIGHTNING_CKPT_NAMES
from tlt_lightning.validation import RESUME_OVERRIDES, check

__all__ = [
    "HARMLESS_ON_RESUME",
    "LIGHTNING_CKPT_NAMES",
    "RESUME_OVERRIDES",
    "check_resume",
    "checkpoint_weights_only",
    "read_checkpoint",
    "resume_conflicts",
]

HARMLESS_ON_RESUME = frozenset({"rollout_progress", "check_logprobs", "logprob_tolerance", "max_abs_reward"})
"""Module settings that change what is shown or checked, never what is sampled or learned: a
resumed run takes the new value without asking."""

_KEYS_NOT_SETTINGS = ("_instantiator", "_class_path")  # what LightningCLI adds to hparams


def checkpoint_weights_only(weights_only: bool | None) -> bool:
    """What ``Trainer.fit(weights_only=...)`` gets: ``True`` (no pickled objects are read) unless the
    checkpoints are trusted (:data:`~tlt_lightning.safe_load.TRUST_ENV`).

    Raises:
        ValueError: ``weights_only=False`` without that trust (a full unpickle runs code from the file).
    """
    if weights_only is False and not trusts_checkpoints():
        raise ValueError(
            "weights_only=False reads the checkpoint with a full unpickle, which runs any code the file "
            f"holds: set {TRUST_ENV}=1 as well if you trust it (or drop weights_only)"
        )
    return (not trusts_checkpoints()) if weights_only is None else bool(weights_only)


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A Lightning checkpoint's contents (tensors memory-mapped where the format allows).

    Raises:
        ValueError: ``path`` is missing, empty, truncated or not a torch checkpoint; the message
            names the file and what to do.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"ckpt_path {str(path)!r} is not a file: pass the .ckpt file of a run "
            "(e.g. .../checkpoints/last.ckpt)"
        )
    if path.stat().st_size == 0:
        raise ValueError(
            f"ckpt_path {str(path)!r} is empty (0 bytes): the run was probably killed while saving it; "
            "resume from an older checkpoint"
        )
    try:
        checkpoint = load_torch_file(path, "a Lightning checkpoint", mmap=True)
    except ValueError as err:
        raise ValueError(f"ckpt_path {err}; resume from another checkpoint") from err
    if not isinstance(checkpoint, Mapping) or "state_dict" not in checkpoint:
        raise ValueError(f"ckpt_path {str(path)!r} is not a Lightning checkpoint (no state_dict)")
    return dict(checkpoint)


_GROUPS = {
    "task": TaskConfig,
    "rollout": RolloutConfig,
    "optim": OptimConfig,
    "speculative": SpeculativeConfig,
}
"""GRPOModule's grouped settings: compared field by field (``optim.lr``), their defaults filled in."""


def _plain(value: Any) -> Any:
    if hasattr(value, "as_dict"):  # a jsonargparse Namespace
        value = value.as_dict()
    elif is_dataclass(value) and not isinstance(value, type):  # a group given as its config
        value = asdict(value)
    return list(value) if isinstance(value, tuple) else value


def _settings(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """``hparams`` with every group flattened to ``group.field`` keys (a group that does not parse stays
    whole)."""
    out = {}
    for key, value in hparams.items():
        value = _plain(value)
        if key in _GROUPS and (value is None or isinstance(value, Mapping)):
            try:
                fields = asdict(_GROUPS[key](**(value or {})))
            except (TypeError, ValueError):
                out[key] = value
                continue
            out.update({f"{key}.{name}": _plain(v) for name, v in fields.items()})
        else:
            out[key] = value
    return out


def resume_conflicts(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (checkpoint value, configured value)}`` for every saved module setting the config changes.

    Grouped settings are compared field by field (``{"optim.lr": (0.01, 0.5)}``). Keys only one side
    has (a setting added in a later version, the prompt source) are not conflicts.
    """
    saved, current = _settings(saved), _settings(current)
    return {
        key: (old, current[key])
        for key, old in saved.items()
        if key not in _KEYS_NOT_SETTINGS and key in current and old != current[key]
    }


def check_resume(
    ckpt_path: str | os.PathLike, saved: Mapping[str, Any], current: Mapping[str, Any], mode: str = "refuse"
) -> dict[str, tuple[Any, Any]]:
    """The conflicts a resume may go on with; raises where ``mode`` is ``"refuse"`` and one matters.

    Args:
        ckpt_path: the checkpoint (for the message).
        saved: its module hyper-parameters.
        current: the module settings of the config and command line.
        mode: one of :data:`RESUME_OVERRIDES`.

    Returns:
        The conflicts (``{key: (old, new)}``); with ``"refuse"`` only harmless ones
        (:data:`HARMLESS_ON_RESUME`) are left, and the configured values are applied.

    Raises:
        ValueError: ``mode`` is not one of :data:`RESUME_OVERRIDES`, or it is ``"refuse"`` and a
            setting that changes the run differs; the message lists every one as ``model.key: old -> new``.
    """
    check(mode in RESUME_OVERRIDES, "resume_overrides", mode, f"one of {RESUME_OVERRIDES}")
    conflicts = resume_conflicts(saved, current)
    blocking = {k: v for k, v in conflicts.items() if k not in HARMLESS_ON_RESUME}
    if mode == "refuse" and blocking:
        listed = "\n".join(f"  model.{k}: {old!r} -> {new!r}" for k, (old, new) in sorted(blocking.items()))
        raise ValueError(
            f"resuming from {str(ckpt_path)!r} with module settings that differ from the checkpoint's "
            f"(checkpoint -> now):\n{listed}\n"
            "To continue the checkpointed run exactly, drop these overrides (or restore the config). To "
            "apply them anyway (the run then differs from an uninterrupted one), add "
            "--resume_overrides=apply; to keep the checkpoint's values, add --resume_overrides=checkpoint."
        )
    return conflicts
