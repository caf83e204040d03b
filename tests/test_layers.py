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


def test_figures_need_no_pyplot(tmp_path):
    import sys

    from tlt_lightning.reports import new_figure, save_figure

    fig, ax = new_figure()
    ax.plot([0, 1], [1, 0])
    out = save_figure(fig, tmp_path / "sub" / "plot.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "matplotlib.pyplot" not in sys.modules or sys.modules["matplotlib.pyplot"].get_fignums() == []
