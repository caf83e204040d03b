"""``F.linear`` for a few input rows that reads each weight row once (C++, built with the decode attention).

A verify forward of one request feeds its ``K + 1`` tokens through every linear: a product of a few rows
by a large weight, bound by streaming the weights. oneDNN's bf16 product re-streams them for a few rows at
well below the memory's speed (SmolLM2, one AMD Zen 4 core: a chain-2 verify of one row, 3 tokens, took
28 ms against 16 ms for one token by :func:`~tlt_lightning.models.compiled.row_gemv`). :func:`few_rows_linear`
takes four weight rows at a time and meets every input row with them (AVX-512 BF16 dot products, sums in
fp32, one rounding): the weights stream once. The compiled graphs of one row and several tokens multiply
by it on CPUs in bf16 (:class:`~tlt_lightning.models.compiled.CompileConfig` ``few_rows_linear``).
"""

from __future__ import annotations

import torch

from tlt_lightning.kernels.attention import _LIBRARY

__all__ = ["FEW_ROWS", "few_rows_linear"]

FEW_ROWS = 16
"""Input rows up to which the compiled graphs multiply by :func:`few_rows_linear` (the largest verify)."""

_LIBRARY.define("few_rows_linear(Tensor input, Tensor weight, Tensor? bias) -> Tensor")


@torch.library.register_fake("tlt_lightning::few_rows_linear")
def _(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


def few_rows_linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(input, weight, bias)``, summed in fp32 and rounded once, for a few rows (module docstring).

    Args:
        input: ``[..., K]`` (CPU; any number of rows, fast up to :data:`FEW_ROWS`).
        weight: ``[N, K]``, ``input``'s dtype.
        bias: ``[N]`` or ``None``.

    Returns:
        ``[..., N]`` in ``input``'s dtype. Needs :func:`~tlt_lightning.kernels.available` (a CPU op).
    """
    return torch.ops.tlt_lightning.few_rows_linear(input, weight, bias)
