"""The floors of the package: the library never reaches up into its tools, nor switches matplotlib's backend."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tlt_lightning

ROOT = Path(tlt_lightning.__file__).parent
# The tools on top: benchmarks, recipes (CLI workflows), the CLI and its fit entry point.
TOOLS = ("tlt_lightning.bench", "tlt_lightning.recipes", "tlt_lightning.cli", "tlt_lightning.fit")
LIBRARY = ("speculative", "models", "reports.py", "drafter", "rollout", "scheduling", "rl", "efficiency",
           "callbacks", "tracking")


def library_modules() -> list[Path]:
    files = []
    for name in LIBRARY:
        path = ROOT / name
        files += [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
    return files


def imported(tree: ast.AST) -> set[str]:
    """Every module an AST imports, at module level or inside functions."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", library_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_library_modules_import_no_tool_and_keep_the_matplotlib_backend(path):
    tree = ast.parse(path.read_text())
    upward = sorted(m for m in imported(tree) if m.startswith(TOOLS))
    assert upward == [], f"{path.relative_to(ROOT)} imports {upward}: move what it needs below the tools"
    switches = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "matplotlib.use"]
    assert switches == [], f"{path.relative_to(ROOT)} switches matplotlib's backend at lines {switches}"


def test_the_check_sees_an_upward_import(tmp_path):
    tree = ast.parse("def f():\n    from tlt_lightning.bench.common import timed\n")
    assert imported(tree) == {"tlt_lightning.bench.common"}


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_draws_through_pyplot(path):
    """pyplot keeps every figure open in a global registry (and picks a backend): figures come from
    :func:`tlt_lightning.reports.new_figure`; only ``save_figure`` imports pyplot, to close a user's figure."""
    if path == ROOT / "reports.py":
        return
    users = sorted(m for m in imported(ast.parse(path.read_text())) if m.startswith("matplotlib.pyplot"))
    assert users == [], f"{path.relative_to(ROOT)} imports pyplot: use tlt_lightning.reports.new_figure"


def test_figures_need_no_pyplot(tmp_path):
    import matplotlib.pyplot as plt

    from tlt_lightning.reports import new_figure, save_figure

    open_before = plt.get_fignums()
    fig, ax = new_figure()
    ax.plot([0, 1], [1, 0])
    out = save_figure(fig, tmp_path / "sub" / "plot.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plt.get_fignums() == open_before  # never registered with pyplot
    grid, axes = new_figure(0, layout="constrained")  # no axes: the caller lays out its grid
    assert axes is None and grid.get_layout_engine() is not None
    grid.add_subplot(1, 1, 1).plot([0, 1])
    assert save_figure(grid, tmp_path / "grid.png").exists()

    mine = plt.figure()  # a user's pyplot figure is closed once saved
    save_figure(mine, tmp_path / "mine.png")
    assert mine.number not in plt.get_fignums()
