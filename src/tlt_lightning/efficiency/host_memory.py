"""The C allocator's share of a CPU fit's resident memory: where glibc keeps freed memory, and giving it back.

A training step on a CPU allocates and frees hundreds of MB of activations and logits; PyTorch's CPU
allocator hands each to ``malloc``. glibc serves blocks up to its mmap threshold from its heaps and
keeps what is freed there for reuse, and the threshold *rises* (up to 32 MiB on 64-bit) each time an
mmapped block is freed. So after a few steps nearly every activation lives in the heaps, whose free
holes the next, differently shaped step cannot always reuse: the process's resident memory climbs
step after step above what its tensors need (the demo: 6.8 GB peak for ~2.2 GB of live tensors,
``python -m benchmarks memory``; docs/benchmarks.md "Memory").

:func:`set_mmap_threshold` fixes the threshold (``mallopt(M_MMAP_THRESHOLD)``, what the
``MALLOC_MMAP_THRESHOLD_`` environment variable sets at start): larger blocks are mapped on their own and
returned to the system when freed. :func:`trim` (``malloc_trim(0)``) returns the heaps' free pages.
Both are glibc's; elsewhere (musl, macOS, Windows) they do nothing and say so by returning ``False``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

__all__ = [
    "check_mmap_threshold",
    "glibc",
    "malloc_mb",
    "peak_rss_mb",
    "resident_kinds_mb",
    "rss_mb",
    "set_mmap_threshold",
    "trim",
]

M_MMAP_THRESHOLD = -3
"""``mallopt`` parameter number of the mmap threshold (glibc's ``malloc.h``)."""
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024
"""glibc's largest mmap threshold on 64-bit systems (``HEAP_MAX_SIZE / 2``); ``mallopt`` refuses more."""


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (it has ``mallopt`` and ``malloc_trim``), else ``None``."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not all(hasattr(libc, f) for f in ("mallopt", "malloc_trim", "gnu_get_libc_version")):
        return None
    return libc


def check_mmap_threshold(nbytes: object) -> None:
    """Refuse an ``nbytes`` that is not an int in ``[0, 32 MiB]``.

    Raises:
        ValueError: anything else; the message gives glibc's limit and a usual value.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(
            f"mmap threshold must be an int number of bytes in [0, {MAX_MMAP_THRESHOLD}] (32 MiB, glibc's "
            f"limit), got {nbytes!r}; 131072 (128 KiB) maps every tensor larger than 128 KiB on its own"
        )


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve blocks of at least ``nbytes`` by their own mappings, returned to the system when freed.

    Fixing the threshold also stops glibc from raising it (see the module docstring). Smaller values
    return more memory and cost more page faults (each large tensor's pages are mapped anew).

    Args:
        nbytes: threshold in bytes, in ``[0, 32 MiB]`` (e.g. 128 KiB, glibc's starting value).

    Returns:
        Whether it was applied (``False`` where the C library is not glibc).

    Raises:
        ValueError: ``nbytes`` outside ``[0, 32 MiB]``.
    """
    check_mmap_threshold(nbytes)
    libc = glibc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, nbytes))


def trim() -> bool:
    """Return the free pages of glibc's heaps to the system (``malloc_trim(0)``).

    Returns:
        Whether glibc gave memory back (``False`` also where the C library is not glibc).
    """
    libc = glibc()
    return libc is not None and bool(libc.malloc_trim(0))


def rss_mb() -> float | None:
    """The process's resident memory now, in MiB (Linux ``/proc/self/statm``); ``None`` elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _proc_kb(path: str, *keys: str) -> list[int] | None:
    """The ``kB`` values of ``keys`` in a ``Key:  value kB`` file of ``/proc``; ``None`` where unreadable."""
    try:
        with open(path) as f:
            fields = {k: v.split() for k, _, v in (line.partition(":") for line in f) if v.strip()}
        return [int(fields[k][0]) for k in keys]
    except (OSError, KeyError, ValueError):
        return None


def peak_rss_mb() -> float | None:
    """The process's peak resident memory so far, in MiB (Linux ``VmHWM``), ``None`` elsewhere.

    Not ``getrusage``'s ``ru_maxrss``: a process started by another keeps its parent's peak in that one.
    """
    kb = _proc_kb("/proc/self/status", "VmHWM")
    return None if kb is None else kb[0] / 1024


def resident_kinds_mb() -> dict[str, float] | None:
    """Resident memory by kind, in MiB (Linux ``/proc/self/smaps_rollup``), ``None`` elsewhere.

    ``"anonymous"``: memory no file backs (the C heaps, with every tensor, freed blocks glibc keeps, and
    Python's objects); ``"file"``: mapped files (the libraries' code, weights read by ``mmap``).
    """
    kb = _proc_kb("/proc/self/smaps_rollup", "Rss", "Anonymous")
    if kb is None:
        return None
    rss, anonymous = kb
    return {"anonymous": anonymous / 1024, "file": (rss - anonymous) / 1024}


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            *("arena", "ordblks", "smblks", "hblks", "hblkhd"),
            *("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"),
        )
    ]


def malloc_mb() -> dict[str, float] | None:
    """glibc's account of ``malloc`` memory over all its arenas, in MiB (``mallinfo2``), else ``None``.

    ``"in_use"``: blocks allocated and not freed (heap blocks and mmapped ones); ``"free_held"``: freed
    blocks its heaps keep for reuse, resident unless trimmed (what :func:`set_mmap_threshold` and
    :func:`trim` are about).
    """
    libc = glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):  # mallinfo2: glibc >= 2.33
        return None
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return {"in_use": (info.uordblks + info.hblkhd) / 2**20, "free_held": info.fordblks / 2**20}
