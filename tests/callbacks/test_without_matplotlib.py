"""A fit without matplotlib (no ``plots`` extra): the callbacks warn once, skip their pictures, finish."""

from __future__ import annotations

import json
import sys
import warnings

import pytest

from tests.rl.test_module import make_module, make_trainer
from tlt_lightning import reports
from tlt_lightning.callbacks import BanditCallback, DrafterDriftProbe, SpotDrafterCallback
from tlt_lightning.speculative import DraftSpec


def test_a_fit_without_matplotlib_skips_the_pictures_with_one_warning(tmp_path, monkeypatch):
    module = make_module(max_new_tokens=10)  # first: its task imports reasoning-gym, which needs matplotlib
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails, as without the extra
    reports.warn_no_matplotlib.cache_clear()
    spot, bandit = SpotDrafterCallback({"training": {"max_steps_per_rollout": 2}}), BanditCallback()
    probe = DrafterDriftProbe(num_prompts=2, max_new_tokens=6, arm=DraftSpec(2))
    trainer = make_trainer(2, callbacks=[spot, bandit, probe], default_root_dir=tmp_path)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module)
    finally:
        reports.warn_no_matplotlib.cache_clear()
    assert trainer.global_step == 2
    skipped = [w for w in caught if "matplotlib is not installed" in str(w.message)]
    assert len(skipped) == 1 and "pip install 'tlt-lightning[plots]'" in str(skipped[0].message)
    run = tmp_path / "version_0"
    assert not list(run.rglob("*.png"))  # no timeline, accept-length, heat-map or drift picture
    assert json.loads((run / "drafter" / "summary.json").read_text())["idle_fraction_recovered"] is not None
    assert "best_arms" in json.loads((run / "bandit" / "best_arms.json").read_text())
    assert json.loads((run / "drift" / "drift.json").read_text())["history"]


@pytest.mark.parametrize("blocked", [False, True])
def test_the_pictures_are_drawn_with_matplotlib_only(tmp_path, monkeypatch, blocked):
    """The same callback code with matplotlib: its pictures, and no warning."""
    module = make_module(max_new_tokens=10)
    if blocked:
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    reports.warn_no_matplotlib.cache_clear()
    spot = SpotDrafterCallback({"training": {"max_steps_per_rollout": 2}})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make_trainer(1, callbacks=[spot], default_root_dir=tmp_path).fit(module)
    finally:
        reports.warn_no_matplotlib.cache_clear()
    pictures = sorted(p.name for p in (tmp_path / "version_0").rglob("*.png"))
    warned = any("matplotlib is not installed" in str(w.message) for w in caught)
    drawn = ["accept_length.png", "epoch-000.png", "fit.png"]
    assert (pictures, warned) == (([], True) if blocked else (drawn, False))
