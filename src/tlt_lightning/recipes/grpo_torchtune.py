"""GRPO + TLT as a torchtune recipe: ``tune run`` launches it, torchtune's builders supply the model.

    tune run tlt_lightning.recipes.grpo_torchtune --config configs/grpo_torchtune.yaml trainer.max_steps=2
    tlt-lightning torchtune --config configs/grpo_torchtune.yaml module.optim.lr=0.05 logger=null

The same training as ``tlt-lightning fit`` (a :class:`~tlt_lightning.rl.GRPOModule` fitted by a
Lightning ``Trainer``), configured and launched the torchtune way. :func:`recipe_main` is decorated
with ``torchtune.config.parse`` (the config file and ``key=value`` overrides, torchtune's parser);
every object is a node whose ``_component_`` is a dotted path and whose other keys are its keyword
arguments, built with ``torchtune.config.instantiate``. Top-level sections:

================ =============================================================================
``seed``         ``lightning.seed_everything`` before anything is built
``threads``      torch intra-op threads (``null``: torch's choice)
``output_dir``   where the run writes (used through ``${output_dir}`` interpolations)
``model``        a torchtune model builder (``torchtune.models.llama3_2.llama3_2``, ...): the policy
``checkpointer`` torchtune's ``FullModelHFCheckpointer``: the weights ``model`` is loaded with
``tokenizer``    a tokenizer component (``null``: the checkpoint directory's transformers tokenizer)
``prompt_source`` component handed to the module as ``prompt_source`` (``null``: the task's)
``module``       the LightningModule (with ``model``: a ``TorchtuneGRPOModule``)
``logger``       component, e.g. ``tlt_lightning.tracking.tracking_logger`` (``null``: no logger)
``callbacks``    list of components
``trainer``      ``lightning.pytorch.Trainer``
``ckpt_path``    checkpoint to resume from (``null``: a fresh run)
================ =============================================================================

``model``, ``checkpointer`` and ``tokenizer`` go to :class:`~tlt_lightning.rl.TorchtuneGRPOModule`
as its ``builder``, ``checkpointer`` and ``tokenizer`` nodes; without them the module builds its
policy from its own ``model`` name. The checkpointer's ``checkpoint_dir`` is a transformers directory
or a registry name (``tiny-llama``, ``smollm2-135m``: :func:`~tlt_lightning.models.model_dir`, written on
first use), which also names the model unless ``module.model`` does.

Overrides are torchtune's: ``a.b=value`` sets a field, ``node=dotted.path`` swaps a node's
component, ``~a.b`` deletes a field; ``node=null`` (torchtune sets its ``_component_`` to null)
disables an optional node. Every section and every node is checked before anything is built
(``torchtune.config.validate``): a misspelt key stops the run naming it and what is allowed.

Tracking as ``fit``: the resolved config is saved as ``config.yaml`` in the run's directory
(:func:`~tlt_lightning.tracking.run_dir`) and, with MLflow, as the run's artifact; the whole config
is logged as the run's params (the module's as Lightning logs them).

``tune run`` and dotted paths: torchtune 0.6.1 reads the last dotted part of a recipe that is not
one of its own as a file extension and runs the rest (``tlt_lightning.recipes``) with ``runpy`` as
``__main__``; the package's ``__main__`` runs :func:`recipe_main`. (``tune run --nproc_per_node N``
would start the same package with ``torchrun -m``; not tried here.)
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

from tlt_lightning.callbacks.signals import CheckpointOnSignal
from tlt_lightning.drafter.mlflow_uri import DEFAULT_TRACKING_URI
from tlt_lightning.models.hardware import training_precision
from tlt_lightning.resume import LIGHTNING_CKPT_NAMES, checkpoint_weights_only, read_checkpoint
from tlt_lightning.safe_load import refusing_pickled_objects
from tlt_lightning.tracking.logger import is_tracking_logger
from tlt_lightning.tracking.mlflow_resume import MLflowRunCheckpoint, resumable_run_id
from tlt_lightning.tracking.run_directory import run_dir, save_run_config
from tlt_lightning.validation import MissingExtraError, check

try:  # torchtune.config.parse's own parser and merge, validate's errors
    from omegaconf import DictConfig, OmegaConf
    from torchtune import config
    from torchtune.config._errors import ConfigError, InstantiationError
    from torchtune.config._parse import TuneRecipeArgumentParser
    from torchtune.config._utils import _get_component_from_path, _merge_yaml_and_cli_args
except ImportError as err:  # the optional extra is not installed
    raise MissingExtraError(
        "the torchtune recipe needs torchtune: pip install 'tlt-lightning[torchtune]' "
        f"(torchtune==0.6.1, torchao==0.15.0); the import failed with: {err}"
    ) from err

__all__ = [
    "SECTIONS",
    "RecipeConfigLogger",
    "build_module",
    "check_config",
    "load_config",
    "recipe_main",
    "run",
    "run_command",
]

SECTIONS = (
    "seed",
    "threads",
    "output_dir",
    "model",
    "checkpointer",
    "tokenizer",
    "prompt_source",
    "module",
    "logger",
    "callbacks",
    "trainer",
    "ckpt_path",
)
_OPTIONAL_NODES = ("model", "checkpointer", "tokenizer", "prompt_source", "logger")


def _enabled(node: Any) -> bool:
    """A node that is set: not ``null``, and not a ``node=null`` override (a null ``_component_``)."""
    return node is not None and not (
        isinstance(node, dict) and "_component_" in node and node["_component_"] is None
    )


def _allowed(path: str) -> list[str]:
    try:
        params = inspect.signature(_get_component_from_path(path)).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _validate(node: Any, where: str) -> None:
    """``torchtune.config.validate`` on one node, its errors as a ``ValueError`` naming the node."""
    if not (isinstance(node, dict) and isinstance(node.get("_component_"), str)):
        raise ValueError(f"{where} must be a node with a _component_ (a dotted path), got {node!r}")
    try:
        config.validate(OmegaConf.create({where: node}))
    except InstantiationError as err:
        raise ValueError(f"{where}: _component_ {node['_component_']!r} cannot be imported: {err}") from err
    except ConfigError as err:
        found = "; ".join(str(e) for e in err.errors)
        raise ValueError(f"{where}: {found}; allowed: {_allowed(node['_component_'])}") from err


def check_config(cfg: DictConfig) -> dict[str, Any]:
    """Check the sections and every node of ``cfg``; returns it resolved, as plain dicts and lists.

    Raises:
        ValueError: an unknown section, a node without a ``_component_``, a component that cannot
            be imported or does not take a key (the message names it and what is allowed).
    """
    plain = OmegaConf.to_container(cfg, resolve=True)
    if not isinstance(plain, dict):
        raise ValueError(f"a recipe config is a mapping of sections, got {type(plain).__name__}")
    unknown = sorted(set(plain) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown config sections {unknown}; allowed: {list(SECTIONS)}")
    for name in ("module", "trainer"):
        if not _enabled(plain.get(name)):
            raise ValueError(f"{name} must be a node with a _component_, got {plain.get(name)!r}")
    for name in (*_OPTIONAL_NODES, "module", "trainer"):
        if _enabled(plain.get(name)):
            _validate(plain[name], name)
    callbacks = plain.get("callbacks") or []
    if not isinstance(callbacks, list):
        raise ValueError(f"callbacks must be a list of _component_ nodes, got {callbacks!r}")
    for i, node in enumerate(callbacks):
        _validate(node, f"callbacks[{i}]")
    if _enabled(plain.get("model")) != _enabled(plain.get("checkpointer")):
        raise ValueError(
            "model and checkpointer go together: the model builder makes the policy, the "
            "checkpointer loads its weights (FullModelHFCheckpointer with a checkpoint_dir)"
        )
    if _enabled(plain.get("tokenizer")) and not _enabled(plain.get("model")):
        raise ValueError(
            "tokenizer needs a model and checkpointer section (else the module's model brings its own)"
        )
    if _enabled(plain.get("model")) and "builder" not in _allowed(plain["module"]["_component_"]):
        raise ValueError(
            f"with a model section the module must take torchtune builders "
            f"(tlt_lightning.rl.TorchtuneGRPOModule), got {plain['module']['_component_']}"
        )
    return plain


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> DictConfig:
    """Read a recipe YAML and apply ``overrides`` as ``tune run`` does (``torchtune.config.parse``); check it.

    Raises:
        ValueError: a malformed override, an unknown section or key, a component that cannot be
            imported or does not take a key (the message names it).

    Example:
        >>> overrides = ["module.optim.lr=0.05", "logger=null"]
        >>> cfg = load_config("configs/grpo_torchtune.yaml", overrides)  # doctest: +SKIP
    """
    if not Path(path).is_file():
        raise ValueError(f"config file {path} not found")
    parser = TuneRecipeArgumentParser(prog="tune run tlt_lightning.recipes.grpo_torchtune")
    yaml_args, cli_args = parser.parse_known_args(["--config", str(path), *overrides])
    cfg = _merge_yaml_and_cli_args(yaml_args, cli_args)
    check_config(cfg)
    return cfg


def _params(plain: dict[str, Any]) -> dict[str, Any]:
    """The config as run params: lists as ``{index: item}`` (flattened as ``callbacks/0/_component_``).

    Of the module only its component: Lightning logs its hyper-parameters (defaults included), and
    with them the ``model``, ``checkpointer`` and ``tokenizer`` nodes it was given (``builder/...``,
    ``checkpointer/...``, ``tokenizer/...``).
    """

    def nested(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: nested(v) for k, v in value.items()}
        if isinstance(value, list):
            return {str(i): nested(v) for i, v in enumerate(value)}
        return value

    given = ("model", "checkpointer", "tokenizer") if _enabled(plain.get("model")) else ()
    params = {k: nested(v) for k, v in plain.items() if k not in given}
    params["module"] = {"_component_": plain["module"]["_component_"]}
    return params


class RecipeConfigLogger(Callback):
    """Tracks a recipe's config as ``fit`` does: ``config.yaml`` in the run's directory and as the MLflow
    run's artifact (:func:`~tlt_lightning.tracking.save_run_config`), the whole config as the run's params.

    Args:
        cfg: the resolved config as plain dicts and lists.
    """

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        run_dir(trainer)  # on every rank: it broadcasts rank 0's directory
        if not trainer.is_global_zero:
            return
        save_run_config(trainer, OmegaConf.to_yaml(OmegaConf.create(self.cfg), sort_keys=False))
        if trainer.logger is not None:
            trainer.logger.log_hyperparams(_params(self.cfg))


def build_module(cfg: DictConfig) -> LightningModule:
    """The ``module`` node, given the ``prompt_source`` and torchtune's ``model`` / ``checkpointer`` /
    ``tokenizer`` nodes (as ``builder`` / ``checkpointer`` / ``tokenizer``); nothing is loaded yet.

    Example:
        >>> module = build_module(load_config("configs/grpo_torchtune.yaml"))  # doctest: +SKIP
        >>> module.configure_model()  # doctest: +SKIP
    """
    plain = check_config(cfg)
    kwargs: dict[str, Any] = {}
    if _enabled(plain.get("prompt_source")):
        kwargs["prompt_source"] = config.instantiate(cfg.prompt_source)
    if _enabled(plain.get("model")):  # torchtune's builders supply the policy
        kwargs |= {
            "builder": plain["model"],
            "checkpointer": plain["checkpointer"],
            "tokenizer": plain["tokenizer"] if _enabled(plain.get("tokenizer")) else None,
        }
        if "model" not in plain["module"]:  # names the model (drafter registry names, messages)
            kwargs["model"] = str(plain["checkpointer"]["checkpoint_dir"])
    return config.instantiate(cfg.module, **kwargs)


def run(cfg: DictConfig) -> tuple[Trainer, LightningModule]:
    """Build everything ``cfg`` names and fit; returns ``(trainer, module)``."""
    from tlt_lightning.fit import SaveLastAtTrainEnd

    plain = check_config(cfg)
    if plain.get("threads") is not None:
        threads = plain["threads"]
        check(isinstance(threads, int) and threads >= 1, "threads", threads, "an int >= 1 or null")
        torch.set_num_threads(plain["threads"])
    ckpt_path = plain.get("ckpt_path")
    if ckpt_path and str(ckpt_path) not in LIGHTNING_CKPT_NAMES:
        read_checkpoint(ckpt_path)  # a clear error for a missing, corrupt or pickled-object file, early
    L.seed_everything(plain.get("seed", 0))
    module = build_module(cfg)
    logger_node = plain.get("logger") if _enabled(plain.get("logger")) else None
    if logger_node and plain.get("ckpt_path") and logger_node.get("run_id") is None:
        if is_tracking_logger(logger_node["_component_"]):
            # As `fit --ckpt_path`: continue the MLflow run the checkpoint was saved from.
            uri = logger_node.get("tracking_uri", DEFAULT_TRACKING_URI)
            logger_node = {**logger_node, "run_id": resumable_run_id(plain["ckpt_path"], uri)}
    logger = config.instantiate(OmegaConf.create(logger_node)) if logger_node else False
    # As fit: every checkpoint names its MLflow run, a last.ckpt of the final step, the config tracked.
    callbacks = [config.instantiate(node) for node in cfg.get("callbacks") or []]
    stop = CheckpointOnSignal()  # SIGTERM / SIGINT: last.ckpt of the step, as in fit
    callbacks += [MLflowRunCheckpoint(), SaveLastAtTrainEnd(), RecipeConfigLogger(plain), stop]
    # As `fit` does: unless the config says otherwise, train in the precision that pays here.
    precision = {} if "precision" in plain["trainer"] else {"precision": training_precision()}
    trainer = config.instantiate(cfg.trainer, logger=logger, callbacks=callbacks, **precision)
    # No pickled objects are read from the checkpoint unless TLT_LIGHTNING_TRUST_CHECKPOINTS=1.
    try:
        with refusing_pickled_objects(f"the checkpoint ckpt_path={ckpt_path!r} names"):
            trainer.fit(module, ckpt_path=ckpt_path, weights_only=checkpoint_weights_only(None))
    except SIGTERMException as stopped:  # as fit: the MLflow run marked KILLED, one line, 128 + signal
        raise SystemExit(stop.report(trainer, "tlt-lightning torchtune")) from stopped
    return trainer, module


def run_command(args: Any) -> None:
    """``tlt-lightning torchtune --config CFG [key=value ...]``: ``args.config`` and ``args.overrides``.

    A misspelt key or a bad override ends the command with one line (``SystemExit``) before anything loads.
    """
    try:
        cfg = load_config(args.config, args.overrides)
    except ValueError as err:
        raise SystemExit(f"torchtune: {err}") from err
    run(cfg)


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """GRPO + TLT from a torchtune recipe config
    (``tune run tlt_lightning.recipes.grpo_torchtune --config CFG``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may wait on a hub download
    check_config(cfg)
    config.log_config(recipe_name="tlt_lightning.recipes.grpo_torchtune", cfg=cfg)
    run(cfg)


if __name__ == "__main__":
    recipe_main()
