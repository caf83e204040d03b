"""C++ kernels for CPU decoding, built on first use with the machine's compiler (:mod:`.attention`,
:mod:`.linear`)."""

from tlt_lightning.kernels.attention import HEAD_DIMS, available, decode_attention, loaded
from tlt_lightning.kernels.linear import FEW_ROWS, few_rows_linear

__all__ = ["FEW_ROWS", "HEAD_DIMS", "available", "decode_attention", "few_rows_linear", "loaded"]
