"""Activation memory measured on any device, CPU included: live bytes of the tensors a step creates.

``torch.cuda.max_memory_allocated`` has no CPU counterpart, and process-level measures (RSS,
``tracemalloc``) see neither the allocator's reuse nor which bytes are activations. This meter is a
:class:`~torch.utils._python_dispatch.TorchDispatchMode`: every ATen op's output storage that is
new (not a view of, or written in place into, one of the op's inputs) is counted from its creation
until its Python storage object is freed (a ``weakref.finalize``). Counted are the tensors made by
*forward computation*: everything created during the forward pass, and during the backward pass
only what runs with grad mode on, which is the recomputation of checkpointed blocks (the autograd
engine runs gradient formulas with grad mode off). Gradients, optimizer state and parameters do not
depend on a checkpointing plan and are not counted.

What it misses: scratch memory an op allocates and frees internally (never a tensor), and the
allocator's own overhead. Per-op Python overhead is a few microseconds: measure memory and time in
separate runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["ActivationMemoryMeter", "MemoryReport", "measure_step"]


class MemoryReport(NamedTuple):
    """Activation bytes of one training step.

    Attributes:
        peak_bytes: the most activation bytes alive at once, forward and backward together.
        forward_bytes: activation bytes still alive when the forward returned (held for backward).
    """

    peak_bytes: int
    forward_bytes: int


class ActivationMemoryMeter(TorchDispatchMode):
    """Counts live bytes of tensors created by forward computation while it is active.

    Use as a context manager around the forward pass; call :meth:`start_backward` before
    ``loss.backward()`` so gradient tensors stop counting (recomputation still counts).

    Attributes:
        live_bytes: bytes alive now (of tensors created while the meter was active).
        peak_bytes: the most bytes alive at once since the start or the last :meth:`reset_peak`.

    Example:
        >>> lin = torch.nn.Linear(8, 8)
        >>> with ActivationMemoryMeter() as meter:
        ...     loss = torch.tanh(lin(torch.ones(4, 8))).sum()
        >>> meter.live_bytes >= 4 * 8 * 4  # tanh's output is saved for backward
        True
    """

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}  # storage data_ptr -> bytes, for live counted storages
        self._born: dict[int, int] = {}  # storage data_ptr -> creation sequence number
        self._seq = 0
        self._watched: dict[tuple[int, int], bool] = {}  # (key, creation number) -> used since watched
        self.live_bytes = 0
        self.peak_bytes = 0
        self._backward = False

    # ------------------------------------------------------------------------------------ queries
    @property
    def sequence(self) -> int:
        """Creations counted so far (the next creation gets this number)."""
        return self._seq

    def identify(self, tensor: torch.Tensor) -> tuple[int, int, int] | None:
        """``(storage key, creation number, bytes)`` of a counted, live tensor's storage, else ``None``.

        Creation numbers grow with :attr:`sequence`; :meth:`is_alive` tells later whether that same
        storage (not a new one at a reused address) is still alive.
        """
        key = tensor.untyped_storage().data_ptr()
        if key not in self._born:
            return None
        return key, self._born[key], self._sizes[key]

    def is_alive(self, ident: tuple[int, int, int]) -> bool:
        return self._born.get(ident[0]) == ident[1]

    def watch(self, ident: tuple[int, int, int]) -> None:
        """Start recording whether any later op reads this storage (:meth:`was_read`)."""
        self._watched.setdefault(ident[:2], False)

    def was_read(self, ident: tuple[int, int, int]) -> bool:
        """Whether an op read the watched storage after :meth:`watch` (while the meter was active)."""
        return self._watched.get(ident[:2], False)

    def reset_peak(self) -> None:
        """Restart the peak from the bytes alive now."""
        self.peak_bytes = self.live_bytes

    def start_backward(self) -> None:
        """From now on count only creations with grad mode on (recomputation), not gradients."""
        self._backward = True

    # ------------------------------------------------------------------------------- accounting
    def _free(self, key: int) -> None:
        size = self._sizes.pop(key, 0)
        self._born.pop(key, None)
        self.live_bytes -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._backward and not torch.is_grad_enabled():
            return out
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        if self._watched:
            for key in inputs:
                if (key, self._born.get(key)) in self._watched:
                    self._watched[key, self._born[key]] = True
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            # Views and in-place results share an input's storage: already counted, or not ours.
            if size == 0 or key in inputs or key in self._sizes:
                continue
            self._sizes[key] = size
            self._born[key] = self._seq
            self._seq += 1
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            # Storages keep their Python object while alive, so this fires when the memory is freed.
            weakref.finalize(storage, self._free, key)
        return out


def measure_step(forward: Callable[[], torch.Tensor]) -> MemoryReport:
    """Peak activation bytes of one forward + backward: ``forward()`` returns the scalar loss.

    Args:
        forward: runs the model and returns a scalar loss (grad mode is enabled around it).

    Returns:
        :class:`MemoryReport`. Parameter ``.grad`` fields are written as by any backward.

    Example:
        >>> lin = torch.nn.Linear(8, 8)
        >>> report = measure_step(lambda: torch.tanh(lin(torch.ones(4, 8))).sum())
        >>> report.peak_bytes >= report.forward_bytes > 0
        True
    """
    with torch.enable_grad(), ActivationMemoryMeter() as meter:
        loss = forward()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"forward must return a scalar loss tensor, got {type(loss).__name__}")
        held = meter.live_bytes
        meter.start_backward()
        loss.backward()
        del loss
    return MemoryReport(meter.peak_bytes, held)
