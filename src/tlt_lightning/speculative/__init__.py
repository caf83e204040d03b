"""Pure speculative-decoding math: sampling distributions, lossless draft verification, strategies."""

from tlt_lightning.speculative.arms import Arm, DraftSpec, DraftStrategy, arm_key, as_strategy, parse_arm
from tlt_lightning.speculative.sampling import SamplingParams, sample, sampling_probs
from tlt_lightning.speculative.verify import VerifyResult, verify_chain, verify_tree

__all__ = [
    "Arm",
    "DraftSpec",
    "DraftStrategy",
    "SamplingParams",
    "VerifyResult",
    "arm_key",
    "as_strategy",
    "parse_arm",
    "sample",
    "sampling_probs",
    "verify_chain",
    "verify_tree",
]
