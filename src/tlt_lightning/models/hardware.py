"""Which precision pays on this machine: bf16 only where the hardware multiplies it natively.

bf16 halves the bytes a decode step reads, but a CPU without bf16 matrix instructions converts
every product to fp32 first: on an AVX-512 Xeon without them SmolLM2 decoded 2.5x slower in bf16
than in fp32 at batch 32 (docs/benchmarks.md, "A CPU without bf16 units"), while on CPUs with
AMX or AVX512-BF16, and on GPUs, bf16 is the faster one. ``"auto"`` settings resolve here.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

__all__ = [
    "COMPILE_MIN_PARAMETERS",
    "cpu_bf16_instructions",
    "cpu_info",
    "has_cpp_compiler",
    "has_fast_bf16",
    "resolve_decode",
    "resolve_dtype",
    "training_precision",
]

log = logging.getLogger(__name__)

COMPILE_MIN_PARAMETERS = 10_000_000
"""``decode="auto"`` compiles only models at least this large: compiling takes tens of seconds per graph,
which a model whose decode step costs microseconds never earns back."""

BF16_INSTRUCTIONS = ("amx_bf16", "avx512_bf16")


def cpu_info(field: str) -> str:
    """The value of the first ``field`` line of ``/proc/cpuinfo`` (Linux only; ``""`` elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    fields = (line.partition(":") for line in lines)
    return next((value.strip() for key, _, value in fields if key.strip() == field), "")


def cpu_bf16_instructions() -> list[str]:
    """The bf16 matrix instructions this CPU has, of ``amx_bf16`` and ``avx512_bf16``."""
    return sorted(set(BF16_INSTRUCTIONS) & set(cpu_info("flags").split()))


def has_fast_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether bf16 matrix products run natively on ``device`` (a CUDA GPU that supports bf16, or
    a CPU with AMX or AVX512-BF16)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(cpu_bf16_instructions())


def resolve_dtype(name: str | None, device: torch.device | str = "cpu") -> str | None:
    """``"auto"`` -> ``"bfloat16"`` where :func:`has_fast_bf16`, else ``"float32"``; other names as given.

    Example:
        >>> resolve_dtype("float16")
        'float16'
    """
    if name != "auto":
        return name
    return "bfloat16" if has_fast_bf16(device) else "float32"


def training_precision(device: torch.device | str | None = None) -> str:
    """Lightning's ``Trainer(precision=)`` that pays on ``device`` (default: the GPU if there is
    one, else the CPU): ``"bf16-mixed"`` where :func:`has_fast_bf16`, else ``"32-true"``."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "bf16-mixed" if has_fast_bf16(device) else "32-true"


def has_cpp_compiler() -> bool:
    """Whether a C++ compiler is on the ``PATH`` (``$CXX``, else ``c++``, ``g++`` or ``clang++``): Inductor
    builds its CPU kernels with it."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return any(shutil.which(name) for name in names)


def resolve_decode(name: str, device: torch.device | str = "cpu", num_parameters: int | None = None) -> str:
    """``"auto"`` -> ``"compiled"`` where compiled graphs pay: a CUDA device, or a CPU with a C++ compiler
    (:func:`has_cpp_compiler`), for a model of at least :data:`COMPILE_MIN_PARAMETERS` parameters (when
    ``num_parameters`` is given); else ``"hf"`` (with a warning when only the compiler is missing).
    ``"compiled"`` on a CPU without a compiler warns and gives ``"hf"``. Other names as given.

    Example:
        >>> resolve_decode("auto", "cpu", num_parameters=1000)
        'hf'
    """
    device = torch.device(device)
    if name not in ("auto", "compiled"):
        return name
    if name == "auto" and num_parameters is not None and num_parameters < COMPILE_MIN_PARAMETERS:
        return "hf"
    if device.type == "cpu" and not has_cpp_compiler():
        log.warning("decode=%r: no C++ compiler (set $CXX or install g++), so rollouts decode eagerly", name)
        return "hf"
    if device.type in ("cpu", "cuda"):
        return "compiled"
    return "hf"
