"""EAGLE-style drafter: config, model, losses, training on rollouts, checkpoint I/O (no Lightning)."""

from tlt_lightning.drafter.config import DRAFTER_KINDS, SUPPORTED_MODEL_TYPES, DrafterConfig
from tlt_lightning.drafter.io import load_drafter, read_drafter_config, save_drafter
from tlt_lightning.drafter.losses import DrafterLoss, LossOutput, feature_loss, soft_ce, top1_agreement
from tlt_lightning.drafter.model import AttentionCache, Drafter
from tlt_lightning.drafter.train import (
    ConcatCache,
    DrafterBatch,
    drafter_losses,
    drafter_train_step,
    evaluate_drafter,
    make_batches,
    unroll_mask,
    warmup_drafter,
)

__all__ = [
    "DRAFTER_KINDS",
    "SUPPORTED_MODEL_TYPES",
    "AttentionCache",
    "ConcatCache",
    "Drafter",
    "DrafterBatch",
    "DrafterConfig",
    "DrafterLoss",
    "LossOutput",
    "drafter_losses",
    "drafter_train_step",
    "evaluate_drafter",
    "feature_loss",
    "load_drafter",
    "make_batches",
    "read_drafter_config",
    "save_drafter",
    "soft_ce",
    "top1_agreement",
    "unroll_mask",
    "warmup_drafter",
]
