"""Stopping a fit on SIGTERM or SIGINT at a step boundary, with a checkpoint to resume from.

Lightning already stops a fit on SIGTERM: its signal handler sets ``trainer.received_sigterm`` and
the fit loop raises ``SIGTERMException`` (a ``SystemExit``) once the current training step has ended;
every callback's ``on_exception`` sees it. :class:`CheckpointOnSignal` saves ``last.ckpt`` there (the
policy, the optimizer, every callback's state, e.g. the drafter, the bandit and the MLflow run), and
routes SIGINT (Ctrl+C) to the same stop instead of Lightning's ``KeyboardInterrupt`` wherever it
lands, mid-step (a second Ctrl+C still interrupts at once, saving nothing).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from tlt_lightning.tracking.lightning_mlflow import mlflow_loggers

__all__ = ["CheckpointOnSignal"]


class CheckpointOnSignal(L.Callback):
    """Saves ``last.ckpt`` when SIGTERM or SIGINT stops the fit at the end of the current step.

    Where the first ``ModelCheckpoint`` writes ``last.ckpt`` (nothing without a ``ModelCheckpoint``).
    The fit then ends with Lightning's ``SIGTERMException``; :meth:`report` marks the MLflow run
    ``KILLED``, says so in one line and gives the exit status ``128 + signal`` (143 for SIGTERM, 130
    for SIGINT), as ``tlt-lightning fit`` does.

    Attributes:
        signal: the signal that stopped the fit (``None``: none did).
        saved: the checkpoint written when it stopped (``None``: none).

    Example:
        >>> stop = CheckpointOnSignal()
        >>> # trainer = Trainer(callbacks=[stop, ModelCheckpoint(save_last=True)]); trainer.fit(module)
        >>> # except SIGTERMException: sys.exit(stop.report(trainer))
    """

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self.saved: Path | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After Lightning registered its handlers: it restores the previous SIGINT handler at teardown.
        self.signal, self.saved = None, None
        handler = signal.getsignal(signal.SIGINT)
        if threading.current_thread() is threading.main_thread() and handler is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.signal = signal.SIGINT
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl+C interrupts at once
        stop = signal.getsignal(signal.SIGTERM)  # Lightning's: stop at the end of this step
        if callable(stop):
            stop(signum, frame)

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        self.signal = self.signal or signal.SIGTERM
        self.saved = _save_last(trainer)

    def report(self, trainer: L.Trainer, program: str = "tlt-lightning fit") -> int:
        """After the fit stopped (Lightning marked the MLflow run ``FAILED``): mark it ``KILLED`` and print
        one line on stderr, what stopped it, what was saved and how to resume (rank 0).

        Returns:
            The exit status, ``128 + signal`` (``SIGTERM`` when no signal was recorded).
        """
        got = self.signal or signal.SIGTERM
        if not trainer.is_global_zero:
            return 128 + got
        runs = []
        for logger in mlflow_loggers(trainer):
            logger.experiment.set_terminated(logger.run_id, "KILLED")
            runs.append(logger.run_id)
        done = f"saved {self.saved}" if self.saved else "nothing saved (no ModelCheckpoint)"
        marked = f"; MLflow run {', '.join(runs)} marked KILLED" if runs else ""
        resume = f"; resume: the same command with --ckpt_path={self.saved}" if self.saved else ""
        stopped = f"{program}: stopped by {got.name} after step {trainer.global_step}"
        print(f"{stopped}: {done}{marked}{resume}", file=sys.stderr)
        return 128 + got


def _save_last(trainer: L.Trainer) -> Path | None:
    """Save ``last.ckpt`` where the first ``ModelCheckpoint`` puts it (unless it holds this step already)."""
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None:
            continue
        if not callback.save_last:
            path = Path(callback.dirpath, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
            trainer.save_checkpoint(path)
            return path
        # _should_skip_saving_checkpoint: this step is saved already (every_n_train_steps).
        if not callback._should_skip_saving_checkpoint(trainer):
            callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))
        return Path(callback.last_model_path)
    return None
