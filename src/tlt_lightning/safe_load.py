"""Reading torch files a user or a registry hands the program, without running code from them.

A ``.pt`` / ``.ckpt`` file is a pickle: read in full (``torch.load(weights_only=False)``) it may run
any code its author put in it. Every torch file the package reads (Lightning checkpoints, optimizer
states) goes through :func:`load_torch_file`, which reads tensors, numbers, strings and plain
containers only (``weights_only=True``) and refuses anything else with a message that says why.
A file one trusts that holds other objects is read in full only where the environment variable
:data:`TRUST_ENV` is ``1`` (``TLT_LIGHTNING_TRUST_CHECKPOINTS=1 tlt-lightning fit --ckpt_path ...``).

Example:
    >>> trusts_checkpoints()
    False
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

__all__ = ["READ_ERRORS", "TRUST_ENV", "load_torch_file", "refusing_pickled_objects", "trusts_checkpoints"]

TRUST_ENV = "TLT_LIGHTNING_TRUST_CHECKPOINTS"
"""Set to ``1`` to read trusted torch files in full (unpickling runs code the file names)."""

READ_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    RuntimeError,
    OSError,
    zipfile.BadZipFile,
    ValueError,  # UnicodeDecodeError among them
    IndexError,
    KeyError,
    TypeError,
    AttributeError,
)
"""What ``torch.load`` raises on a truncated, corrupt or foreign file."""

_PICKLED_OBJECT = ("unsupported global", "unsupported class")  # the weights-only unpickler's refusals


def _reason(err: BaseException) -> str:
    """One line of ``err``: the weights-only unpickler's own reason, not its advice around it."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    marker = next((i for i, line in enumerate(lines) if "WeightsUnpickler error" in line), None)
    if marker is not None and marker + 1 < len(lines):
        return lines[marker + 1][:200]
    return (lines[0] if lines else "")[:200]


def trusts_checkpoints() -> bool:
    """Whether :data:`TRUST_ENV` is ``1``: torch files are then read in full (``weights_only=False``)."""
    return os.environ.get(TRUST_ENV, "").strip() == "1"


def _refusal(what: str) -> str:
    return (
        f"{what} holds pickled Python objects, not only tensors and plain values: reading it would run "
        f"code from the file, so it was refused. If you made this file or trust its source, set "
        f"{TRUST_ENV}=1 to read it in full"
    )


def _is_refusal(err: BaseException) -> bool:
    return isinstance(err, pickle.UnpicklingError) and any(s in str(err).lower() for s in _PICKLED_OBJECT)


@contextmanager
def refusing_pickled_objects(what: str) -> Iterator[None]:
    """Turns the weights-only unpickler's refusal inside the block into a ``ValueError`` naming
    ``what`` and :data:`TRUST_ENV` (for files a library reads itself: Lightning's ``ckpt_path="last"``).

    Example:
        >>> with refusing_pickled_objects("the checkpoint ckpt_path='last' names"):
        ...     pass
    """
    try:
        yield
    except pickle.UnpicklingError as err:
        if not _is_refusal(err):
            raise
        raise ValueError(_refusal(what)) from err


def _load(path: Path, weights_only: bool, mmap: bool) -> Any:
    if not mmap:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    except RuntimeError as err:  # the legacy (non-zip) format cannot be memory-mapped
        if "mmap" not in str(err):
            raise
        return torch.load(path, map_location="cpu", weights_only=weights_only)


def load_torch_file(path: str | os.PathLike, what: str, mmap: bool = False) -> Any:
    """The contents of the torch file ``path``, read without unpickling code (unless trusted).

    Args:
        path: the file.
        what: what it should be, for the messages (``"an optimizer state"``, ``"a Lightning checkpoint"``).
        mmap: memory-map the tensors where the format allows (a large checkpoint read for its metadata).

    Returns:
        The object saved (tensors on the CPU).

    Raises:
        ValueError: the file holds pickled objects other than tensors and plain containers (refused:
            reading them would run code from the file; the message names :data:`TRUST_ENV`), or it is
            truncated, corrupt or not a torch file. The message names the file.
    """
    path = Path(path)
    weights_only = not trusts_checkpoints()
    try:
        return _load(path, weights_only, mmap)
    except READ_ERRORS as err:
        if weights_only and _is_refusal(err):
            raise ValueError(_refusal(repr(str(path)))) from err
        raise ValueError(
            f"{str(path)!r} is corrupt or not {what} ({type(err).__name__}: {_reason(err)})"
        ) from err
