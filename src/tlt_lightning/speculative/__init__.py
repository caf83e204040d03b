"""Pure speculative-decoding math: sampling distributions, lossless draft verification, strategies."""

from tlt_lightning.speculative.arms import Arm, DraftSpec, DraftStrategy, arm_key, as_strategy, parse_arm
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
    "Arm",
    "DraftSpec",
    "DraftStrategy",
    "SamplingParams",
    "SiblingRule",
    "VerifyResult",
    "arm_key",
    "as_strategy",
    "parse_arm",
    "sample",
    "sampling_probs",
    "tree_attention_mask",
    "tree_depths",
    "verify_chain",
    "verify_tree",
]
