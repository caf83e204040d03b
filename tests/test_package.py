"""The top-level package: the design card's classes importable from it, without a heavy import."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tlt_lightning
from tlt_lightning.callbacks import SpotDrafterCallback
from tlt_lightning.rl import GRPOModule
from tlt_lightning.rollout import SpeculativeRolloutLoop
from tlt_lightning.scheduling import BEGMABStrategy


def test_headline_classes_are_the_subpackages_own():
    assert tlt_lightning.SpotDrafterCallback is SpotDrafterCallback
    assert tlt_lightning.SpeculativeRolloutLoop is SpeculativeRolloutLoop
    assert tlt_lightning.BEGMABStrategy is BEGMABStrategy
    assert tlt_lightning.GRPOModule is GRPOModule
    assert set(tlt_lightning.__all__) <= set(dir(tlt_lightning))
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        tlt_lightning.Nope  # noqa: B018


def test_importing_the_package_imports_nothing_heavy():
    code = ("import sys, tlt_lightning; heavy = [m for m in ('torch', 'lightning', 'transformers') if m in sys.modules];"
            " print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_version_is_pyproject_s():
    """``__version__`` comes from the installed metadata: the one pyproject.toml declares."""
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert tlt_lightning.__version__ == pyproject["project"]["version"]
