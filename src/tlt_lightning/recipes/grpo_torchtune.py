"""GRPO + TLT from a torchtune-style recipe config: ``_component_`` nodes and ``key=value`` overrides.

    tlt-lightning torchtune --config configs/grpo_torchtune.yaml trainer.max_steps=2 module.lr=0.05
    python -m tlt_lightning.recipes.grpo_torchtune --config configs/grpo_torchtune.yaml logger=null

The same training as ``tlt-lightning fit`` (a :class:`~tlt_lightning.rl.GRPOModule` fitted by a
Lightning ``Trainer``), configured the torchtune way: every object is a node whose ``_component_``
is a dotted path and whose other keys are its keyword arguments, built with
``torchtune.config.instantiate`` (needs the ``torchtune`` extra). Top-level sections:

============== ===============================================================================
``seed``       ``lightning.seed_everything`` before anything is built
``threads``    torch intra-op threads (``null``: torch's choice)
``output_dir`` where the run writes (used through ``${output_dir}`` interpolations)
``prompt_source`` component handed to the module as ``prompt_source`` (``null``: the task's)
``module``     the LightningModule (``GRPOModule`` or a subclass)
``logger``     component, e.g. ``tlt_lightning.fit.tracking_logger`` (``null``: no logger)
``callbacks``  list of components
``trainer``    ``lightning.pytorch.Trainer``
``ckpt_path``  checkpoint to resume from (``null``: a fresh run)
============== ===============================================================================

Overrides follow torchtune's command line: ``a.b=value`` sets a field (the value is parsed as
YAML), ``node=dotted.path`` swaps a node's component, ``~a.b`` deletes a field. Two additions:
``node=null`` disables an optional node, and every override and every node is checked before
anything is built: a key must exist or be a keyword argument of its component, so a misspelt key
stops the run naming it and what is allowed.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tlt_lightning.models.hardware import training_precision
from tlt_lightning.tracking.mlflow_resume import MLflowRunCheckpoint, resumable_run_id

__all__ = ["SECTIONS", "check_config", "load_config", "main", "run"]

SECTIONS = ("seed", "threads", "output_dir", "prompt_source", "module", "logger", "callbacks", "trainer", "ckpt_path")
_OPTIONAL_NODES = ("prompt_source", "logger")


def _torchtune_config() -> Any:
    try:
        from torchtune import config
    except ImportError as err:
        raise ImportError(
            "the torchtune recipe needs torchtune: pip install 'tlt-lightning[torchtune]' "
            f"(torchtune==0.6.1, torchao==0.15.0); the import failed with: {err}"
        ) from err
    return config


def _omegaconf() -> Any:
    _torchtune_config()  # omegaconf comes with torchtune: one message names the extra
    import omegaconf

    return omegaconf


def _is_component(node: Any) -> bool:
    return isinstance(node, dict) and "_component_" in node


def _resolve(path: str, where: str) -> Any:
    """The object a ``_component_`` dotted path names (the longest importable module, then attributes)."""
    parts = path.split(".") if isinstance(path, str) else []
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise ValueError(f"{where}: _component_ {path!r} cannot be imported (a dotted path to a class or function)")


def _check_component(node: dict[str, Any], where: str) -> None:
    """Every key of a ``_component_`` node must be a keyword argument of the component."""
    target = _resolve(node["_component_"], where)
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    allowed = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in node:
        if key != "_component_" and key not in allowed:
            raise ValueError(f"{where}.{key}: {node['_component_']} has no parameter {key!r}; allowed: {allowed}")


def check_config(config: dict[str, Any]) -> None:
    """Check sections and components of a plain-dict config; ``ValueError`` names the first bad key."""
    unknown = sorted(set(config) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown config sections {unknown}; allowed: {list(SECTIONS)}")
    for name in ("module", "trainer"):
        if not _is_component(config.get(name)):
            raise ValueError(f"{name} must be a node with a _component_, got {config.get(name)!r}")
    for name in ("prompt_source", "logger", "module", "trainer"):
        if config.get(name) is not None:
            if not _is_component(config[name]):
                raise ValueError(f"{name} must be a node with a _component_ or null, got {config[name]!r}")
            _check_component(config[name], name)
    callbacks = config.get("callbacks") or []
    if not isinstance(callbacks, list):
        raise ValueError(f"callbacks must be a list of _component_ nodes, got {callbacks!r}")
    for i, node in enumerate(callbacks):
        if not _is_component(node):
            raise ValueError(f"callbacks[{i}] must be a node with a _component_, got {node!r}")
        _check_component(node, f"callbacks[{i}]")


def _apply_override(config: dict[str, Any], override: str) -> None:
    """Apply one torchtune-syntax override to the plain-dict ``config`` in place."""
    import yaml

    remove = override.startswith("~")
    key, sep, raw = override[1:].partition("=") if remove else override.partition("=")
    if not remove and not sep:
        raise ValueError(f"overrides must be key=value (or ~key to delete one), got {override!r}")
    *parents, leaf = key.split(".")
    node: Any = config
    for i, part in enumerate(parents):
        if not isinstance(node, dict) or part not in node or not isinstance(node[part], dict):
            raise ValueError(f"override {override!r}: no section {'.'.join(parents[: i + 1])!r} in the config")
        node = node[part]
    if remove:
        if leaf not in node or leaf == "_component_":
            raise ValueError(f"override {override!r}: no field {key!r} to delete")
        del node[leaf]
        return
    value = yaml.safe_load(raw) if raw else ""
    if not parents and leaf not in SECTIONS:
        raise ValueError(f"override {override!r}: unknown section {leaf!r}; allowed: {list(SECTIONS)}")
    if leaf not in node and not _is_component(node):
        raise ValueError(f"override {override!r}: no field {key!r} in the config")
    if _is_component(node.get(leaf)) and isinstance(value, str):
        node[leaf]["_component_"] = value  # node=dotted.path swaps the component, keeps its arguments
    elif value is None and not parents and leaf not in (*_OPTIONAL_NODES, "threads", "ckpt_path"):
        raise ValueError(f"override {override!r}: {leaf} cannot be null")
    else:
        node[leaf] = value


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Read a recipe YAML (``${...}`` interpolations resolved), apply ``overrides``, check it.

    Returns:
        The config as plain dicts and lists.

    Raises:
        ValueError: a malformed override, an unknown section or key, a component that cannot be
            imported or does not take a key (the message names it).

    Example:
        >>> cfg = load_config("configs/grpo_torchtune.yaml", ["module.lr=0.05", "logger=null"])  # doctest: +SKIP
    """
    omegaconf = _omegaconf()
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} not found")
    OmegaConf = omegaconf.OmegaConf
    config = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a mapping of sections, got {type(config).__name__}")
    for override in overrides:
        _apply_override(config, override)
    config = OmegaConf.to_container(OmegaConf.create(config), resolve=True)  # ${...} see the overrides
    check_config(config)
    return config


