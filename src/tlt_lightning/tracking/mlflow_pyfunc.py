"""A drafter checkpoint as an MLflow model: ``mlflow.pyfunc.load_model("models:/tlt-drafter-.../3")`` works.

:func:`save_drafter_model` turns a drafter checkpoint directory into an MLflow model directory
*without moving its files*: ``model.safetensors`` and ``config.json`` stay at the top
(so :func:`~tlt_lightning.drafter.load_drafter`, ``tlt-lightning export-drafter`` and vLLM exports
read it as before), beside

* ``MLmodel`` with two flavours: ``python_function`` (loader module: this one) and ``tlt_drafter``
  (the drafter config, the *target signature* ``model_type`` / ``hidden_size`` / ``num_layers`` /
  ``vocab_size``, the target model's name when known, the RL step), a model signature, and
* ``requirements.txt`` / ``python_env.yaml`` / ``conda.yaml`` (this tlt-lightning and torch).

The drafter is not a stand-alone ``torch.nn.Module``: it reads the target's embedding and LM head,
so there is no ``pytorch`` flavour (``mlflow.pytorch.load_model`` would need a pickled target).
Loading the ``python_function`` flavour loads the target too: the one named in the model's
``model_config`` (the model the fit trained, e.g. ``smollm2-135m``, from the project's registry or
local cache, offline), or pass another with ``model_config={"target": NAME_OR_DIR_OR_TARGET}``.

``predict`` generates greedily with lossless speculative decoding, one request per row: the tokens
are exactly the target's own greedy continuation, and ``mean_accept_length`` (tokens per target
forward, ``1`` = the drafter never helped) says how good the drafter is on that input.

* input: a column ``input_ids`` of token-id lists (the prompts, ``[P_i]``): a ``pandas.DataFrame``
  or a list of records ``[{"input_ids": [...]}, ...]``;
* params: ``max_new_tokens`` (default 32), ``num_draft_tokens`` (chain depth, default 4);
* output: ``token_ids`` (the generated tokens, ``[T_i]``) and ``mean_accept_length`` per row.

``PyFuncModel.get_raw_model()`` is the :class:`~tlt_lightning.drafter.Drafter`, ready for its target.

Example:
    >>> # model = mlflow.pyfunc.load_model("models:/tlt-drafter-smollm2-135m/3")
    >>> # model.predict([{"input_ids": [1, 2, 3]}], params={"max_new_tokens": 16})
    >>> #    token_ids  mean_accept_length
    >>> # 0  [...]      2.4
    >>> # drafter = model.get_raw_model()
"""

from __future__ import annotations

import os
import shutil
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tlt_lightning.drafter.io import (
    CONFIG_NAME,
    LEGACY_CONFIG_NAME,
    WEIGHTS_NAME,
    load_drafter,
    read_drafter_config,
)
from tlt_lightning.drafter.mlflow_uri import file_sha256, import_mlflow

if TYPE_CHECKING:
    from mlflow.models import ModelSignature

    from tlt_lightning.drafter import Drafter, DrafterConfig
    from tlt_lightning.models.target import TargetModel

__all__ = [
    "FLAVOR_NAME",
    "PREDICT_PARAMS",
    "DrafterPyfunc",
    "drafter_model_signature",
    "save_drafter_model",
    "target_signature",
]

FLAVOR_NAME = "tlt_drafter"
PREDICT_PARAMS = {"max_new_tokens": 32, "num_draft_tokens": 4}
_COPIED = (
    WEIGHTS_NAME,
    CONFIG_NAME,
    LEGACY_CONFIG_NAME,
    "meta.json",
)  # not optimizer.pt: not needed to draft


def target_signature(config: DrafterConfig) -> dict[str, Any]:
    """What a target must be for this drafter: ``model_type``, ``hidden_size``, ``num_layers``,
    ``vocab_size``."""
    return {
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_target_layers,
        "vocab_size": config.vocab_size,
    }


