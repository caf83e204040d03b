"""Every docstring example in the package runs, and shows what it says."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import tlt_lightning

ROOT = Path(tlt_lightning.__file__).parent


def module_names() -> list[str]:
    names = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.mark.parametrize("name", module_names())
def test_docstring_examples(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # an example that writes files writes them here
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:  # an optional extra this environment lacks
        if err.name and err.name.split(".")[0] == "tlt_lightning":
            raise
        pytest.skip(f"needs {err.name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, capsys.readouterr().out


def test_a_wrong_example_fails(tmp_path):
    """The check above can fail: a module whose example shows the wrong output."""
    import types

    module = types.ModuleType("wrong", "Example:\n    >>> 1 + 1\n    3\n")
    assert doctest.testmod(module, report=False).failed == 1
