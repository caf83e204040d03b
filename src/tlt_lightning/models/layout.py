"""The memory layout of linear weights, for decoding and the verify forwards of speculative drafts on CPUs.

Three layouts, all with the same parameter values:

- ``"out_in"``: PyTorch's ``nn.Linear`` (row-major ``[out, in]``, ``x @ W.T``).
- ``"in_out"``: the same values stored column-major. MKL's fp32 product of a few rows is cheap for
  1-3 rows and jumps at 4 (it packs the weight on every call); stored ``[in, out]`` the jump is
  smaller (Ice Lake Xeon: 3- and 6-token chains 1.16x / 1.22x faster, plain decoding at batch 128
  0.91x; docs/benchmarks.md "Weight layout").
- ``"packed"``: parameters stay row-major, and in inference on a CPU every ``nn.Linear`` multiplies
  by a copy of its weight reordered once into oneDNN's blocked format (what Inductor's weight
  prepacking does), refreshed when the weight changes. On an AMD Zen 5 this made SmolLM2's
  linears 2x faster for one row in bfloat16 and 2.3-3x faster for 7-128 rows in fp32
  (docs/benchmarks.md "Prepacked weights"). It costs one more copy of the weights. Gradients,
  GPUs and dtypes oneDNN cannot pack take ``F.linear``, so a packed model trains as before. Up to
  :data:`FEW_ROWS_LINEAR` rows in bf16 multiply by :func:`~tlt_lightning.kernels.few_rows_linear` instead
  where the C++ kernels are loaded (compiled decoding loads them): oneDNN reads the weights well below
  the memory's speed for a single row.

Only the storage changes: every ``Parameter`` keeps its identity, shape and values, so optimizers,
tied weights and ``state_dict`` are unaffected (``"in_out"`` tensors are transposed views:
``.contiguous()`` them before ``safetensors.torch.save_file``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tlt_lightning import kernels

__all__ = [
    "FEW_ROWS_LINEAR",
    "WEIGHT_LAYOUTS",
    "PackedLinear",
    "PackedWeight",
    "column_major",
    "packable_dtypes",
    "set_weight_layout",
]

WEIGHT_LAYOUTS = ("out_in", "in_out", "packed")
"""How :func:`set_weight_layout` can store linear weights: PyTorch's ``[out, in]``, transposed, or packed."""
PACK_ROWS = (
    8  # the row count oneDNN's blocked format is chosen for (1-128 rows measured within ~10% of the best)
)
FEW_ROWS_LINEAR = 2
"""Rows up to which a packed bf16 linear multiplies by :func:`~tlt_lightning.kernels.few_rows_linear` where
it is loaded: SmolLM2's LM head (49k x 576, one Zen 4 thread) 3.3 ms for one row against oneDNN's 5.0,
3.6 against 5.0 for two, alike from three; a drafted token at batch 1 ~5% cheaper."""


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` -> the same values stored ``[in, out]`` (a transposed view of a contiguous copy)."""
    return weight.t().contiguous().t()


def _packable_dtypes(ops: Any = None) -> tuple[torch.dtype, ...]:
    """The dtypes the packed layout multiplies in on this CPU: those whose oneDNN ops give
    ``F.linear``'s result.

    The ops (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what Inductor's weight
    prepacking calls) are private to torch: tested with torch 2.13, admitted up to the ``<2.15`` bound of
    the package's torch requirement. So they are run once here on a small linear: on a torch where they
    are gone, changed or wrong, the packed layout falls back to ``F.linear`` with one warning instead of
    failing (or computing something else) in a rollout.

    Args:
        ops: the op namespace (default ``torch.ops.mkldnn``; tests pass a broken one).
    """
    if not torch.backends.mkldnn.is_available():
        return ()
    ops = torch.ops.mkldnn if ops is None else ops
    try:
        dtypes = [torch.float32, *([torch.bfloat16] if ops._is_mkldnn_bf16_supported() else [])]
        g = torch.Generator().manual_seed(0)
        weight, x, bias = (
            torch.randn(24, 40, generator=g),
            torch.randn(3, 40, generator=g),
            torch.randn(24, generator=g),
        )
        packable = []
        with torch.no_grad():
            for dtype in dtypes:
                w, xs, b = weight.to(dtype), x.to(dtype), bias.to(dtype)
                got = ops._linear_pointwise(xs, ops._reorder_linear_weight(w, PACK_ROWS), b, "none", [], "")
                tolerance = 1e-4 if dtype == torch.float32 else 5e-2
                if torch.allclose(got.float(), F.linear(xs, w, b).float(), rtol=tolerance, atol=tolerance):
                    packable.append(dtype)
    except (AttributeError, RuntimeError, TypeError) as err:  # an op missing or with another signature
        warnings.warn(
            f"weight_layout='packed' multiplies with F.linear: torch {torch.__version__}'s private "
            f"oneDNN ops failed a check ({type(err).__name__}: {err}); decoding on a CPU is slower, "
            "nothing else changes",
            stacklevel=2,
        )
        return ()
    if len(packable) < len(dtypes):
        wrong = [str(d) for d in dtypes if d not in packable]
        warnings.warn(
            f"weight_layout='packed' multiplies with F.linear in {wrong}: torch {torch.__version__}'s "
            "private oneDNN ops gave another result than F.linear there",
            stacklevel=2,
        )
    return tuple(packable)


_PACKABLE = _packable_dtypes()


class PackedWeight:
    """A oneDNN-packed copy of one weight, made on first use and remade when the weight changes.

    The copy is keyed on the weight's storage and in-place version counter: an optimizer step,
    ``load_state_dict`` or ``copy_`` bumps the version, so RL updates are picked up (writes through
    ``weight.data`` bypass the counter: avoid them on a packed model). Not copied or pickled.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None

    def __deepcopy__(self, memo: dict) -> PackedWeight:
        return PackedWeight()

    def __getstate__(self) -> dict:
        return {"_key": None, "_packed": None}

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, through the packed copy where it applies.

        It applies on a CPU, for fp32 (and bf16 where oneDNN supports it) weights multiplied in
        their own dtype (inputs of that dtype, or autocast to it), when no gradient is needed;
        everything else takes ``F.linear``. Bf16 inputs of up to :data:`FEW_ROWS_LINEAR` rows take
        :func:`~tlt_lightning.kernels.few_rows_linear` where it is loaded.
        """
        dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)  # the dtype F.linear would multiply in
        if (
            x.device.type != "cpu"
            or dtype != weight.dtype
            or dtype not in _PACKABLE
            or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
        ):
            return F.linear(x, weight, bias)
        few = x.numel() <= FEW_ROWS_LINEAR * x.shape[-1] and weight.is_contiguous()
        if few and dtype == torch.bfloat16 and kernels.loaded():
            return kernels.few_rows_linear(x.to(dtype), weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x.to(dtype), self.packed(weight), bias, "none", [], "")

    def release(self) -> int:
        """Drop the packed copy (remade on next use); returns its bytes (its logical size: oneDNN's blocks
        may pad it a little). An RL step drops it once its rollouts end: the update changes the weights, so
        the copy would be remade anyway, and training need not hold it."""
        freed = 0 if self._packed is None else self._packed.numel() * self._packed.element_size()
        self._key = self._packed = None
        return freed

    def packed(self, *weights: torch.Tensor) -> torch.Tensor:
        """The packed copy of ``weights`` (CPU tensors of a dtype in ``packable_dtypes()``), remade if
        one changed.

        Several weights of one input size are packed as one, stacked along the outputs (``torch.cat``):
        one product computes all of them (merged q/k/v projections)."""
        key = tuple((w.data_ptr(), w._version, w.shape) for w in weights)  # a new dtype is a new storage
        if self._key != key:
            # A normal tensor even under inference_mode, so later no_grad calls can use it.
            with torch.inference_mode(False), torch.no_grad():
                weight = (
                    weights[0].detach().contiguous() if len(weights) == 1 else torch.cat(weights).detach()
                )
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
            self._key = key
        assert self._packed is not None
        return self._packed


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes oneDNN packs on this CPU (empty without oneDNN)."""
    return _PACKABLE


class PackedLinear(nn.Linear):
    """``nn.Linear`` multiplying by a :class:`PackedWeight` copy in CPU inference (``"packed"`` layout).

    Made from ``nn.Linear`` modules in place by :func:`set_weight_layout`; same parameters, same
    ``state_dict``.
    """

    _packed_weight: PackedWeight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # traced (a compiled drafter step): the parameter is a graph input
            return F.linear(x, self.weight, self.bias)
        return self._packed_weight.linear(x, self.weight, self.bias)


def set_weight_layout(model: nn.Module, layout: str) -> int:
    """Lay out the weight of every ``nn.Linear`` of ``model`` as ``layout``, in place.

    With ``"in_out"``, an LM head tied to an input embedding is left row-major: the embedding
    gathers rows of it, and gathering columns would make every lookup strided (15x slower for a
    4k-token prefill). :class:`~tlt_lightning.models.HFTarget` keeps a column-major copy of such a
    head instead. ``"packed"`` leaves every weight row-major (tied ones included) and turns plain
    ``nn.Linear`` modules (not subclasses such as QAT's) into :class:`PackedLinear`.

    Args:
        model: any module; its ``nn.Linear`` weights (including those wrapped by peft) are relaid.
        layout: one of :data:`WEIGHT_LAYOUTS`.

    Returns:
        How many linears changed layout.
    """
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight layout must be one of {WEIGHT_LAYOUTS}, got {layout!r}")
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    changed = 0
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, nn.Linear) or weight is None:
                continue
            moved = False
            if type(module) is PackedLinear and layout != "packed":
                module.__class__ = nn.Linear
                del module._packed_weight
                moved = True
            elif type(module) is nn.Linear and layout == "packed":
                module.__class__ = PackedLinear
                module._packed_weight = PackedWeight()
                moved = True
            is_column_major = weight.stride() == (1, weight.shape[0]) and not weight.is_contiguous()
            if id(weight) not in embeddings and is_column_major != (layout == "in_out"):
                weight.data = column_major(weight.data) if layout == "in_out" else weight.data.contiguous()
                moved = True
            changed += moved
    return changed
