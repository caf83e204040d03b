"""Plots of rollout statistics: steps that did not speculate are left out."""

from __future__ import annotations

import math

import pytest

from tlt_lightning import reports
from tlt_lightning.tracking import plot_accept_lengths

pytest.importorskip("matplotlib")


def test_accept_length_plot_skips_steps_that_did_not_speculate(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(reports, "save_figure", lambda fig, path: drawn.append(fig) or path)
    nan = math.nan
    plot_accept_lengths([1, 2, 3, 4], [nan, 2.5, nan, 3.0], [0, 4, 2], tmp_path / "a.png")
    (line,) = drawn[0].axes[0].get_lines()
    assert list(line.get_xdata()) == [2, 4] and list(line.get_ydata()) == [2.5, 3.0]
