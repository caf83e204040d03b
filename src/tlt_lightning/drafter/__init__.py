"""EAGLE-style drafter: config, model, losses, training on rollouts (offline and spot), checkpoint I/O,
EAGLE export (no Lightning)."""

from tlt_lightning.drafter.buffer import BufferConfig, DrafterSample, RolloutBuffer
from tlt_lightning.drafter.checkpoint import (
    AsyncCheckpointer,
    CheckpointInfo,
    snapshot_state,
)
from tlt_lightning.drafter.config import DRAFTER_KINDS, SUPPORTED_MODEL_TYPES, DrafterConfig
from tlt_lightning.drafter.eagle_format import EXPORT_MODEL_TYPES
from tlt_lightning.drafter.export import (
    eagle_state_dict,
    export_drafter,
    export_drafter_model,
    import_drafter,
)
from tlt_lightning.drafter.features import target_features
from tlt_lightning.drafter.io import load_drafter, read_drafter_config, save_drafter
from tlt_lightning.drafter.losses import (
    DrafterLoss,
    LossOutput,
    acceptance_rate,
    draft_vocab_mass,
    feature_loss,
    soft_ce,
    top1_agreement,
)
from tlt_lightning.drafter.mlflow_uri import download_drafter, is_mlflow_uri
from tlt_lightning.drafter.model import AttentionCache, Drafter
from tlt_lightning.drafter.packing import fill_ratio, pack_batches, pack_bins
from tlt_lightning.drafter.publish import DrafterLease, DrafterPublisher
from tlt_lightning.drafter.spot_trainer import PaidTraining, SpotTrainer, SpotTrainerConfig
from tlt_lightning.drafter.train import (
    ConcatCache,
    DrafterBatch,
    LazyBatches,
    drafter_losses,
    drafter_train_step,
    evaluate_drafter,
    make_batches,
    unroll_mask,
    warmup_drafter,
)

__all__ = [
    "DRAFTER_KINDS",
    "EXPORT_MODEL_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "AsyncCheckpointer",
    "AttentionCache",
    "BufferConfig",
    "CheckpointInfo",
    "ConcatCache",
    "Drafter",
    "DrafterBatch",
    "DrafterConfig",
    "DrafterLease",
    "DrafterLoss",
    "DrafterPublisher",
    "DrafterSample",
    "LazyBatches",
    "LossOutput",
    "PaidTraining",
    "RolloutBuffer",
    "SpotTrainer",
    "SpotTrainerConfig",
    "acceptance_rate",
    "download_drafter",
    "draft_vocab_mass",
    "drafter_losses",
    "drafter_train_step",
    "eagle_state_dict",
    "evaluate_drafter",
    "export_drafter",
    "export_drafter_model",
    "feature_loss",
    "fill_ratio",
    "import_drafter",
    "is_mlflow_uri",
    "load_drafter",
    "make_batches",
    "pack_batches",
    "pack_bins",
    "read_drafter_config",
    "save_drafter",
    "snapshot_state",
    "soft_ce",
    "target_features",
    "top1_agreement",
    "unroll_mask",
    "warmup_drafter",
]
