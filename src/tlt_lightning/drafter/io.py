"""Drafter checkpoints: ``model.safetensors`` (the drafter's own tensors) + ``drafter_config.json``.

The embedding and LM head are the target's and are not saved; ``d2t``/``t2d`` are, when the draft
vocabulary is reduced. Loading is strict: a corrupt file, a missing or unexpected tensor, a shape
mismatch, a non-finite weight (corrupted data bytes) or a config that does not fit the target raises
``ValueError``; nothing loads silently.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tlt_lightning.drafter.config import DrafterConfig
from tlt_lightning.drafter.mlflow_uri import download_drafter, is_mlflow_uri
from tlt_lightning.drafter.model import Drafter
from tlt_lightning.models.target import TargetModel

__all__ = [
    "CONFIG_NAME",
    "FORMAT_VERSION",
    "WEIGHTS_NAME",
    "check_draft_vocab",
    "check_finite_tensors",
    "load_drafter",
    "read_drafter_config",
    "save_drafter",
]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "drafter_config.json"
FORMAT_VERSION = 1


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
        not directory.is_dir() or (any(directory.iterdir()) and not (directory / CONFIG_NAME).is_file())
    ):
        raise ValueError(f"{directory} exists and is not a drafter checkpoint; refusing to overwrite it")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}
    meta = {"format_version": FORMAT_VERSION, "config": drafter.config.to_dict()}

    def write(tmp: Path) -> None:
        save_file(
            tensors, tmp / WEIGHTS_NAME, metadata={"format": "pt", "format_version": str(FORMAT_VERSION)}
        )
        (tmp / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")

    return replace_directory(directory, write)


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


def read_drafter_config(directory: str | os.PathLike) -> DrafterConfig:
    """The :class:`DrafterConfig` of a checkpoint (``ValueError`` if missing, corrupt or of another
    version)."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{path} not found: {Path(directory)} is not a drafter checkpoint")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise ValueError(f"{path}: format_version must be {FORMAT_VERSION}, got {version!r}")
    return DrafterConfig.from_dict(meta.get("config"))


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
    config = read_drafter_config(directory)
    drafter = Drafter(config, target, dtype=dtype)
    path = Path(directory) / WEIGHTS_NAME
    if not path.is_file():
        raise ValueError(f"{path} not found")
    try:
        tensors = load_file(path, device=str(drafter.device))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is corrupt or not a safetensors file: {err}") from err
    expected = drafter.state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{path} does not fit the drafter: missing keys {missing}, unexpected keys {unexpected}"
        )
    for key, value in expected.items():
        if tensors[key].shape != value.shape:
            raise ValueError(
                f"{path}: {key} has shape {list(tensors[key].shape)}, expected {list(value.shape)}"
            )
    check_finite_tensors(tensors, path)
    if config.reduced_vocab:
        check_draft_vocab(tensors["d2t"], tensors["t2d"], config, path)
    drafter.load_state_dict(tensors, strict=True)
    return drafter


def check_finite_tensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Refuse (``ValueError``) floating tensors with NaN or infinite values, naming the file and tensor.

    A drafter file whose data bytes were corrupted still parses (safetensors checks the header and
    sizes, not the values), and a drafter with NaN weights drafts nothing that verification accepts:
    speculation would silently cost time and gain nothing.
    """
    for key, value in tensors.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise ValueError(
                f"{path}: tensor {key!r} has {bad} non-finite value(s) of {value.numel()} (NaN or inf): the "
                "file is corrupt or was saved from a diverged drafter; use another checkpoint or train "
                "a fresh drafter"
            )


def check_draft_vocab(
    d2t: torch.Tensor, t2d: torch.Tensor, config: DrafterConfig, path: str | os.PathLike
) -> None:
    """Refuse (``ValueError``) a reduced draft vocabulary whose two maps disagree.

    ``d2t`` must map the draft ids, in ascending order, onto exactly the ids ``t2d`` marks.

    Args:
        d2t: ``[draft_vocab]`` int64 offsets, draft id ``i`` -> target id ``i + d2t[i]``.
        t2d: ``[vocab_size]`` bool, the target ids in the draft vocabulary.
        config: the drafter's config (``draft_vocab``, ``vocab_size``).
        path: the file or directory the maps came from, named in the message.
    """
    if d2t.dtype != torch.long or t2d.dtype != torch.bool:
        raise ValueError(f"{path}: d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    ids = torch.arange(config.draft_vocab, device=d2t.device) + d2t
    ok = bool((ids >= 0).all()) and bool((ids < config.vocab_size).all())
    ok = (
        ok
        and bool((ids[1:] > ids[:-1]).all())
        and int(t2d.sum()) == config.draft_vocab
        and bool(t2d[ids].all())
    )
    if not ok:
        raise ValueError(
            f"{path}: d2t and t2d do not describe the same draft vocabulary of {config.draft_vocab} ids"
        )
