from __future__ import annotations

import errno
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.drafter.conftest import make_drafter
from tests.helpers import run_at_once
from tlt_lightning.drafter import load_drafter
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.spot import AsyncCheckpointer


def trained(drafter, steps: int = 1, seed: int = 0):
    """An AdamW optimizer with state, after ``steps`` random-gradient steps."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for _ in range(steps):
        for p in drafter.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return opt


def test_save_load_roundtrip_with_optimizer(llama, tmp_path):
    d = make_drafter(llama, "eagle3", draft_vocab_size=64)
    opt = trained(d, 2)
    ckpt = AsyncCheckpointer(tmp_path / "ckpt")
    assert ckpt.latest() is None and ckpt.checkpoints() == []
    ckpt.save(d, opt, step=7, extra={"rl_step": 3, "coordinator": {"windows": 2}})
    assert ckpt.wait(timeout=30)
    path = ckpt.latest()
    assert path == tmp_path / "ckpt" / "step-00000007" and ckpt.saved == 1
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "meta.json",
        "model.safetensors",
        "optimizer.pt",
    ]
    fresh = make_drafter(llama, "eagle3", draft_vocab_size=64, seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    info = AsyncCheckpointer.load(path, fresh, fresh_opt)
    assert info.step == 7 and info.extra == {"rl_step": 3, "coordinator": {"windows": 2}}
    for k, v in d.state_dict().items():
        assert fresh.state_dict()[k].equal(v), k
    a, b = opt.state_dict(), fresh_opt.state_dict()
    for pid, state in a["state"].items():
        for key, value in state.items():
            assert b["state"][pid][key].equal(value)
    # The weights are a plain drafter checkpoint: deployable as is.
    loaded = load_drafter(path, llama)
    assert loaded.fc.weight.equal(d.fc.weight)


def test_snapshot_is_taken_at_save_time(llama, tmp_path):
    """Training may update the live tensors while the writer still writes: the snapshot must not move."""
    d = make_drafter(llama)
    opt = trained(d)
    ckpt = AsyncCheckpointer(tmp_path)
    gate = threading.Event()
    ckpt._hook = lambda stage, tmp: gate.wait(10) if stage == "weights" else None
    expected = d.fc.weight.detach().clone()
    ckpt.save(d, opt, 1)
    with torch.no_grad():
        d.fc.weight.add_(1.0)  # the "next training step"
    gate.set()
    ckpt.wait(30)
    fresh = make_drafter(llama, seed=3)
    AsyncCheckpointer.load(ckpt.latest(), fresh)
    assert fresh.fc.weight.equal(expected)


def test_snapshot_buffers_are_reused_and_correct(llama, tmp_path):
    d = make_drafter(llama)
    opt = trained(d)
    ckpt = AsyncCheckpointer(tmp_path)
    ckpt.save(d, opt, 1)
    ckpt.wait(30)
    first = ckpt._spare.weights["fc.weight"]
    with torch.no_grad():
        d.fc.weight.add_(1.0)
    ckpt.save(d, opt, 2)
    ckpt.wait(30)
    assert ckpt._spare.weights["fc.weight"] is first  # the same CPU buffer, overwritten
    fresh = make_drafter(llama, seed=5)
    AsyncCheckpointer.load(ckpt.latest(), fresh)
    assert fresh.fc.weight.equal(d.fc.weight)
    AsyncCheckpointer.load(ckpt.checkpoints()[0], fresh)
    torch.testing.assert_close(fresh.fc.weight, d.fc.weight - 1.0)
    no_reuse = AsyncCheckpointer(tmp_path / "b", reuse_buffers=False)
    no_reuse.save(d, None, 1)
    no_reuse.wait(30)
    assert no_reuse._spare is None


def test_keep_and_superseded(llama, tmp_path):
    d = make_drafter(llama)
    ckpt = AsyncCheckpointer(tmp_path, keep=2)
    gate = threading.Event()
    ckpt._hook = lambda stage, tmp: gate.wait(10) if stage == "rename" else None
    ckpt.save(d, None, 1)
    ckpt.save(d, None, 2)  # pending
    ckpt.save(d, None, 3)  # replaces the pending step 2
    assert ckpt.in_flight and ckpt.superseded == 1
    assert not ckpt.wait(timeout=0.05)
    gate.set()
    assert ckpt.wait(30) and not ckpt.in_flight
    assert [p.name for p in ckpt.checkpoints()] == ["step-00000001", "step-00000003"]
    ckpt._hook = None
    for step in (4, 5):
        ckpt.save(d, None, step)
    ckpt.wait(30)
    assert [p.name for p in ckpt.checkpoints()] == ["step-00000004", "step-00000005"]
    assert not (ckpt.latest() / "optimizer.pt").exists()
    ckpt.save(d, None, 5)  # the same step again replaces it
    ckpt.wait(30)
    assert [p.name for p in ckpt.checkpoints()] == ["step-00000004", "step-00000005"]
    state = ckpt.state_dict()
    assert (state["saved"], state["superseded"]) == (5, 1)  # 1, 3, 4, 5, 5
    assert state["owned"] == [4, 5] and state["writers"] == [ckpt.writer_id]


def test_save_does_not_block_on_a_slow_writer(llama, tmp_path):
    d = make_drafter(llama)
    ckpt = AsyncCheckpointer(tmp_path)
    writing, gate = threading.Event(), threading.Event()

    def stall(stage, tmp):
        if stage == "weights":
            writing.set()
            assert gate.wait(30)

    ckpt._hook = stall
    ckpt.save(d, trained(d), 1)  # returns although the writer cannot finish until the gate opens
    assert writing.wait(30) and ckpt.in_flight and ckpt.latest() is None
    gate.set()
    assert ckpt.wait(30) and ckpt.latest().name == "step-00000001"


def test_writer_failure_is_raised_later(llama, tmp_path):
    d = make_drafter(llama)
    ckpt = AsyncCheckpointer(tmp_path)

    def fail(stage, tmp):
        raise RuntimeError("disk full")

    ckpt._hook = fail
    ckpt.save(d, None, 1)
    with pytest.raises(RuntimeError, match="background drafter checkpoint write failed.*disk full"):
        ckpt.wait(30)
    assert ckpt.latest() is None and not list(tmp_path.glob("*.tmp-*"))  # temp dir cleaned up
    ckpt._hook = None
    ckpt.save(d, None, 2)
    ckpt.wait(30)
    assert ckpt.latest().name == "step-00000002"


def test_a_full_disk_is_an_os_error_naming_the_folder(llama, tmp_path):
    ckpt = AsyncCheckpointer(tmp_path)

    def full(stage, tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    ckpt._hook = full
    ckpt.save(make_drafter(llama), None, 1)
    with pytest.raises(OSError, match=r"\[Errno 28\] No space left on device: '.*test_a_full_disk") as info:
        ckpt.wait(30)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path)


def test_errors(llama, tmp_path):
    d = make_drafter(llama)
    with pytest.raises(ValueError, match="keep must be an int >= 1, got 0"):
        AsyncCheckpointer(tmp_path, keep=0)
    ckpt = AsyncCheckpointer(tmp_path)
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        ckpt.save(d, None, -1)
    with pytest.raises(ValueError, match="extra must be JSON-serialisable"):
        ckpt.save(d, None, 1, extra={"tensor": torch.zeros(1)})
    with pytest.raises(ValueError, match="is not a complete drafter checkpoint"):
        AsyncCheckpointer.load(tmp_path, d)
    ckpt.save(d, None, 1)
    ckpt.wait(30)
    other = make_drafter(llama, "eagle3")
    with pytest.raises(ValueError, match="does not fit the drafter: missing"):
        AsyncCheckpointer.load(ckpt.latest(), other)
    (ckpt.latest() / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match="meta.json is not valid JSON"):
        AsyncCheckpointer.load(ckpt.latest(), d)


_KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from pathlib import Path
    from tlt_lightning.models import HFTarget, load_model
    from tlt_lightning.drafter import Drafter, DrafterConfig
    from tlt_lightning.spot import AsyncCheckpointer

    directory, stage = Path(sys.argv[1]), sys.argv[2]
    target = HFTarget(load_model("tiny-llama").model)
    torch.manual_seed(0)
    d = Drafter(DrafterConfig.from_target(target), target)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    ckpt = AsyncCheckpointer(directory, keep=1)
    ckpt.save(d, opt, 1, extra={"tag": "first"})
    ckpt.wait()
    with torch.no_grad():
        for p in d.parameters():
            p.add_(1.0)

    def stall(s, tmp):
        if s == stage:
            (directory / "stalled").write_text(str(tmp))
            time.sleep(120)

    ckpt._hook = stall
    ckpt.save(d, opt, 2, extra={"tag": "second"})
    time.sleep(120)
    """
)


