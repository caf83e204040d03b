"""CheckpointOnSignal: SIGTERM and SIGINT stop a fit at the end of the step, with last.ckpt of that step."""

from __future__ import annotations

import os
import signal

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from tests.rl.test_module import make_module, make_trainer
from tlt_lightning.callbacks import CheckpointOnSignal

# GRPO steps its optimizer itself: a checkpoint holds the weights after the step, as resuming needs.
pytestmark = pytest.mark.filterwarnings("ignore:Using ModelCheckpoint with manual optimization")


@pytest.fixture(autouse=True)
def ctrl_c_interrupts():
    """SIGINT as in a terminal, whatever this process inherited (a shell's background job ignores it)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


class SignalAt(L.Callback):
    """Sends ``sig`` to this process in the middle of step ``step`` (after its rollout, before its update)."""

    def __init__(self, sig: int, step: int) -> None:
        self.sig, self.step = sig, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step - 1:
            os.kill(os.getpid(), self.sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_step_ends_the_step_and_saves_it(tmp_path, sig, capsys):
    stop = CheckpointOnSignal()
    every_2 = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=2, save_last=True)
    trainer = make_trainer(
        5, callbacks=[SignalAt(sig, 3), stop, every_2], enable_checkpointing=True, default_root_dir=tmp_path
    )
    with pytest.raises(SIGTERMException):
        trainer.fit(make_module())
    # Step 3 ran to its end and is saved where last.ckpt goes (the interval alone would keep step 2).
    assert trainer.global_step == 3 and (stop.signal, stop.saved) == (sig, tmp_path / "checkpoints/last.ckpt")
    saved = torch.load(stop.saved, weights_only=False)
    assert saved["global_step"] == 3
    # The exit status and the one line a command prints (no MLflow logger here: no run to mark).
    assert stop.report(trainer, "prog") == 128 + sig
    assert capsys.readouterr().err.splitlines() == [
        f"prog: stopped by {sig.name} after step 3: saved {stop.saved}; resume: the same command with "
        f"--ckpt_path={stop.saved}"
    ]
    # Lightning put back the handlers it found: Ctrl+C is a KeyboardInterrupt again.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_save_last_it_writes_last_ckpt_beside_the_others(tmp_path):
    stop = CheckpointOnSignal()
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=10)
    trainer = make_trainer(
        4, callbacks=[SignalAt(signal.SIGTERM, 2), stop, checkpoints], enable_checkpointing=True
    )
    with pytest.raises(SIGTERMException):
        trainer.fit(make_module())
    assert stop.saved == tmp_path / "ckpts" / "last.ckpt"
    assert CheckpointOnSignal().report(trainer) == 143  # none recorded: SIGTERM, nothing saved
    assert torch.load(stop.saved, weights_only=False)["global_step"] == 2


def test_a_fit_that_ends_leaves_nothing_recorded(tmp_path):
    stop = CheckpointOnSignal()
    make_trainer(1, callbacks=[stop], default_root_dir=tmp_path).fit(make_module())
    assert (stop.signal, stop.saved) == (None, None)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
