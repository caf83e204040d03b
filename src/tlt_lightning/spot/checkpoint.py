"""Asynchronous, atomic checkpoints of the drafter and its optimizer that never block the caller.

:meth:`AsyncCheckpointer.save` copies the tensors to CPU on the caller's thread (a memory copy:
milliseconds for a one-layer drafter) and hands the copy to a background writer thread, which
writes ``step-XXXXXXXX.tmp-<host>-<pid>-<writer>/``, fsyncs every file and the directory, then
renames it to ``step-XXXXXXXX/``. A process killed mid-save leaves at worst a stray ``*.tmp-*``
directory (removed by the next save of any writer on the same machine, once that process is gone);
:meth:`latest` only ever sees complete checkpoints, and the previous ones are deleted (beyond
``keep``) only after the new one is in place.

Several writers may share one directory (two runs on one ``default_root_dir``, two processes): each
temporary name is unique to its writer (host, process and a random writer id), a writer removes only
its own temporaries (and those of dead processes on its machine), a checkpoint is deleted by first
renaming it to a private name (no reader or writer ever sees a half-deleted ``step-*`` folder), and
pruning (``keep``) only touches the checkpoints this writer wrote (``meta.json`` names the writer).

The layout of one checkpoint, and reading it back (:meth:`AsyncCheckpointer.load`), are in
:mod:`tlt_lightning.spot.checkpoint_io`.

``torch.distributed.checkpoint.async_save`` also runs on CPU without a process group (torch 2.13,
with a warning), but writes sharded ``.distcp`` files in place (no rename: a kill leaves a
half-written checkpoint under its final name) that only DCP can read back, not a deployable drafter.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import save_file

from tlt_lightning.drafter.fsync import fsync_dir, fsync_file, host_id, process_alive
from tlt_lightning.drafter.hub import CONFIG_NAME, WEIGHTS_NAME, checkpoint_config
from tlt_lightning.drafter.model import Drafter
from tlt_lightning.drafter.snapshot import snapshot_state
from tlt_lightning.spot.checkpoint_io import (
    META_NAME,
    OPTIMIZER_NAME,
    list_checkpoints,
    load_checkpoint,
    read_meta,
)

__all__ = ["AsyncCheckpointer"]

# step-XXXXXXXX.tmp-<host>-<pid>-<writer>[-old]; before writers had ids: step-XXXXXXXX.tmp-<pid>[-old]
_TEMP = re.compile(
    r"^step-\d{8,}\.tmp-(?:(?P<host>[0-9a-f]{8})-)?(?P<pid>\d+)(?:-(?P<writer>[0-9a-f]{12}))?(?:-old)?$"
)
_PUBLISH_ATTEMPTS = 100  # renames lost to other writers of the same step before giving up


class _Job(NamedTuple):
    step: int
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    meta: dict[str, Any]


class AsyncCheckpointer:
    """Background, atomic drafter + optimizer checkpoints in ``directory``, keeping the newest ``keep``.

    If a save is requested while the previous one is still being written, the newer snapshot waits
    as the single pending job; a still newer one replaces it (counted in :attr:`superseded`): the
    caller never waits and at most three snapshots are held in memory (being written, pending,
    spare buffers). A failure in the writer is raised by the next :meth:`save` or :meth:`wait`.

    Other writers (threads, processes, runs) may save into the same directory at the same time:
    every save still lands, none deletes another's files, and no empty or partial ``step-*``
    folder is left. The same step saved by two writers: the later rename wins.

    Args:
        directory: where the ``step-*`` checkpoints live (created on first save).
        keep: checkpoints *of this writer* to keep (``>= 1``); its older ones are deleted after a
            new one lands. Checkpoints of other writers in the directory are never deleted.
        reuse_buffers: keep the CPU buffers of the last written snapshot and copy the next one into
            them (the caller's copy then takes about half as long, for one snapshot of memory
            held between saves).

    Example:
        >>> # ckpt = AsyncCheckpointer("runs/drafter", keep=2)
        >>> # ckpt.save(drafter, optimizer, step=100, extra={"buffer_step": 100})   # returns at once
        >>> # ckpt.wait(); info = ckpt.load(ckpt.latest(), drafter, optimizer)
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 2, reuse_buffers: bool = True) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self.directory = Path(directory)
        self.keep = keep
        self.reuse_buffers = bool(reuse_buffers)
        self.saved = 0
        self.superseded = 0
        # This writer's id, in its temporary names and in meta.json ("writer"): what it may delete.
        self.writer_id = uuid.uuid4().hex[:12]
        self._writers = {self.writer_id}  # its own id and those restored by load_state_dict (a resumed run)
        self._owned: list[int] = []  # steps this writer (or the run it resumes) wrote, oldest first
        self._temp_suffix = f"tmp-{host_id()}-{os.getpid()}-{self.writer_id}"
        self.last_blocking_s = 0.0  # caller-side time of the last save()
        self.last_write_s = 0.0  # writer-side time of the last completed checkpoint
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: _Job | None = None
        self._spare: _Job | None = None  # a written snapshot whose buffers the next save() reuses
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # Test hook: called by the writer with (stage, temp dir) at "weights", "optimizer", "rename".
        self._hook: Callable[[str, Path], None] | None = None

    # ------------------------------------------------------------------------------ saving
    def save(
        self,
        drafter: Drafter,
        optimizer: torch.optim.Optimizer | None,
        step: int,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Snapshot ``drafter`` (and ``optimizer``) now; write them in the background.

        Args:
            drafter: its ``state_dict`` and config are saved.
            optimizer: its ``state_dict`` is saved (``None``: weights only).
            step: names the checkpoint (``>= 0``); saving a step again replaces that checkpoint.
            extra: JSON-serialisable metadata (counters, the coordinator's state, ...).

        Raises:
            ValueError: a negative step, or ``extra`` that is not JSON-serialisable.
            RuntimeError: the previous background write failed.
        """
        start = time.perf_counter()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        try:
            extra_json = json.loads(json.dumps(extra or {}))
        except (TypeError, ValueError) as err:
            raise ValueError(f"extra must be JSON-serialisable, got {extra!r}: {err}") from err
        self._raise_error()
        with self._lock:  # buffers of a snapshot already written (or superseded), if any
            spare = self._spare
            self._spare = None
        job = _Job(
            step,
            snapshot_state(drafter.state_dict(), spare and spare.weights),
            None if optimizer is None else snapshot_state(optimizer.state_dict(), spare and spare.optimizer),
            {
                "config": drafter.config,
                "step": step,
                "extra": extra_json,
                "time": time.time(),
                "writer": self.writer_id,
            },
        )
        with self._lock:
            if self._thread is not None:
                if self._pending is not None:
                    self.superseded += 1
                    self._spare = self._pending if self.reuse_buffers else None
                self._pending = job
            else:
                # Not a daemon: interpreter exit waits for the write in flight to finish.
                self._thread = threading.Thread(target=self._drain, args=(job,), name="drafter-ckpt")
                self._thread.start()
        self.last_blocking_s = time.perf_counter() - start

    def _drain(self, job: _Job | None) -> None:
        while job is not None:
            ok = False
            try:
                start = time.perf_counter()
                self._write(job)
                self.last_write_s = time.perf_counter() - start
                ok = True
            except Exception as err:  # noqa: BLE001 -- any failure is re-raised by the next save() / wait()
                with self._lock:
                    self._error = err
            with self._lock:
                self.saved += ok
                if self.reuse_buffers:
                    self._spare = job
                job, self._pending = self._pending, None
                if job is None:
                    self._thread = None
                    self._idle.notify_all()

    def _write(self, job: _Job) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_stale()
        final = self.directory / f"step-{job.step:08d}"
        tmp = self.directory / f"{final.name}.{self._temp_suffix}"
        shutil.rmtree(tmp, ignore_errors=True)  # our own, from a failed write
        tmp.mkdir()
        try:
            save_file(job.weights, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
            fsync_file(tmp / WEIGHTS_NAME)
            self._stage("weights", tmp)
            if job.optimizer is not None:
                with open(
                    tmp / OPTIMIZER_NAME, "wb"
                ) as file:  # a full disk: an OSError, not "unexpected pos"
                    torch.save(job.optimizer, file)
                fsync_file(tmp / OPTIMIZER_NAME)
            self._stage("optimizer", tmp)
            config = checkpoint_config(job.meta["config"])  # the layout of Drafter.save_pretrained
            (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
            meta = {k: job.meta[k] for k in ("step", "extra", "time", "writer")}
            (tmp / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
            for name in (CONFIG_NAME, META_NAME):
                fsync_file(tmp / name)
            fsync_dir(tmp)
            self._stage("rename", tmp)
            self._publish(tmp, final)
            fsync_dir(self.directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        with self._lock:
            self._owned = [s for s in self._owned if s != job.step] + [job.step]
            expired = sorted(self._owned)[: -self.keep]
            self._owned = [s for s in self._owned if s not in expired]
        for step in expired:
            self._delete(self.directory / f"step-{step:08d}")

    def _publish(self, tmp: Path, final: Path) -> None:
        """Rename the complete ``tmp`` to ``final``; an existing ``final`` (the same step saved again,
        by this or another writer) is first moved aside to a private name, then deleted."""
        aside = self.directory / f"{final.name}.{self._temp_suffix}-old"
        for _ in range(_PUBLISH_ATTEMPTS):
            try:
                os.rename(tmp, final)  # atomic; fails while ``final`` is a non-empty directory
                return
            except OSError as err:
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
            shutil.rmtree(aside, ignore_errors=True)
            try:
                os.rename(final, aside)
            except FileNotFoundError:  # another writer moved it first: try again
                continue
            shutil.rmtree(aside, ignore_errors=True)
        raise RuntimeError(f"could not rename {tmp.name} to {final}: other writers kept replacing it")

    def _delete(self, path: Path) -> None:
        """Delete ``path`` if it is a checkpoint of this writer: renamed away first, then removed."""
        meta = read_meta(path)
        if meta is None or meta.get("writer") not in self._writers:
            return  # gone, or replaced by another writer's save of the same step: not ours to delete
        trash = self.directory / f"{path.name}.{self._temp_suffix}-old"
        shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def _remove_stale(self) -> None:
        """Remove temporaries left by this writer, or by processes of this machine that are gone."""
        host, pid = host_id(), os.getpid()
        for stale in self.directory.glob("step-*.tmp-*"):
            found = _TEMP.match(stale.name)
            if found is None:
                continue
            if (
                found["writer"] == self.writer_id
                and int(found["pid"]) == pid
                or (
                    found["host"] in (None, host)
                    and int(found["pid"]) != pid
                    and not process_alive(int(found["pid"]))
                )
            ):
                shutil.rmtree(stale, ignore_errors=True)

    def _stage(self, stage: str, tmp: Path) -> None:
        if self._hook is not None:
            self._hook(stage, tmp)

    def _raise_error(self) -> None:
        with self._lock:
            err, self._error = self._error, None
        if isinstance(err, OSError):  # a full disk, a folder made read-only: name the folder
            raise OSError(err.errno, err.strerror, err.filename or str(self.directory)) from err
        if err is not None:
            raise RuntimeError(f"a background drafter checkpoint write failed: {err!r}") from err

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every requested save is on disk; re-raise a writer failure.

        Returns:
            ``False`` if ``timeout`` seconds passed first.
        """
        with self._lock:
            done = self._idle.wait_for(lambda: self._thread is None, timeout)
        self._raise_error()
        return done

    @property
    def in_flight(self) -> bool:
        """Whether a write is running or pending."""
        with self._lock:
            return self._thread is not None

    # ------------------------------------------------------------------------------ reading
    def owns(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` is a complete checkpoint written by this writer (or the run it resumes)."""
        meta = read_meta(Path(path))
        return meta is not None and meta.get("writer") in self._writers

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints in ``directory``, oldest first."""
        return list_checkpoints(self.directory)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or ``None``."""
        found = self.checkpoints()
        return found[-1] if found else None

    load = staticmethod(load_checkpoint)

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Counters, and which checkpoints are this writer's (so that a resumed run prunes them)."""
        with self._lock:
            return {
                "saved": self.saved,
                "superseded": self.superseded,
                "writers": sorted(self._writers),
                "owned": list(self._owned),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; missing keys keep their current values.

        The restored writers' checkpoints count as this writer's own (``keep``, :meth:`owns`).
        """
        with self._lock:
            self.saved = int(state.get("saved", self.saved))
            self.superseded = int(state.get("superseded", self.superseded))
            self._writers |= {str(w) for w in state.get("writers", ())}
            restored = [int(s) for s in state.get("owned", ())]
            self._owned = [s for s in restored if s not in self._owned] + self._owned
