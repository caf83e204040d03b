"""C++ kernels for CPUs, built on first use with the machine's compiler: decoding (:mod:`.attention`,
:mod:`.linear`) and a bf16 policy's optimizer step (:mod:`.adamw`)."""

from tlt_lightning.kernels.adamw import adamw_bf16_
from tlt_lightning.kernels.attention import HEAD_DIMS, available, decode_attention, loaded
from tlt_lightning.kernels.linear import FEW_ROWS, few_rows_linear

__all__ = [
    "FEW_ROWS",
    "HEAD_DIMS",
    "adamw_bf16_",
    "available",
    "decode_attention",
    "few_rows_linear",
    "loaded",
]
