"""The floors of the package: the library never reaches up into its tools nor into a checkout's
benchmarks, nor switches matplotlib's backend."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tlt_lightning

ROOT = Path(tlt_lightning.__file__).parent
# The floors of the package, bottom first (docs/architecture.md): a module imports from its own floor
# and the ones below, never from above. The top floor holds the tools: recipes (CLI workflows), the CLI
# and its fit entry point. The benchmarks live outside the package (a checkout's benchmarks/).
FLOORS = (
    ("validation", "safe_load"),
    ("speculative", "kernels"),
    ("models", "reports"),
    ("rollout",),
    ("drafter", "scheduling"),
    ("vllm", "tracking", "spot", "certify"),
    ("rl",),
    ("efficiency", "callbacks", "resume"),
    ("recipes", "cli", "cli_options", "fit"),
)
FLOOR = {name: level for level, names in enumerate(FLOORS) for name in names}


def modules() -> list[Path]:
    """Every module of the package but its root ``__init__`` (the lazy top-level exports)."""
    return [p for p in sorted(ROOT.rglob("*.py")) if p != ROOT / "__init__.py"]


def floor_of(path: Path) -> int:
    top = path.relative_to(ROOT).parts[0].removesuffix(".py")
    assert top in FLOOR, f"{top} is on no floor: add it to FLOORS (and docs/architecture.md)"
    return FLOOR[top]


def imported(tree: ast.AST) -> set[str]:
    """Every module an AST imports, at module level or inside functions."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def benchmark_imports(tree: ast.AST) -> list[str]:
    """The modules of a checkout's ``benchmarks/`` an AST imports."""
    return sorted(m for m in imported(tree) if m.split(".")[0] == "benchmarks")


def upward_imports(path: Path, tree: ast.AST) -> list[str]:
    own = floor_of(path)
    ours = (m.split(".")[1] for m in imported(tree) if m.startswith("tlt_lightning."))
    return sorted({m for m in ours if FLOOR[m] > own})


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_import_only_their_floor_and_below(path):
    tree = ast.parse(path.read_text())
    upward = upward_imports(path, tree)
    assert upward == [], (
        f"{path.relative_to(ROOT)} imports {upward} from a higher floor: move what it needs down"
    )
    switches = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "matplotlib.use"
    ]
    assert switches == [], f"{path.relative_to(ROOT)} switches matplotlib's backend at lines {switches}"


def test_the_check_sees_an_upward_import():
    tree = ast.parse("import torch\ndef f():\n    from tlt_lightning.recipes.drafter_warmup import run\n")
    assert imported(tree) == {"torch", "tlt_lightning.recipes.drafter_warmup"}
    assert upward_imports(ROOT / "drafter" / "model.py", tree) == ["recipes"]
    assert upward_imports(ROOT / "cli.py", tree) == []


def test_nothing_in_src_imports_the_benchmarks():
    """``benchmarks/`` sits beside ``src/`` in a checkout, not in the wheel: the library runs without it."""
    src = ROOT.parent
    users = {str(p.relative_to(src)): benchmark_imports(ast.parse(p.read_text())) for p in src.rglob("*.py")}
    assert len(users) > 100  # the walk found the package
    found = {path: names for path, names in users.items() if names}
    assert found == {}, f"src/ imports the benchmarks (which use the library, not the other way): {found}"


def test_the_benchmark_check_sees_an_import():
    tree = ast.parse("def f():\n    from benchmarks.common import timed\n    import benchmarks\n")
    assert benchmark_imports(tree) == ["benchmarks", "benchmarks.common"]


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_draws_through_pyplot(path):
    """pyplot keeps every figure open in a global registry (and picks a backend): figures come from
    :func:`tlt_lightning.reports.new_figure`; only ``save_figure`` imports pyplot, to close a user's
    figure."""
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
