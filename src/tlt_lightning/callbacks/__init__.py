"""Lightning glue: thin callbacks over the drafter, scheduling and tracking objects, and fit's progress
bar."""

from tlt_lightning.callbacks.bandit import BanditCallback
from tlt_lightning.callbacks.certify import CertifyCallback
from tlt_lightning.callbacks.drift import DrafterDriftProbe
from tlt_lightning.callbacks.progress import GRPOProgressBar
from tlt_lightning.callbacks.signals import CheckpointOnSignal
from tlt_lightning.callbacks.spot_drafter import SpotDrafterCallback

__all__ = [
    "BanditCallback",
    "CertifyCallback",
    "CheckpointOnSignal",
    "DrafterDriftProbe",
    "GRPOProgressBar",
    "SpotDrafterCallback",
]
