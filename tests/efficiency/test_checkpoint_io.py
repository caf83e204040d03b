"""StreamingCheckpointIO: checkpoints written straight to disk, atomically, without a copy in memory."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.rl.test_module import make_module, make_trainer, params
from tlt_lightning.efficiency import StreamingCheckpointIO
from tlt_lightning.efficiency import checkpoint_io as module

# The high-water mark of resident memory a save adds for 256 MiB of weights, with either CheckpointIO.
SCRIPT = """
import sys, torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from tlt_lightning.efficiency import StreamingCheckpointIO
from tlt_lightning.efficiency.host_memory import peak_rss_mb
io = StreamingCheckpointIO() if sys.argv[1] == "streaming" else TorchCheckpointIO()
weights = torch.ones(64 * 2**20)  # 256 MiB, touched
before = peak_rss_mb()
io.save_checkpoint({"state_dict": {"w": weights}}, sys.argv[2])
print(peak_rss_mb() - before)
"""


def _save_peak_mb(kind: str, path) -> float:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, kind, str(path)], capture_output=True, text=True, check=True
    )
    return float(out.stdout.split()[-1])


def test_a_save_adds_no_copy_of_the_checkpoint_to_resident_memory(tmp_path):
    assert _save_peak_mb("lightning", tmp_path / "a.ckpt") >= 200  # the control: a copy in a BytesIO
    assert _save_peak_mb("streaming", tmp_path / "b.ckpt") <= 32
    assert (tmp_path / "a.ckpt").stat().st_size == pytest.approx(
        (tmp_path / "b.ckpt").stat().st_size, rel=0.01
    )


def test_a_checkpoint_reads_back_as_saved_and_leaves_no_partial_file(tmp_path):
    io, path = StreamingCheckpointIO(), tmp_path / "sub" / "last.ckpt"
    checkpoint = {"state_dict": {"w": torch.randn(3, 4)}, "global_step": 7}
    io.save_checkpoint(checkpoint, path)
    loaded = io.load_checkpoint(path)
    assert loaded["global_step"] == 7 and torch.equal(
        loaded["state_dict"]["w"], checkpoint["state_dict"]["w"]
    )
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]


def test_a_path_on_another_filesystem_is_saved_the_lightning_way():
    io = StreamingCheckpointIO()
    io.save_checkpoint({"global_step": 3}, "memory://tlt-checkpoint-io/last.ckpt")  # fsspec's in-memory one
    assert io.load_checkpoint("memory://tlt-checkpoint-io/last.ckpt")["global_step"] == 3


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    io, path = StreamingCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1}, path)

    def fail(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(module.torch, "save", fail)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint({"global_step": 2}, path)
    monkeypatch.undo()
    assert io.load_checkpoint(path)["global_step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_fit_saves_through_it_and_resumes_from_its_checkpoint(tmp_path):
    full = make_module()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    make_trainer(2, callbacks=[ckpt], enable_checkpointing=True, plugins=[StreamingCheckpointIO()]).fit(full)
    resumed = make_module()
    make_trainer(2, plugins=[StreamingCheckpointIO()]).fit(
        resumed, ckpt_path=tmp_path / "epoch=0-step=1.ckpt"
    )
    for name, value in params(full).items():
        assert torch.equal(params(resumed)[name], value), name
