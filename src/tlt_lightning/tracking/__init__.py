"""Tracking: torchmetrics metrics over rollouts (MLflow artifacts and plots join here)."""

from tlt_lightning.tracking.metrics import AcceptanceRate, MeanAcceptLength, RolloutTokensPerSecond

__all__ = ["AcceptanceRate", "MeanAcceptLength", "RolloutTokensPerSecond"]
