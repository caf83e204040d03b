"""A C++ decode attention kernel for CPUs, built on first use with the machine's compiler
(``torch.utils.cpp_extension``).

:func:`decode_attention` is grouped-query attention of a few new tokens per row over the key/value
cache: each key/value head is read once, in place, for all the query heads and tokens it serves, with
scores, softmax and the weighted sum in fp32 (AVX-512 BF16 dot products where the CPU has them, the
probabilities rounded to bf16 for the sum as PyTorch's bf16 attention rounds them). The compiled decode
graphs (:mod:`~tlt_lightning.models.compiled`) attend by it on CPUs in bf16, where PyTorch's kernels spend
most of their time on fixed work per block (the flash kernel) or copying the cache (batched products).
Measured on SmolLM2 (bf16, one AMD Zen 5 core, 30 layers, 32 rows over 280 cached keys): 14-15 ms
against 38-39 ms for the batched products, eager or compiled (``docs/benchmarks.md``, "A C++ decode
attention kernel").

The sources are compiled once per source and CPU (``-O3 -march=native -fno-math-errno``, cached where
torch caches extensions: ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``, under
``tlt_lightning/``; a build lock left by a process killed mid-build is removed after ten minutes), which
needs a C++ compiler (Inductor needs one on CPUs too) and ``ninja``. :func:`available` says whether they
built: where they did not, it warns once and the graphs keep PyTorch's kernels.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

__all__ = ["HEAD_DIMS", "available", "build", "decode_attention", "loaded"]

_SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("decode_attention.cpp", "few_rows_linear.cpp", "adamw_bf16.cpp")
)
"""Built into one extension: the decode attention, :mod:`~tlt_lightning.kernels.linear`'s product and
:mod:`~tlt_lightning.kernels.adamw`'s optimizer step."""
_HEADER = Path(__file__).with_name("simd.h")  # what both include (part of the build's tag)
HEAD_DIMS = (64, 128)
"""Head dims :func:`decode_attention` has vectorised bf16 code for (others run a plain loop, also correct)."""

_LIBRARY = torch.library.Library("tlt_lightning", "FRAGMENT")
_LIBRARY.define(
    "decode_attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor"
)


@torch.library.register_fake("tlt_lightning::decode_attention")
def _(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def _cpu_tag() -> str:
    """A short hash of the CPU's model and flags: builds with ``-march=native`` are not shared between
    CPUs."""
    cpuinfo, described = Path("/proc/cpuinfo"), ""
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        described = "".join(
            next((line for line in lines if line.startswith(key)), "")
            for key in ("flags", "Features", "model name")
        )
    return hashlib.sha1((platform.machine() + platform.processor() + described).encode()).hexdigest()[:10]


STALE_LOCK_SECONDS = 600
"""A build lock older than this is left by a process that stopped while building (a build takes ~10-60 s)."""


def _build_directory(name: str) -> Path:
    """Where ``name`` builds: under ``TORCH_EXTENSIONS_DIR`` (default torch's build root), per Python and
    torch version (the library links against torch)."""
    from torch.utils import cpp_extension

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    versions = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    directory = root / "tlt_lightning" / versions / name
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _clear_stale_lock(directory: Path) -> None:
    """Remove a build lock that nobody will release.

    torch's builder holds ``lock`` in the build directory while it builds and waits, without a limit, for
    another holder to remove it: a process killed mid-build would make every later build on the machine
    hang."""
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        warnings.warn(
            f"removing {lock}, left {age / 60:.0f} minutes ago by a build that did not finish",
            stacklevel=3,
        )
        lock.unlink(missing_ok=True)


def build(name: str = "tlt_decode_attention", flags: tuple[str, ...] = ()) -> None:
    """Compile (once per source, CPU and ``flags``: later calls load the cached build) and load the kernels.

    ``flags`` are extra compiler flags (tests build the AVX-512 code without BF16 dot products into another
    op namespace: ``("-mno-avx512bf16", "-DTLT_NAMESPACE=...")``). Raises where it cannot build."""
    from torch.utils import cpp_extension

    sources = b"".join(source.read_bytes() for source in (*_SOURCES, _HEADER))
    tag = hashlib.sha1(sources + " ".join(flags).encode()).hexdigest()[:10]
    name = f"{name}_{tag}_{_cpu_tag()}"
    directory = _build_directory(name)
    _clear_stale_lock(directory)
    cpp_extension.load(
        name=name,
        sources=[str(source) for source in _SOURCES],
        extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp", *flags],
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
    )


@functools.cache
def available() -> bool:
    """Build (the first call on a machine, ~10 s) and load the kernel; ``False``, with one warning, if
    that fails."""
    try:
        build()
    except Exception as err:  # noqa: BLE001 - no compiler, no ninja, a failing build: any of them means "not here"
        warnings.warn(
            f"tlt_lightning's C++ kernels did not build ({type(err).__name__}: {err}); compiled decoding "
            "attends by PyTorch's kernels instead, and a bf16 policy's AdamW steps by PyTorch's operations "
            "(slower on CPUs)",
            stacklevel=2,
        )
        return False
    return True


def loaded() -> bool:
    """Whether :func:`available` has built and loaded the kernels in this process (never builds)."""
    return available.cache_info().currsize > 0 and available()


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Grouped-query attention with :func:`~tlt_lightning.models.attention.grouped_sdpa`'s contract
    (module docstring).

    Query head ``h`` reads key/value head ``h // g`` (``g = H_q / H_kv``).

    Args:
        query: ``[n, H_q, q, D]``.
        key, value: ``[n, H_kv, kv, D]`` (views of the cache are read in place where rows of ``D`` are
            contiguous).
        mask: ``[n, 1, q, kv]`` bool, True where a query may attend a key.
        scale: softmax scale.

    Returns:
        ``[n, H_q, q, D]``, contiguous, in ``query``'s dtype; a query that may attend no key gets zeros.
        Needs :func:`available` (a CPU op).
    """
    return torch.ops.tlt_lightning.decode_attention(query, key, value, mask, scale)
