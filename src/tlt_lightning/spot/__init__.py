"""The spot drafter without Lightning: a drafter trained on idle rollout time, its buffer,
publisher, checkpoints and worker coordination behind a few verbs (:class:`SpotDrafter`)."""

from tlt_lightning.spot.config import SpotConfig
from tlt_lightning.spot.report import step_metrics, timeline_view
from tlt_lightning.spot.session import STEP_STATS, SpotDrafter, initial_drafter

__all__ = ["STEP_STATS", "SpotConfig", "SpotDrafter", "initial_drafter", "step_metrics", "timeline_view"]