# ~10 s each (a fresh interpreter imports torch + transformers): one stage fast, the other slow.
@pytest.mark.parametrize("stage", ["rename", pytest.param("weights", marks=pytest.mark.slow)])
def test_sigkill_during_save_leaves_previous_checkpoint_loadable(llama, tmp_path, stage):
    """A real process is SIGKILLed while its background writer is mid-save (stalled by the hook)."""
    directory = tmp_path / "ckpt"
    script = tmp_path / "saver.py"
    script.write_text(_KILL_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, str(script), str(directory), stage], env=env)
    try:
        deadline = time.monotonic() + 60
        while not (directory / "stalled").exists():
            assert proc.poll() is None, "the saver exited early"
            assert time.monotonic() < deadline, "the saver never reached the stall"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    partial = Path((directory / "stalled").read_text())
    assert partial.exists() and ".tmp-" in partial.name  # the half-written save is still there...
    ckpt = AsyncCheckpointer(directory, keep=1)
    assert [p.name for p in ckpt.checkpoints()] == ["step-00000001"]  # ...but never picked up
    torch.manual_seed(0)
    d = make_drafter(llama, seed=0)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    info = ckpt.load(ckpt.latest(), d, opt)
    assert info.step == 1 and info.extra == {"tag": "first"}
    assert json.loads((info.path / "meta.json").read_text())["step"] == 1
    reference = make_drafter(llama, seed=0)
    for k, v in reference.state_dict().items():
        assert d.state_dict()[k].equal(v), k
    # The next save cleans up the dead process's temp dir, but keeps its checkpoint (not this writer's) ...
    ckpt.save(d, opt, 3)
    ckpt.wait(30)
    assert not partial.exists() and [p.name for p in ckpt.checkpoints()] == ["step-00000001", "step-00000003"]
    assert ckpt.owns(ckpt.latest()) and not ckpt.owns(directory / "step-00000001")
    # ... unless it resumes that writer (its state restored from a Lightning checkpoint): then it prunes it.
    dead_writer = json.loads((directory / "step-00000001" / "meta.json").read_text())["writer"]
    ckpt.load_state_dict({"writers": [dead_writer], "owned": [1]})
    ckpt.save(d, opt, 4)
    ckpt.wait(30)
    assert [p.name for p in ckpt.checkpoints()] == ["step-00000004"]
    assert sorted(p.name for p in directory.iterdir()) == ["stalled", "step-00000004"]  # nothing stray


