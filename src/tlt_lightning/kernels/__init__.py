"""C++ kernels for CPU decoding, built on first use with the machine's compiler (:mod:`.attention`)."""

from tlt_lightning.kernels.attention import HEAD_DIMS, available, decode_attention

__all__ = ["HEAD_DIMS", "available", "decode_attention"]
