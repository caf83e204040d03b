"""Tracking: torchmetrics metrics over rollouts, and the drafter in MLflow's model registry.

MLflow itself is imported only when a registry function runs: this package imports without it.
"""

from tlt_lightning.tracking.metrics import AcceptanceRate, MeanAcceptLength, RolloutTokensPerSecond
from tlt_lightning.tracking.mlflow_drafter import (
    drafter_model_name,
    load_drafter_from_mlflow,
    log_drafter_version,
)

__all__ = [
    "AcceptanceRate",
    "MeanAcceptLength",
    "RolloutTokensPerSecond",
    "drafter_model_name",
    "load_drafter_from_mlflow",
    "log_drafter_version",
]