# ---------------------------------------------------------------------------------- several writers


def entries(directory: Path) -> list[str]:
    """Everything in ``directory``; every ``step-*`` folder must be a complete checkpoint."""
    names = sorted(p.name for p in directory.iterdir())
    for name in names:
        assert ".tmp-" not in name, f"stray temporary {name}"
        assert (directory / name / "meta.json").is_file(), f"incomplete or empty {name}"
    return names


def _save_all(ckpt: AsyncCheckpointer, drafter, steps, errors: list) -> None:
    try:
        for step in steps:
            ckpt.save(drafter, None, step)
            ckpt.wait(60)
    except Exception as err:  # noqa: BLE001 -- reported by the test
        errors.append(err)


def test_two_writers_in_one_folder_lose_no_save_and_leave_nothing_stray(llama, tmp_path):
    d = make_drafter(llama)
    a, b = AsyncCheckpointer(tmp_path, keep=2), AsyncCheckpointer(tmp_path, keep=2)
    errors: list = []
    threads = [
        threading.Thread(target=_save_all, args=(a, d, range(1, 40, 2), errors)),
        threading.Thread(target=_save_all, args=(b, d, range(2, 41, 2), errors)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and a.saved == b.saved == 20
    # Each writer pruned only its own checkpoints: the newest two of each are left.
    assert entries(tmp_path) == ["step-00000037", "step-00000038", "step-00000039", "step-00000040"]
    assert [a.owns(tmp_path / n) for n in entries(tmp_path)] == [True, False, True, False]


def test_pruning_never_deletes_another_writers_checkpoints(llama, tmp_path):
    """The reported loss: a 12-step run's checkpoints pruned right away because a 30-step run's were newer."""
    d = make_drafter(llama)
    long_run = AsyncCheckpointer(tmp_path, keep=2)
    for step in (10, 20, 30):
        long_run.save(d, None, step)
        long_run.wait(30)
    short_run = AsyncCheckpointer(tmp_path, keep=2)
    for step in (4, 8, 12):
        short_run.save(d, None, step)
        short_run.wait(30)
    assert entries(tmp_path) == ["step-00000008", "step-00000012", "step-00000020", "step-00000030"]


def test_the_same_step_from_two_writers_ends_complete(llama, tmp_path):
    """Writer A is held just before its rename while B saves the same step: both land, A's rename wins."""
    d = make_drafter(llama)
    a, b = AsyncCheckpointer(tmp_path, keep=1), AsyncCheckpointer(tmp_path, keep=1)
    at_rename, go = threading.Event(), threading.Event()

    def hold(stage, tmp):
        if stage == "rename":
            at_rename.set()
            assert go.wait(30)

    a._hook = hold
    a.save(d, None, 5)
    assert at_rename.wait(30)
    b.save(d, None, 5)  # B's whole save (stale clean-up, rename, prune) while A's temporary exists
    assert b.wait(30) and b.owns(tmp_path / "step-00000005")
    go.set()
    assert a.wait(30) and a.saved == b.saved == 1
    assert entries(tmp_path) == ["step-00000005"] and a.owns(tmp_path / "step-00000005")
    b.save(d, None, 6)  # B's keep=1 prunes B's own step 5 only, which A has replaced: nothing to delete
    assert b.wait(30) and entries(tmp_path) == ["step-00000005", "step-00000006"]


def _process_writer(directory: str, first: int, start, results) -> None:
    torch.set_num_threads(1)
    target = HFTarget(load_model("tiny-llama").model)
    drafter = make_drafter(target)
    ckpt, errors = AsyncCheckpointer(directory, keep=3), []
    start.wait(60)
    _save_all(ckpt, drafter, range(first, first + 60, 2), errors)
    results.put((first, ckpt.saved, [repr(e) for e in errors]))


def test_two_processes_in_one_folder_lose_no_save(tmp_path):
    """Two processes write 30 checkpoints each into one folder at once (the reported 183/300 failures)."""
    context = multiprocessing.get_context("spawn")
    outcome = run_at_once(context, _process_writer, [(str(tmp_path), first) for first in (1, 2)])
    assert outcome == [(1, 30, []), (2, 30, [])]
    assert entries(tmp_path) == [f"step-{s:08d}" for s in range(55, 61)]


@pytest.fixture
def complete(llama, tmp_path):
    d = make_drafter(llama)
    ckpt = AsyncCheckpointer(tmp_path / "ckpt")
    ckpt.save(d, trained(d), 3)
    ckpt.wait(30)
    return d, ckpt.latest()


@pytest.mark.parametrize("name", ["model.safetensors", "meta.json", "optimizer.pt"])
def test_load_of_an_empty_file_names_it(complete, name):
    d, path = complete
    (path / name).write_bytes(b"")
    with pytest.raises(ValueError, match=rf"{name} is empty \(0 bytes\): the checkpoint is incomplete"):
        AsyncCheckpointer.load(path, d, torch.optim.AdamW(d.parameters()))


def test_load_of_corrupt_files_raises_value_error_naming_the_file(complete):
    d, path = complete
    opt = torch.optim.AdamW(d.parameters())
    (path / "optimizer.pt").write_bytes(b"\x80\x04garbage" * 8)
    with pytest.raises(ValueError, match=r"optimizer.pt' is corrupt or not an optimizer state"):
        AsyncCheckpointer.load(path, d, opt)
    (path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match=r"model.safetensors is corrupt or not a safetensors file"):
        AsyncCheckpointer.load(path, d)
    (path / "meta.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"meta.json must hold a JSON object, got list"):
        AsyncCheckpointer.load(path, d)


def test_load_refuses_non_finite_weights(complete):
    d, path = complete
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    key = sorted(k for k, v in tensors.items() if v.is_floating_point())[0]
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"tensor '{key}' has 1 non-finite value"):
        AsyncCheckpointer.load(path, d)
