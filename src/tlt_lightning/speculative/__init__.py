"""Pure speculative-decoding math: sampling distributions and lossless draft verification."""

from tlt_lightning.speculative.sampling import SamplingParams, sample, sampling_probs
from tlt_lightning.speculative.verify import (
    SiblingRule,
    VerifyResult,
    tree_attention_mask,
    tree_depths,
    verify_chain,
    verify_tree,
)

__all__ = [
    "SamplingParams",
    "SiblingRule",
    "VerifyResult",
    "sample",
    "sampling_probs",
    "tree_attention_mask",
    "tree_depths",
    "verify_chain",
    "verify_tree",
]
