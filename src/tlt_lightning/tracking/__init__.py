"""Tracking: torchmetrics metrics over rollouts, plots, MLflow artifacts through Lightning's
``MLFlowLogger``, the drafter in MLflow's model registry (each version an MLflow model with a
``python_function`` flavour), each run's own output directory, and the logger factory of
``tlt-lightning fit`` (:func:`tracking_logger`: MLflow in a local sqlite store, or CSV without MLflow).

MLflow itself is imported only when a registry function runs: this package imports without it.
"""

from tlt_lightning.tracking.lightning_mlflow import CheckpointRegistrar, log_artifact, mlflow_loggers
from tlt_lightning.tracking.logger import mlflow_available, tracking_logger
from tlt_lightning.tracking.metrics import AcceptanceRate, MeanAcceptLength, RolloutTokensPerSecond
from tlt_lightning.tracking.mlflow_drafter import (
    drafter_model_name,
    load_drafter_from_mlflow,
    log_drafter_version,
)
from tlt_lightning.tracking.mlflow_resume import MLflowRunCheckpoint, ResumableMLFlowLogger
from tlt_lightning.tracking.mlflow_store import TrackingStoreError
from tlt_lightning.tracking.plots import plot_accept_lengths
from tlt_lightning.tracking.run_directory import run_dir, save_run_config

__all__ = [
    "AcceptanceRate",
    "CheckpointRegistrar",
    "MLflowRunCheckpoint",
    "MeanAcceptLength",
    "ResumableMLFlowLogger",
    "RolloutTokensPerSecond",
    "TrackingStoreError",
    "drafter_model_name",
    "load_drafter_from_mlflow",
    "log_artifact",
    "log_drafter_version",
    "mlflow_available",
    "mlflow_loggers",
    "plot_accept_lengths",
    "run_dir",
    "save_run_config",
    "tracking_logger",
]