def _instantiate(node: dict[str, Any], **kwargs: Any) -> Any:
    omegaconf = _omegaconf()
    return _torchtune_config().instantiate(omegaconf.OmegaConf.create(node), **kwargs)


def run(config: dict[str, Any]) -> tuple[Any, Any]:
    """Build everything ``config`` names and fit; returns ``(trainer, module)``.

    The resolved config is saved as ``recipe_config.yaml`` in the trainer's ``default_root_dir``.
    """
    import lightning as L
    import yaml

    check_config(config)
    if config.get("threads") is not None:
        if not isinstance(config["threads"], int) or config["threads"] < 1:
            raise ValueError(f"threads must be an int >= 1 or null, got {config['threads']!r}")
        torch.set_num_threads(config["threads"])
    L.seed_everything(config.get("seed", 0))
    source = _instantiate(config["prompt_source"]) if config.get("prompt_source") else None
    module = _instantiate(config["module"], **({"prompt_source": source} if source is not None else {}))
    logger_node = config.get("logger")
    resuming = bool(logger_node) and bool(config.get("ckpt_path")) and logger_node.get("run_id") is None
    if resuming and logger_node.get("_component_") == "tlt_lightning.fit.tracking_logger":
        from tlt_lightning.fit import DEFAULT_TRACKING_URI

        # As `fit --ckpt_path`: continue the MLflow run the checkpoint was saved from.
        uri = logger_node.get("tracking_uri", DEFAULT_TRACKING_URI)
        logger_node = {**logger_node, "run_id": resumable_run_id(config["ckpt_path"], uri)}
    logger = _instantiate(logger_node) if logger_node else False
    # Every checkpoint names its MLflow run (a resumed recipe continues it).
    callbacks = [_instantiate(node) for node in config.get("callbacks") or []] + [MLflowRunCheckpoint()]
    # As `fit` does: unless the config says otherwise, train in the precision that pays here.
    precision = {} if "precision" in config["trainer"] else {"precision": training_precision()}
    trainer = _instantiate(config["trainer"], logger=logger, callbacks=callbacks, **precision)
    root = Path(trainer.default_root_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "recipe_config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    trainer.fit(module, ckpt_path=config.get("ckpt_path"))
    return trainer, module


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tlt_lightning.recipes.grpo_torchtune", description=__doc__)
    parser.add_argument("--config", required=True, help="recipe YAML with _component_ nodes")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="torchtune-syntax overrides")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run(load_config(args.config, args.overrides))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
