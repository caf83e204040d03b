"""The memory order of linear weights, for the verify forwards of deep speculative drafts on CPUs.

``nn.Linear`` stores its weight ``[out, in]`` and multiplies ``x @ W.T``. MKL's fp32 product of a
few rows is cheap for 1-3 rows and jumps at 4 (packing the weight); stored ``[in, out]`` (the same
values, column-major) the jump is smaller: a 7-row product through SmolLM2's linears took 1.6x a
1-row one instead of 2.2x (hot-cache micro-benchmark, Ice Lake Xeon). End to end, side by side
(``tlt-lightning bench layout``, docs/benchmarks.md "Weight layout"), ``"in_out"`` made 3- and
6-token chains 1.16x / 1.22x faster there, but 2-token chains 0.87x and plain decoding at batch 128
0.91x: it is an option, not the default. Only the storage changes: every ``Parameter`` keeps its
identity, shape and values, so optimizers, tied weights and ``state_dict`` are unaffected (the
tensors are transposed views: ``.contiguous()`` them before ``safetensors.torch.save_file``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["WEIGHT_LAYOUTS", "column_major", "set_weight_layout"]

WEIGHT_LAYOUTS = ("out_in", "in_out")


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` -> the same values stored ``[in, out]`` (a transposed view of a contiguous copy)."""
    return weight.t().contiguous().t()


def set_weight_layout(model: nn.Module, layout: str) -> int:
    """Store the weight of every ``nn.Linear`` of ``model`` in ``layout``, in place.

    An LM head tied to an input embedding is left row-major: the embedding gathers rows of it, and
    gathering columns would make every lookup strided (15x slower for a 4k-token prefill).
    :class:`~tlt_lightning.models.HFTarget` keeps a column-major copy of such a head instead.

    Args:
        model: any module; its ``nn.Linear`` weights (including those wrapped by peft) are relaid.
        layout: ``"out_in"`` (row-major, PyTorch's default) or ``"in_out"`` (column-major).

    Returns:
        How many weights changed storage.
    """
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight layout must be one of {WEIGHT_LAYOUTS}, got {layout!r}")
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    changed = 0
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, nn.Linear) or weight is None or id(weight) in embeddings:
                continue
            is_column_major = weight.stride() == (1, weight.shape[0]) and not weight.is_contiguous()
            if is_column_major != (layout == "in_out"):
                weight.data = column_major(weight.data) if layout == "in_out" else weight.data.contiguous()
                changed += 1
    return changed
