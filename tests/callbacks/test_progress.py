"""GRPOProgressBar: the step's values, and "off" for an accept length that no speculation gave."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from tlt_lightning.callbacks import GRPOProgressBar


def test_accept_length_shows_off_when_no_speculative_step_ran():
    bar = GRPOProgressBar()
    metrics = {"reward/mean": torch.tensor(0.5), "rollout/accept_length": torch.tensor(math.nan)}
    shown = bar.get_metrics(SimpleNamespace(callback_metrics=metrics), None)
    assert shown == {"reward": "0.500", "accept": "off"}
    metrics["rollout/accept_length"] = torch.tensor(2.25)
    assert bar.get_metrics(SimpleNamespace(callback_metrics=metrics), None)["accept"] == "2.25"
