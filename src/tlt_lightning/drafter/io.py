"""Drafter checkpoints on disk: :func:`save_drafter` (atomic), :func:`load_drafter` (paths, MLflow URIs).

The format is the Hugging Face layout of ``Drafter.save_pretrained`` (``config.json`` +
``model.safetensors`` + ``README.md``, see :mod:`tlt_lightning.drafter.hub`); checkpoints of the
earlier layout (``drafter_config.json``) load too. The embedding and LM head are the target's and are
not saved; ``d2t``/``t2d`` are, when the draft vocabulary is reduced. Loading is strict: anything that
does not fit raises ``ValueError``; nothing loads silently.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from tlt_lightning.drafter.hub import (
    CONFIG_NAME,
    FORMAT_VERSION,
    LEGACY_CONFIG_NAME,
    WEIGHTS_NAME,
    check_draft_vocab,
    check_finite_tensors,
    is_drafter_checkpoint,
    load_drafter_weights,
    read_drafter_config,
)
from tlt_lightning.drafter.mlflow_uri import download_drafter, is_mlflow_uri
from tlt_lightning.drafter.model import Drafter
from tlt_lightning.models.target import TargetModel

__all__ = [
    "CONFIG_NAME",
    "FORMAT_VERSION",
    "LEGACY_CONFIG_NAME",
    "WEIGHTS_NAME",
    "check_draft_vocab",
    "check_finite_tensors",
    "load_drafter",
    "read_drafter_config",
    "save_drafter",
]


def save_drafter(drafter: Drafter, directory: str | os.PathLike) -> Path:
    """Write ``drafter`` to ``directory`` atomically (a temp dir beside it, then a rename).

    An existing drafter checkpoint at ``directory`` is replaced; any other non-empty directory
    is refused, so a wrong path never deletes unrelated files.

    Returns:
        The checkpoint directory.

    Example:
        >>> # save_drafter(drafter, "ckpt/drafter"); load_drafter("ckpt/drafter", target)
    """
    directory = Path(directory)
    if directory.exists() and (
        not directory.is_dir() or (any(directory.iterdir()) and not is_drafter_checkpoint(directory))
    ):
        raise ValueError(f"{directory} exists and is not a drafter checkpoint; refusing to overwrite it")
    return replace_directory(directory, drafter.save_pretrained)


def replace_directory(directory: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` into a temp dir beside ``directory``, then rename it into place.

    The caller checks that ``directory`` may be replaced. Killed at any point, the old directory
    (or, after the swap, the new one) is complete: readers never see a half-written checkpoint.
    """
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    old = None
    try:
        write(tmp)
        tmp.chmod(0o755)
        if directory.exists():  # rename() cannot replace a non-empty directory: move the old one aside
            old = directory.with_name(f".{directory.name}-old-{os.getpid()}")
            os.replace(directory, old)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not directory.exists():
            os.replace(old, directory)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return directory


def load_drafter(
    directory: str | os.PathLike,
    target: TargetModel,
    dtype: torch.dtype | None = None,
    tracking_uri: str | None = None,
) -> Drafter:
    """Load a drafter saved by :func:`save_drafter` for ``target``.

    Args:
        directory: the checkpoint directory, or an MLflow URI of one: ``models:/<name>/<version>``,
            ``models:/<name>@<alias>`` (a registered drafter version) or ``runs:/<run id>/<path>``
            (downloaded to a temporary directory, see
            :func:`~tlt_lightning.drafter.mlflow_uri.download_drafter`).
        target: the target it drafts for (its config must match; its embedding and LM head are used).
        dtype: parameter dtype (default: the target's).
        tracking_uri: the MLflow store of a URI; ``None``: ``$MLFLOW_TRACKING_URI``, else the store
            of ``tlt-lightning fit`` (``sqlite:///runs/mlflow.db``).

    Raises:
        ValueError: missing/corrupt files, a config that does not match ``target``, missing or
            unexpected tensors, shape mismatches or an inconsistent draft vocabulary; a URI that
            does not resolve (the message names what exists).
        ModuleNotFoundError: a URI without MLflow installed (the ``mlflow`` extra).

    Example:
        >>> # load_drafter("runs/drafter/warmup", target)
        >>> # load_drafter("models:/tlt-drafter-smollm2-135m/3", target)
    """
    if is_mlflow_uri(directory):
        with tempfile.TemporaryDirectory(prefix="tlt-drafter-") as tmp:
            local = download_drafter(str(directory), tmp, tracking_uri=tracking_uri)
            return load_drafter(local, target, dtype=dtype)  # tensors are read into memory before tmp goes
    drafter = Drafter(read_drafter_config(directory), target, dtype=dtype)
    load_drafter_weights(drafter, directory)
    return drafter
