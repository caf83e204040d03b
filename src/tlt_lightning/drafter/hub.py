"""The drafter's checkpoint format, the Hugging Face layout of huggingface_hub's ``PyTorchModelHubMixin``.

A checkpoint directory (or Hub repository) holds::

    config.json          {"model_type": "tlt_lightning_drafter", "format_version": 1, "config": {...}}
    model.safetensors    the drafter's own tensors (``d2t``/``t2d`` when the draft vocabulary is reduced)
    README.md            the model card the mixin writes (library, tags)

``Drafter.save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` come from the mixin
(:class:`DrafterHubMixin`); :func:`~tlt_lightning.drafter.save_drafter` and
:func:`~tlt_lightning.drafter.load_drafter` are the same format written atomically / with MLflow URIs.
The embedding and LM head are the target's and are not saved, so loading takes the target:
``Drafter.from_pretrained(DIR_OR_REPO, target=target)``. ``model_type`` names no transformers
architecture, so ``AutoModel.from_pretrained`` refuses the directory instead of building a random model.

Checkpoints written before this layout name their config ``drafter_config.json`` (same content without
``model_type``); they load everywhere a checkpoint is read, and are never written any more. Loading is
strict: a corrupt file, a missing or unexpected tensor, a shape mismatch, a non-finite weight or a
config that does not fit the target raises ``ValueError``; nothing loads silently.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import PyTorchModelHubMixin, hf_hub_download
from huggingface_hub.constants import CONFIG_NAME, SAFETENSORS_SINGLE_FILE
from safetensors import SafetensorError
from safetensors.torch import load_file

from tlt_lightning.drafter.config import DrafterConfig
from tlt_lightning.validation import read_json_object

__all__ = [
    "CONFIG_NAME",
    "FORMAT_VERSION",
    "LEGACY_CONFIG_NAME",
    "MODEL_TYPE",
    "WEIGHTS_NAME",
    "DrafterHubMixin",
    "check_draft_vocab",
    "check_finite_tensors",
    "checkpoint_config",
    "config_path",
    "is_drafter_checkpoint",
    "load_drafter_weights",
    "read_drafter_config",
]

WEIGHTS_NAME = SAFETENSORS_SINGLE_FILE  # "model.safetensors"
LEGACY_CONFIG_NAME = "drafter_config.json"  # the config's name before the Hugging Face layout
FORMAT_VERSION = 1
MODEL_TYPE = "tlt_lightning_drafter"  # no transformers architecture: AutoConfig refuses it by name


def checkpoint_config(config: DrafterConfig) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint of a drafter shaped by ``config``."""
    return {"model_type": MODEL_TYPE, "format_version": FORMAT_VERSION, "config": config.to_dict()}


def config_path(directory: Path) -> Path | None:
    """The checkpoint's config: ``config.json``, else the legacy ``drafter_config.json``, else ``None``."""
    for path in (directory / CONFIG_NAME, directory / LEGACY_CONFIG_NAME):
        if path.is_file():
            return path
    return None


def is_drafter_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a drafter checkpoint's config (either layout): one that may be replaced."""
    try:
        read_drafter_config(directory)
    except ValueError:
        return False
    return True


def read_drafter_config(directory: str | os.PathLike) -> DrafterConfig:
    """The :class:`DrafterConfig` of a checkpoint (``config.json``, or a legacy ``drafter_config.json``).

    Raises:
        ValueError: no config, invalid JSON, another ``model_type`` or ``format_version``, bad fields.
    """
    directory = Path(directory)
    path = config_path(directory)
    if path is None:
        raise ValueError(f"{directory / CONFIG_NAME} not found: {directory} is not a drafter checkpoint")
    meta = read_json_object(path)
    if path.name == CONFIG_NAME and meta.get("model_type") != MODEL_TYPE:
        raise ValueError(
            f"{path}: model_type must be {MODEL_TYPE!r}, got {meta.get('model_type')!r}: {directory} is not "
            "a drafter checkpoint (an exported drafter loads with import_drafter)"
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version must be {FORMAT_VERSION}, got {meta.get('format_version')!r}"
        )
    return DrafterConfig.from_dict(meta.get("config"))


def load_drafter_weights(drafter: torch.nn.Module, directory: str | os.PathLike) -> None:
    """Load a checkpoint's ``model.safetensors`` into ``drafter``, strictly (see the module docstring).

    Raises:
        ValueError: missing or corrupt file, missing or unexpected tensors, shape mismatches, non-finite
            weights, an inconsistent draft vocabulary.
    """
    path = Path(directory) / WEIGHTS_NAME
    if not path.is_file():
        raise ValueError(f"{path} not found")
    expected = drafter.state_dict()
    device = next(iter(expected.values())).device
    try:
        tensors = load_file(path, device=str(device))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is corrupt or not a safetensors file: {err}") from err
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
    config = drafter.config
    if config.reduced_vocab:
        check_draft_vocab(tensors["d2t"], tensors["t2d"], config, path)
    drafter.load_state_dict(tensors, strict=True)


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


class DrafterHubMixin(
    PyTorchModelHubMixin,
    library_name="tlt-lightning",
    tags=["speculative-decoding", "eagle", "tlt-lightning"],
):
    """``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` of :class:`~tlt_lightning.drafter.Drafter`.

    huggingface_hub's mixin does the directory and Hub work and the model card; this class only says
    what a drafter's files are: the mixin's ``model.safetensors`` plus our ``config.json``
    (:func:`checkpoint_config`), read back strictly, with the target passed at load time.

    Example:
        >>> # drafter.save_pretrained("runs/drafter"); drafter.push_to_hub("me/smollm2-drafter")
        >>> # Drafter.from_pretrained("runs/drafter", target=target, dtype=torch.bfloat16)
    """

    config: DrafterConfig

    def _save_pretrained(self, save_directory: Path) -> None:
        super()._save_pretrained(save_directory)  # model.safetensors (safetensors' save_model)
        (save_directory / CONFIG_NAME).write_text(json.dumps(checkpoint_config(self.config), indent=2) + "\n")

    @classmethod
    def _from_pretrained(
        cls,
        *,
        model_id: str,
        revision: str | None,
        cache_dir: str | Path | None,
        force_download: bool,
        local_files_only: bool,
        token: str | bool | None,
        target: Any = None,
        dtype: torch.dtype | None = None,
        **ignored: Any,  # the mixin's own copy of config.json's entries: read again, strictly, below
    ) -> DrafterHubMixin:
        if target is None:
            raise TypeError(
                "Drafter.from_pretrained needs target=: the drafter reads the target's embedding and LM head"
            )
        directory = Path(model_id)
        if not directory.is_dir():  # a Hub repository: its files, in the local cache
            kwargs = dict(revision=revision, cache_dir=cache_dir, force_download=force_download, token=token)
            for name in (CONFIG_NAME, WEIGHTS_NAME):
                local = hf_hub_download(model_id, name, local_files_only=local_files_only, **kwargs)
            directory = Path(local).parent
        drafter = cls(read_drafter_config(directory), target, dtype=dtype)
        load_drafter_weights(drafter, directory)
        return drafter
