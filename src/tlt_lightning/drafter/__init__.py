"""EAGLE-style drafter: config, model, losses, training on rollouts (offline warm-up and the step
:mod:`tlt_lightning.spot` trains online with), checkpoint I/O, EAGLE export (no Lightning)."""

from tlt_lightning.drafter.batches import make_batches
from tlt_lightning.drafter.config import DRAFTER_KINDS, DrafterConfig
from tlt_lightning.drafter.export import export_drafter, export_drafter_model, import_drafter
from tlt_lightning.drafter.features import target_features
from tlt_lightning.drafter.io import load_drafter, read_drafter_config, save_drafter
from tlt_lightning.drafter.losses import DrafterLoss
from tlt_lightning.drafter.mlflow_uri import download_drafter
from tlt_lightning.drafter.model import Drafter
from tlt_lightning.drafter.packing import pack_batches
from tlt_lightning.drafter.train import drafter_train_step, evaluate_drafter, warmup_drafter

__all__ = [
    "DRAFTER_KINDS",
    "Drafter",
    "DrafterConfig",
    "DrafterLoss",
    "download_drafter",
    "drafter_train_step",
    "evaluate_drafter",
    "export_drafter",
    "export_drafter_model",
    "import_drafter",
    "load_drafter",
    "make_batches",
    "pack_batches",
    "read_drafter_config",
    "save_drafter",
    "target_features",
    "warmup_drafter",
]
