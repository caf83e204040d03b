"""Where one run writes its own files: :func:`run_dir`, the run's versioned directory.

Every file a fit writes besides its metrics (drafter checkpoints, timeline plots, the drafter
summary, the bandit's heat map, the drift probe's output, the resolved config) goes under one
directory of that run, the one Lightning's ``ModelCheckpoint`` puts ``checkpoints/`` in::

    <default_root_dir>/<experiment id>/<run id>/      MLflow with a database store (tlt-lightning fit)
    <save_dir>/<name>/version_<N>/                    a CSV / TensorBoard logger (its log_dir)
    <default_root_dir>/version_<N>/                   no logger: the first free N, claimed atomically

So two runs on one ``default_root_dir`` never share (or prune) each other's files, and a run resumed
into the same MLflow run (``fit --ckpt_path``) finds its own files again. ``fit --ckpt_path=last``
resumes the newest ``last.ckpt`` under ``default_root_dir`` (:func:`latest_checkpoint`).
"""

from __future__ import annotations

import re
import weakref
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger
from typing_extensions import override

__all__ = ["CheckpointsInRunDir", "latest_checkpoint", "run_dir", "save_run_config"]

_RESOLVED: weakref.WeakKeyDictionary[L.Trainer, Path] = weakref.WeakKeyDictionary()
_VERSION = re.compile(r"^version_(\d+)$")


def _claim_version(root: Path) -> Path:
    """``root/version_N`` for the first N above every existing one, created (``mkdir`` fails if taken)."""
    root.mkdir(parents=True, exist_ok=True)
    taken = [int(m.group(1)) for p in root.iterdir() if (m := _VERSION.match(p.name))]
    n = max(taken, default=-1) + 1
    while True:
        path = root / f"version_{n}"
        try:
            path.mkdir()
        except FileExistsError:  # another run claimed it meanwhile
            n += 1
            continue
        return path


def _resolve(trainer: L.Trainer) -> Path:
    if not trainer.loggers:
        return _claim_version(Path(trainer.default_root_dir))
    # Lightning's ModelCheckpoint resolves its default dirpath the same way (plus "checkpoints").
    logger = trainer.loggers[0]
    save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    return Path(save_dir, str(logger.name), version)


def run_dir(trainer: L.Trainer) -> Path:
    """The run's own output directory (created), resolved once per trainer.

    With a logger it is the directory Lightning's ``ModelCheckpoint`` writes ``checkpoints/`` into:
    for :func:`~tlt_lightning.tracking.tracking_logger` on a database store
    ``<default_root_dir>/<experiment id>/<run id>/``, for a CSV logger its ``log_dir``. Without a
    logger, ``<default_root_dir>/version_<N>/`` with a fresh ``N`` (two runs started at once get
    two directories).

    With several processes the first call for a trainer must be made on every rank at the same
    point (e.g. in a callback's ``setup`` or ``on_fit_start``): rank 0 resolves the directory and
    broadcasts it. Later calls return the cached path and need no communication.

    Example:
        >>> # class MyCallback(L.Callback):
        >>> #     def setup(self, trainer, pl_module, stage):
        >>> #         self.out = run_dir(trainer) / "my_callback"   # on every rank
    """
    found = _RESOLVED.get(trainer)
    if found is not None:
        return found
    path = str(_resolve(trainer)) if trainer.is_global_zero else None
    if trainer.world_size > 1:
        path = trainer.strategy.broadcast(path)
    found = Path(path)
    found.mkdir(parents=True, exist_ok=True)
    _RESOLVED[trainer] = found
    return found


def save_run_config(trainer: L.Trainer, text: str, filename: str = "config.yaml") -> Path:
    """Write a run's resolved config into :func:`run_dir` and, with MLflow, as the run's artifact.

    A run resumed into the same MLflow run keeps its first config: the resumed fit's goes beside
    it as ``<stem>-resume-<n><suffix>`` (``config-resume-1.yaml``). Call it on rank 0, after
    :func:`run_dir` was resolved on every rank. Returns the file written.
    """
    directory, name = run_dir(trainer), filename
    stem, suffix = Path(filename).stem, Path(filename).suffix
    n = 0
    while (directory / name).exists():
        n += 1
        name = f"{stem}-resume-{n}{suffix}"
    logger = trainer.logger
    if isinstance(logger, MLFlowLogger):
        logger.experiment.log_text(logger.run_id, text, name)
    (directory / name).write_text(text)
    return directory / name


class CheckpointsInRunDir(L.Callback):
    """Without a logger, ``ModelCheckpoint`` s with no ``dirpath`` write in the run's own directory.

    Lightning's default there is ``<default_root_dir>/checkpoints/``, one ``last.ckpt`` for every fit on
    that root; this makes it ``<default_root_dir>/version_<N>/checkpoints/`` (:func:`run_dir`), beside
    the run's other files. With a logger Lightning's default already is the run's directory.
    ``tlt-lightning fit`` adds it.
    """

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning calls the checkpoint callbacks' setup last, where they resolve their dirpath.
        if trainer.loggers:
            return
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = str(run_dir(trainer) / "checkpoints")


def latest_checkpoint(root: str | Path) -> Path:
    """The newest ``last.ckpt`` of the runs under ``root`` (``<run dir>/checkpoints/last*.ckpt``, by time).

    Raises:
        ValueError: there is none; the message names where it looked.
    """
    pattern = "**/checkpoints/last*.ckpt"
    found = [p for p in Path(root).glob(pattern) if p.is_file()]
    if not found:
        raise ValueError(
            f"ckpt_path 'last': no checkpoint matches {str(Path(root, pattern))!r}: pass a .ckpt file, the "
            "run's --trainer.default_root_dir, or no --ckpt_path to start a new run"
        )
    return max(found, key=lambda p: p.stat().st_mtime_ns)
