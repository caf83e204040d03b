"""The folders :class:`~tlt_lightning.spot.AsyncCheckpointer` writes, read back: their files, the
complete ones in a directory, and loading one into a drafter and its optimizer.

Layout of one checkpoint (``model.safetensors`` + ``config.json`` is the format of
``Drafter.save_pretrained``, so ``Drafter.from_pretrained``, :func:`~tlt_lightning.drafter.load_drafter`
and the exporters read it directly; before it, the config was ``drafter_config.json``)::

    step-00000042/
        model.safetensors      the drafter's own tensors
        config.json            its config
        optimizer.pt           the optimizer's state_dict (torch.save)
        meta.json              {"step": 42, "extra": {...}, "time": ..., "writer": "..."}
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from tlt_lightning.drafter.io import WEIGHTS_NAME, check_finite_tensors
from tlt_lightning.drafter.model import Drafter
from tlt_lightning.safe_load import load_torch_file
from tlt_lightning.validation import read_json_object

__all__ = [
    "META_NAME",
    "OPTIMIZER_NAME",
    "CheckpointInfo",
    "list_checkpoints",
    "load_checkpoint",
    "read_meta",
]

OPTIMIZER_NAME = "optimizer.pt"
META_NAME = "meta.json"
_NAME = re.compile(r"^step-(\d{8,})$")


class CheckpointInfo(NamedTuple):
    """What :func:`load_checkpoint` (``AsyncCheckpointer.load``) restored."""

    path: Path
    step: int
    extra: dict[str, Any]


def read_meta(path: Path) -> dict[str, Any] | None:
    """The ``meta.json`` of checkpoint folder ``path``; ``None`` if it is missing or not a JSON object."""
    try:
        meta = json.loads((path / META_NAME).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (``step-*`` folders with their ``meta.json``) in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in directory.iterdir()
        if (m := _NAME.match(p.name)) and (p / META_NAME).is_file()
    ]
    return [p for _, p in sorted(found)]


def load_checkpoint(
    path: str | os.PathLike, drafter: Drafter, optimizer: torch.optim.Optimizer | None = None
) -> CheckpointInfo:
    """Load a checkpoint into ``drafter`` (strict) and ``optimizer`` (when given and saved).

    Raises:
        ValueError: ``path`` is not a complete checkpoint, a file is empty, corrupt or not of its
            format (the message names the file), or its tensors do not fit ``drafter`` or are
            not finite.
    """
    path = Path(path)
    meta_path = path / META_NAME
    if not meta_path.is_file() or not (path / WEIGHTS_NAME).is_file():
        raise ValueError(f"{path} is not a complete drafter checkpoint (no {META_NAME} / {WEIGHTS_NAME})")
    for name in (META_NAME, WEIGHTS_NAME, OPTIMIZER_NAME):
        if (path / name).is_file() and (path / name).stat().st_size == 0:
            raise ValueError(
                f"{path / name} is empty (0 bytes): the checkpoint is incomplete; load an older one"
            )
    meta = read_json_object(meta_path)
    try:
        tensors = load_file(path / WEIGHTS_NAME, device=str(drafter.device))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path / WEIGHTS_NAME} is corrupt or not a safetensors file: {err}") from err
    check_finite_tensors(tensors, path / WEIGHTS_NAME)
    expected = drafter.state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    bad = [k for k in set(expected) & set(tensors) if tensors[k].shape != expected[k].shape]
    if missing or unexpected or bad:
        raise ValueError(
            f"{path} does not fit the drafter: missing {missing}, unexpected {unexpected}, "
            f"shape mismatch {bad}"
        )
    drafter.load_state_dict(tensors, strict=True)
    if optimizer is not None and (path / OPTIMIZER_NAME).is_file():
        state = load_torch_file(path / OPTIMIZER_NAME, "an optimizer state")
        if not isinstance(state, dict) or not {"state", "param_groups"} <= set(state):
            raise ValueError(f"{path / OPTIMIZER_NAME} is not an optimizer state (no state / param_groups)")
        try:
            optimizer.load_state_dict(state)
        except (ValueError, KeyError, TypeError, IndexError) as err:
            raise ValueError(f"{path / OPTIMIZER_NAME} does not fit the optimizer: {err}") from err
    return CheckpointInfo(path, int(meta.get("step", 0)), dict(meta.get("extra", {})))