def drafter_model_signature() -> ModelSignature:
    """The MLflow signature of :meth:`DrafterPyfunc.predict` (see the module docstring)."""
    import_mlflow()
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema
    from mlflow.types.schema import Array

    return ModelSignature(
        inputs=Schema([ColSpec(Array(DataType.long), "input_ids")]),
        outputs=Schema(
            [ColSpec(Array(DataType.long), "token_ids"), ColSpec(DataType.double, "mean_accept_length")]
        ),
        params=ParamSchema(
            [ParamSpec(name, DataType.long, default) for name, default in PREDICT_PARAMS.items()]
        ),
    )


def _tlt_version() -> str | None:
    """The installed tlt-lightning distribution's version (``None``: run from a source tree)."""
    try:
        return metadata.version("tlt-lightning")
    except metadata.PackageNotFoundError:
        return None


def _requirements() -> list[str]:
    """This tlt-lightning (when installed as a distribution) and torch, at their installed versions."""
    version = _tlt_version()
    return [*([f"tlt-lightning=={version}"] if version else []), f"torch=={torch.__version__.split('+')[0]}"]


def save_drafter_model(
    checkpoint_dir: str | os.PathLike,
    path: str | os.PathLike,
    target_model: str | None = None,
    rl_step: int | None = None,
) -> Path:
    """Write the drafter checkpoint ``checkpoint_dir`` as an MLflow model directory ``path`` (new).

    Args:
        checkpoint_dir: a :func:`~tlt_lightning.drafter.save_drafter` (or async checkpoint) directory.
        path: the model directory to create (must not exist, or be empty).
        target_model: the target the drafter was trained for (registry name or HF directory); the
            ``python_function`` flavour loads it by default. ``None``: the registry model of the
            target signature, when exactly one fits, at load time.
        rl_step: the RL step of the checkpoint, kept in the flavour and the model metadata.

    Returns:
        ``path``: the checkpoint's files, ``MLmodel`` and the environment files.

    Raises:
        ValueError: ``checkpoint_dir`` is not a drafter checkpoint.
        ModuleNotFoundError: MLflow is not installed (the ``mlflow`` extra).
    """
    config = read_drafter_config(checkpoint_dir)  # ValueError if it is not a checkpoint
    if not (Path(checkpoint_dir) / WEIGHTS_NAME).is_file():
        raise ValueError(f"{Path(checkpoint_dir) / WEIGHTS_NAME} not found: not a drafter checkpoint")
    mlflow = import_mlflow()
    from mlflow.models import Model

    target = {**target_signature(config), "model": target_model}
    model = Model(metadata={"rl_step": rl_step, "target_model": target_model, "kind": config.kind})
    model.add_flavor(
        FLAVOR_NAME,
        format_version=1,
        weights=WEIGHTS_NAME,
        weights_sha256=file_sha256(Path(checkpoint_dir) / WEIGHTS_NAME),  # checked on load
        config=CONFIG_NAME if (Path(checkpoint_dir) / CONFIG_NAME).is_file() else LEGACY_CONFIG_NAME,
        drafter_config=config.to_dict(),
        target=target,
        rl_step=rl_step,
        tlt_lightning_version=_tlt_version(),
    )
    mlflow.pyfunc.save_model(
        str(path),
        loader_module=__name__,
        mlflow_model=model,
        signature=drafter_model_signature(),
        input_example=([{"input_ids": [1, 2, 3]}], {"max_new_tokens": 8}),  # saved only, not run
        pip_requirements=_requirements(),
        # The keys `mlflow.pyfunc.load_model(..., model_config=...)` may override.
        model_config={"target": target_model, "dtype": "float32", "seed": 0},
    )
    path = Path(path)
    for name in _COPIED:
        if (Path(checkpoint_dir) / name).is_file():
            shutil.copy2(Path(checkpoint_dir) / name, path / name)
    model.model_size_bytes = sum(f.stat().st_size for f in path.iterdir() if f.is_file())  # weights included
    model.save(str(path / "MLmodel"))
    return path


