"""Spot training of the drafter, without Lightning: the drafter trained on idle rollout time.

:class:`SpotDrafter` composes the pieces behind a few verbs: the online trainer (:class:`SpotTrainer`),
the rollout buffer (:class:`RolloutBuffer`), the versioned publisher the rollouts draft from
(:class:`DrafterPublisher`), the asynchronous checkpoint writer (:class:`AsyncCheckpointer`) and the
worker coordinator (:class:`WorkerCoordinator`: BUSY / IDLE / TRAINING); :mod:`~tlt_lightning.spot.report`
turns what it measured into step metrics and the workers' timeline.
"""

from tlt_lightning.spot.buffer import BufferConfig, DrafterSample, RolloutBuffer
from tlt_lightning.spot.checkpoint import AsyncCheckpointer
from tlt_lightning.spot.checkpoint_io import CheckpointInfo
from tlt_lightning.spot.config import SpotConfig
from tlt_lightning.spot.coordinator import CoordinatorConfig, Segment, WorkerCoordinator, WorkerState
from tlt_lightning.spot.publish import DrafterLease, DrafterPublisher
from tlt_lightning.spot.report import idle_fraction_recovered, plot_timeline, step_metrics, timeline_view
from tlt_lightning.spot.session import STEP_STATS, SpotDrafter, initial_drafter
from tlt_lightning.spot.trainer import SpotTrainer, SpotTrainerConfig

__all__ = [
    "STEP_STATS",
    "AsyncCheckpointer",
    "BufferConfig",
    "CheckpointInfo",
    "CoordinatorConfig",
    "DrafterLease",
    "DrafterPublisher",
    "DrafterSample",
    "RolloutBuffer",
    "Segment",
    "SpotConfig",
    "SpotDrafter",
    "SpotTrainer",
    "SpotTrainerConfig",
    "WorkerCoordinator",
    "WorkerState",
    "idle_fraction_recovered",
    "initial_drafter",
    "plot_timeline",
    "step_metrics",
    "timeline_view",
]
