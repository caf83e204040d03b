"""A consistent CPU copy of a (nested) state dict, taken before it is written in the background."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["snapshot_state"]


def snapshot_state(obj: Any, reuse: Any = None) -> Any:
    """A deep copy of a (nested) state dict with every tensor copied to CPU, detached.

    The copy is what makes the save consistent: training may update the live tensors in place
    while the writer thread is still writing the copy.

    Args:
        obj: tensors in (nested) dicts, lists and tuples; other values are kept as they are.
        reuse: an earlier snapshot of the same structure no one reads any more: its tensors are
            overwritten in place where shape and dtype match (no fresh allocation: about 2x faster
            than cloning on this CPU, where page-faulting new memory dominates the copy).
    """
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        if (
            isinstance(reuse, torch.Tensor)
            and reuse.shape == src.shape
            and reuse.dtype == src.dtype
            and reuse.device.type == "cpu"
        ):
            return reuse.copy_(src)
        return src.to("cpu", copy=True).contiguous()
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: snapshot_state(v, old.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        old = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        return type(obj)(snapshot_state(v, r) for v, r in zip(obj, old))
    return obj