def _load_target(spec: Any, signature: dict[str, Any], dtype: str, seed: int) -> TargetModel:
    """The target a loaded drafter drafts for: ``spec`` itself, the model it names, or the one registry
    model of ``signature``."""
    from tlt_lightning.models import HFTarget, load_model, models_with_signature

    if spec is not None and not isinstance(spec, (str, os.PathLike)):
        return spec  # a target object (Drafter checks that it fits)
    if spec is None:
        shape = (
            signature["model_type"],
            signature["hidden_size"],
            signature["num_layers"],
            signature["vocab_size"],
        )
        names = models_with_signature(*shape)
        if len(names) != 1:
            found = f"registry models {names} match" if names else "no registry model matches"
            raise ValueError(
                f"this drafter's target is not recorded and {found} its signature {signature}: load it with "
                "mlflow.pyfunc.load_model(uri, model_config={'target': NAME_OR_HF_DIR})"
            )
        spec = names[0]
    return HFTarget(load_model(os.fspath(spec), dtype=dtype, seed=seed).model)


def _load_pyfunc(data_path: str, model_config: dict[str, Any] | None = None) -> DrafterPyfunc:
    """MLflow's entry point for the ``python_function`` flavour (``data_path``: the model directory)."""
    from mlflow.models import Model

    flavor = Model.load(os.path.join(data_path, "MLmodel")).flavors[FLAVOR_NAME]
    recorded = flavor.get("weights_sha256")  # models saved before it was recorded have none
    if recorded is not None and file_sha256(Path(data_path) / WEIGHTS_NAME) != recorded:
        raise ValueError(
            f"{Path(data_path) / WEIGHTS_NAME}: its sha256 is not the one this MLflow model was saved with "
            f"({recorded}): the weights were changed after it was logged; refusing to load them"
        )
    config = model_config or {}
    target = _load_target(
        config.get("target"),
        flavor["target"],
        str(config.get("dtype") or "float32"),
        int(config.get("seed") or 0),
    )
    return DrafterPyfunc(load_drafter(data_path, target).eval(), target)


class DrafterPyfunc:
    """The ``python_function`` model of a drafter version: speculative greedy generation (see the module doc).

    Args:
        drafter: the drafter, loaded for ``target``.
        target: the model it drafts for.
    """

    def __init__(self, drafter: Drafter, target: TargetModel) -> None:
        self.drafter, self.target = drafter, target

    def get_raw_model(self) -> Drafter:
        """The :class:`~tlt_lightning.drafter.Drafter` (``PyFuncModel.get_raw_model()``)."""
        return self.drafter

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> Any:
        """Greedy generation with speculative decoding, one row (prompt) at a time.

        Args:
            model_input: a ``pandas.DataFrame`` with a column ``input_ids`` of token-id lists
                (MLflow converts a list of records ``[{"input_ids": [...]}, ...]`` to it).
            params: ``max_new_tokens`` (``>= 1``) and ``num_draft_tokens`` (``1..32``).

        Returns:
            A ``pandas.DataFrame``: ``token_ids`` (list of ints per row) and ``mean_accept_length``
            (tokens per speculative step of that row; ``0.0`` if no speculative step ran).
        """
        import pandas as pd

        from tlt_lightning.rollout import RolloutConfig, SpeculativeRolloutLoop
        from tlt_lightning.speculative import DraftSpec

        params = {**PREDICT_PARAMS, **(params or {})}
        depth = int(params["num_draft_tokens"])
        if not 1 <= depth <= 32:
            raise ValueError(f"num_draft_tokens must be in 1..32, got {params['num_draft_tokens']!r}")
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        if "input_ids" not in frame.columns:
            raise ValueError(
                f"model_input needs a column 'input_ids' (token-id lists), got columns {list(frame.columns)}"
            )
        loop = SpeculativeRolloutLoop(
            self.target,
            self.drafter,
            RolloutConfig(max_new_tokens=int(params["max_new_tokens"]), temperature=0.0),
            strategy=DraftSpec(depth),
        )
        tokens, accept = [], []
        with torch.inference_mode():
            for ids in frame["input_ids"]:
                result = loop.generate([[int(t) for t in ids]])
                tokens.append(result.rollouts[0].token_ids.tolist())
                accept.append(result.stats.mean_accept_length)
        return pd.DataFrame({"token_ids": tokens, "mean_accept_length": accept})
