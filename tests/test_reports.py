"""Run reports without matplotlib (the ``plots`` extra): figures name it, drawing along the way warns once."""

from __future__ import annotations

import sys
import warnings

import pytest

from tlt_lightning import reports
from tlt_lightning.reports import draw_or_skip, new_figure, require_matplotlib
from tlt_lightning.scheduling import BEGMABStrategy
from tlt_lightning.spot import Segment, WorkerState, plot_timeline
from tlt_lightning.tracking import plot_accept_lengths  # before the block: torchmetrics imports matplotlib

INSTALL = r"pip install 'tlt-lightning\[plots\]'"


@pytest.fixture
def no_matplotlib(monkeypatch):
    """``import matplotlib`` fails, as without the plots extra; the one-time warning is reset."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    reports.warn_no_matplotlib.cache_clear()
    yield
    reports.warn_no_matplotlib.cache_clear()


def test_figures_name_the_plots_extra(no_matplotlib, tmp_path):
    with pytest.raises(ImportError, match=INSTALL):
        require_matplotlib()
    with pytest.raises(ImportError, match=f"figures need matplotlib .*{INSTALL}"):
        new_figure()
    with pytest.raises(ImportError, match=INSTALL):
        plot_accept_lengths([1], [2.0], [0, 3], tmp_path / "a.png")
    with pytest.raises(ImportError, match=INSTALL):
        plot_timeline([Segment(worker=0, state=WorkerState.BUSY, start=0.0, end=1.0)], tmp_path / "t.png")
    with pytest.raises(ImportError, match=INSTALL):
        BEGMABStrategy().plot_heatmap(tmp_path / "h.png")
    assert not list(tmp_path.iterdir())


def test_draw_or_skip_warns_once_and_skips(no_matplotlib, tmp_path):
    drawn = []
    with pytest.warns(UserWarning, match=f"matplotlib is not installed: pictures .* are skipped; {INSTALL}"):
        assert draw_or_skip(drawn.append, tmp_path / "a.png") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert draw_or_skip(drawn.append, tmp_path / "b.png") is None  # no second warning
    assert drawn == []


def test_draw_or_skip_draws_with_matplotlib(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig, ax = new_figure()
        ax.plot([0, 1], [1, 0])
        path = draw_or_skip(reports.save_figure, fig, tmp_path / "plot.png")
    assert path == tmp_path / "plot.png" and path.read_bytes()[:4] == b"\x89PNG"
