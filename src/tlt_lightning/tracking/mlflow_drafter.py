"""The drafter in MLflow's model registry: one model version per drafter checkpoint, loaded back in one call.

A drafter checkpoint (:func:`~tlt_lightning.drafter.save_drafter` or an
:class:`~tlt_lightning.spot.AsyncCheckpointer` ``step-*`` directory) becomes

* an MLflow model logged to the training run under ``drafter/model/step-XXXXXXXX/``: the
  checkpoint's own files (``model.safetensors``, ``config.json`` and ``meta.json`` when
  present; the optimizer state is not logged: a registered drafter is for drafting, a Lightning
  checkpoint is for resuming) beside an ``MLmodel`` with a ``python_function`` flavour, a signature,
  the drafter config and the target signature (:mod:`tlt_lightning.tracking.mlflow_pyfunc`), and
* a version of the registered model ``name`` whose source is ``runs:/<run_id>/drafter/model/step-...``,
  tagged ``rl_step``, ``kind``, ``draft_vocab``, ``run_id`` and ``sha256`` (of the weights file).

A version loads back as a :class:`~tlt_lightning.drafter.Drafter` with :func:`load_drafter_from_mlflow`
(or :func:`~tlt_lightning.drafter.load_drafter` with its ``models:/`` URI), as a ``python_function``
model with ``mlflow.pyfunc.load_model``, and exports for vLLM with ``tlt-lightning export-drafter
models:/<name>/<version> OUT``.

MLflow is imported inside the functions: ``tlt_lightning.tracking`` imports without it.

Example:
    >>> # checkpoint = f"runs/fit/1/{run_id}/drafter/checkpoints/step-00000010"   # tracking.run_dir
    >>> # version = log_drafter_version(client, run_id, checkpoint, drafter_model_name("smollm2-135m"),
    >>> #                               rl_step=10, target_model="smollm2-135m")
    >>> # drafter = load_drafter_from_mlflow("tlt-drafter-smollm2-135m", target)        # newest
    >>> # drafter = load_drafter_from_mlflow("models:/tlt-drafter-smollm2-135m/1", target)
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tlt_lightning.drafter.io import WEIGHTS_NAME, load_drafter, read_drafter_config
from tlt_lightning.drafter.mlflow_uri import (
    DEFAULT_TRACKING_URI,
    download_drafter,
    file_sha256,
    import_mlflow,
    quote_filter_value,
)
from tlt_lightning.tracking.mlflow_pyfunc import save_drafter_model
from tlt_lightning.validation import check, is_int

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

    from tlt_lightning.drafter import Drafter
    from tlt_lightning.models.target import TargetModel

__all__ = [
    "DEFAULT_TRACKING_URI",
    "DRAFTER_ARTIFACT_PATH",
    "drafter_model_name",
    "load_drafter_from_mlflow",
    "log_drafter_version",
]

DRAFTER_ARTIFACT_PATH = "drafter/model"
_DESCRIPTION = (
    "EAGLE-style speculative-decoding drafter trained by tlt_lightning's SpotDrafterCallback on the "
    "policy's own rollouts during GRPO training; one version per drafter checkpoint (tag rl_step), each "
    "an MLflow model (python_function flavour) whose directory is a drafter checkpoint. Load one with: "
    "tlt_lightning.tracking.load_drafter_from_mlflow('{name}', target[, version]), "
    "mlflow.pyfunc.load_model('models:/{name}/<version>'), or export it for vLLM with "
    "tlt-lightning export-drafter models:/{name}/<version> OUT."
)


def drafter_model_name(model: str | os.PathLike) -> str:
    """A clear registered-model name for the drafter of ``model``: ``tlt-drafter-<model>``.

    A local path gives its last component; the result is lower case, with runs of characters
    other than letters, digits, ``.``, ``_`` and ``-`` replaced by ``-``.

    Example:
        >>> drafter_model_name("smollm2-135m")
        'tlt-drafter-smollm2-135m'
        >>> drafter_model_name("/models/HuggingFaceTB/SmolLM2-135M-Instruct/")
        'tlt-drafter-smollm2-135m-instruct'
    """
    text = os.fspath(model).strip().rstrip("/\\")
    last = re.split(r"[/\\]", text)[-1]
    slug = re.sub(r"[^a-z0-9._-]+", "-", last.lower()).strip("-.")
    if not slug:
        raise ValueError(f"model must name a model (a registry name or a directory), got {model!r}")
    return f"tlt-drafter-{slug}"


def _kind_and_vocab(directory: Path) -> tuple[str, int]:
    """The drafter kind and draft vocabulary size of a checkpoint directory (``ValueError`` if it is none)."""
    if not (directory / WEIGHTS_NAME).is_file():
        raise ValueError(f"{directory} is not a drafter checkpoint: {WEIGHTS_NAME} not found")
    config = read_drafter_config(directory)  # ValueError naming the file if it is not a drafter's
    return config.kind, config.draft_vocab


def _ensure_registered_model(client: MlflowClient, name: str) -> None:
    """Create the registered model ``name`` (with its description) unless it exists."""
    mlflow = import_mlflow()
    try:
        client.get_registered_model(name)
    except mlflow.exceptions.MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        try:
            client.create_registered_model(
                name, tags={"library": "tlt_lightning"}, description=_DESCRIPTION.format(name=name)
            )
        except mlflow.exceptions.MlflowException as exists:
            # Another fit on the same store created it since we looked (both registering their
            # first drafter at once): use it. Anything else (e.g. a prompt of that name) is raised.
            if exists.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            client.get_registered_model(name)


def log_drafter_version(
    client: MlflowClient,
    run_id: str,
    checkpoint_dir: str | os.PathLike,
    name: str,
    rl_step: int,
    target_model: str | None = None,
) -> ModelVersion:
    """Log a drafter checkpoint to run ``run_id`` as an MLflow model and register it as a new version of
    ``name``.

    The model (the checkpoint's files, ``MLmodel``, environment files: see
    :func:`~tlt_lightning.tracking.mlflow_pyfunc.save_drafter_model`) goes under
    ``drafter/model/step-XXXXXXXX`` of the run; the registered model is created
    (with a description saying how to load it) if it does not exist (several fits on one store may
    register at once: one creates it, the others use it); the version's source is
    ``runs:/<run_id>/drafter/model/step-XXXXXXXX``. The same checkpoint again (same ``rl_step``,
    same weights: tag ``sha256`` of ``model.safetensors``) returns its existing version: no duplicate.

    Args:
        client: an ``mlflow.MlflowClient`` (e.g. ``MLFlowLogger.experiment``); its registry must
            be a database or server store (``sqlite:///...``, ``http://...``).
        run_id: the run that trained the drafter.
        checkpoint_dir: a drafter checkpoint directory (``model.safetensors`` + ``config.json``).
        name: registered-model name (see :func:`drafter_model_name`).
        rl_step: the RL (policy) step of the checkpoint (``>= 0``).
        target_model: the target it was trained for (registry name or HF directory), recorded so
            that ``mlflow.pyfunc.load_model`` loads it; ``None``: the registry model of the target's
            signature, when exactly one fits.

    Returns:
        The ``ModelVersion``, tagged ``rl_step``, ``kind``, ``draft_vocab``, ``run_id``, ``sha256``.

    Raises:
        ValueError: ``checkpoint_dir`` is not a drafter checkpoint, or a bad ``rl_step`` / ``name``.
        ModuleNotFoundError: MLflow is not installed (the ``mlflow`` extra).
    """
    check(is_int(rl_step) and rl_step >= 0, "rl_step", rl_step, "an int >= 0")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty registered-model name, got {name!r}")
    directory = Path(checkpoint_dir)
    kind, vocab = _kind_and_vocab(directory)
    import_mlflow()  # ModuleNotFoundError naming the extra, before anything is searched or logged
    artifact_path = f"{DRAFTER_ARTIFACT_PATH}/step-{rl_step:08d}"
    digest = file_sha256(directory / WEIGHTS_NAME)
    # The same checkpoint registered before (a resumed fit saving its restored step again, a retry):
    # that version, not a duplicate.
    same = client.search_model_versions(
        f"name={quote_filter_value(name)} and tags.rl_step = '{rl_step}' and tags.sha256 = '{digest}'"
    )
    if same:
        return min(same, key=lambda v: int(v.version))
    with tempfile.TemporaryDirectory(prefix="tlt-drafter-model-") as tmp:
        model = save_drafter_model(directory, Path(tmp) / "model", target_model=target_model, rl_step=rl_step)
        client.log_artifacts(run_id, str(model), artifact_path)
    _ensure_registered_model(client, name)
    return client.create_model_version(
        name,
        source=f"runs:/{run_id}/{artifact_path}",
        run_id=run_id,
        tags={
            "rl_step": str(rl_step),
            "kind": str(kind),
            "draft_vocab": str(vocab),
            "run_id": run_id,
            "sha256": digest,
        },
        description=f"drafter at RL step {rl_step} of run {run_id}",
    )


def load_drafter_from_mlflow(
    uri_or_name: str,
    target: TargetModel,
    version: int | str | None = None,
    tracking_uri: str | None = None,
    dtype: torch.dtype | None = None,
) -> Drafter:
    """Load a registered drafter version for ``target`` in one call.

    Args:
        uri_or_name: ``"models:/<name>/<version>"``, ``"models:/<name>@<alias>"``,
            ``"runs:/<run id>/<path>"`` or a registered name (see :func:`drafter_model_name`).
        target: the target model it drafts for (see :func:`~tlt_lightning.drafter.load_drafter`).
        version: with a bare name: a version number, ``"latest"`` or an alias; ``None``: the newest version.
        tracking_uri: the MLflow store; ``None``: ``$MLFLOW_TRACKING_URI``, else the store of
            ``tlt-lightning fit`` (``sqlite:///runs/mlflow.db``).
        dtype: parameter dtype (default: the target's).

    Returns:
        The :class:`~tlt_lightning.drafter.Drafter` with that version's weights.

    Raises:
        ModuleNotFoundError: MLflow is not installed (the ``mlflow`` extra).
        ValueError: a malformed URI, no such store, registered model, version, alias, run or
            artifact (the message names those that exist), or files that do not fit ``target``.

    Example:
        >>> # drafter = load_drafter_from_mlflow("tlt-drafter-smollm2-135m", target)
        >>> # drafter = load_drafter_from_mlflow("models:/tlt-drafter-smollm2-135m/3", target,
        >>> #                                    tracking_uri="sqlite:///runs/mlflow.db")
    """
    with tempfile.TemporaryDirectory(prefix="tlt-drafter-") as tmp:
        local = download_drafter(uri_or_name, tmp, version=version, tracking_uri=tracking_uri)
        return load_drafter(local, target, dtype=dtype)  # reads the tensors into memory before tmp goes
