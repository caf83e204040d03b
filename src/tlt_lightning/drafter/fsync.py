"""Files that survive a crash and writers that share a folder: fsync, and whose temporaries are whose.

A rename is atomic, but only durable once the renamed file and its directory are fsynced; a process
id identifies a writer only on its own machine, hence :func:`host_id`.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

__all__ = ["fsync_dir", "fsync_file", "host_id", "process_alive"]


def host_id() -> str:
    """This machine, as 8 hex digits (a process id means something only on its own machine)."""
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine is running (a process of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush directory ``path`` (the renames and new names in it) to disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
