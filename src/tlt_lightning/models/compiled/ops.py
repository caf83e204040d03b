"""The products compiled graphs multiply by: oneDNN-packed weights (an op Inductor keeps), one-row bf16.

On a CPU the graphs' linears multiply by oneDNN-packed copies of the weights
(:class:`~tlt_lightning.models.layout.PackedWeight`, what the ``"packed"`` layout uses) through
:func:`packed_linear`; the packed copies are graph *inputs*, remade when a weight changes in place (an RL
update), so graphs never freeze weights. In bf16 a graph of one row of one token multiplies by the plain
weights as an Inductor reduction instead (:func:`row_gemv`).
"""

from __future__ import annotations

import torch

__all__ = ["packed_linear", "row_gemv"]

# A library op, not ``torch.library.custom_op``: one kernel for every backend (packed weights are
# MkldnnCPU tensors), no autograd (the graphs run without it), and less dispatch per call, which a step
# of hundreds of products feels (docs/benchmarks.md).
_LIBRARY = torch.library.Library("tlt_lightning", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")
_LIBRARY.impl(
    "packed_linear",
    lambda x, packed, bias, out_features: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""),
    "CompositeExplicitAutograd",
)


@torch.library.register_fake("tlt_lightning::packed_linear")
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` oneDNN-packed (:meth:`PackedWeight.packed`); ``[..., in] -> [..., out]``.

    An op of its own (``torch.ops.tlt_lightning.packed_linear``), so Inductor calls oneDNN as it is (its
    own lowering of packed linears wants frozen weights).
    """
    return torch.ops.tlt_lightning.packed_linear(x, packed, bias, out_features)


def row_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for one row as a product and a sum, which Inductor compiles to one vectorised
    reduction that streams ``weight`` once; ``[1, 1, in] -> [1, 1, out]``, accumulated in fp32.

    oneDNN's bf16 product for a single row is a memory-bound matrix-vector one that streams the weights
    slower. For many rows this would read the weight once per row: only graphs of one row use it.
    """
    out = (x.float().unsqueeze(-2) * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
