"""What the repository publishes: no machine paths in docs, results, configs or scripts."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Absolute paths of a particular machine (a home, a scratch checkout, a temporary folder).
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|root|home|Users|tmp/tmp)\w*/")


def test_published_files_hold_no_machine_paths():
    folders = ("docs", "configs", "examples", "scripts", "benchmarks")
    roots = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / d for d in folders)]
    files = [
        p
        for r in roots
        for p in ([r] if r.is_file() else r.rglob("*"))
        if p.is_file() and p.suffix in {".md", ".json", ".yaml", ".yml", ".sh", ".py", ".txt"}
    ]
    assert len(files) > 50  # the walk found the docs and results
    found = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in files
        for m in MACHINE_PATH.finditer(p.read_text(errors="replace"))
    ]
    assert found == [], (
        "machine paths in published files (write them relative to the repository):\n" + "\n".join(found)
    )


def docs_text() -> str:
    """README.md and docs/*.md, where results and figures are referenced."""
    return "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def test_every_result_and_figure_is_referenced_from_the_docs():
    """docs/results and docs/img hold only what the docs show (superseded runs live in git history)."""
    text = docs_text()
    files = [p for d in ("results", "img") for p in sorted((ROOT / "docs" / d).iterdir()) if p.is_file()]
    assert len(files) > 10  # the walk found them
    unreferenced = [str(p.relative_to(ROOT)) for p in files if p.name not in text]
    message = "not referenced from README.md or docs/*.md (git rm them):\n"
    assert unreferenced == [], message + "\n".join(unreferenced)


def test_every_referenced_result_and_figure_exists():
    linked = set(re.findall(r"\b(?:docs/)?((?:results|img)/[\w.\-]+\.(?:json|png))", docs_text()))
    assert linked  # the pattern matches the docs' links
    missing = sorted(name for name in linked if not (ROOT / "docs" / name).is_file())
    assert missing == [], f"docs link to files that are not in docs/: {missing}"


def test_the_readme_and_the_benchmarks_page_stay_short():
    """A newcomer reads the README in minutes; benchmarks.md keeps the latest run of each benchmark."""
    for path, limit in (("README.md", 150), ("docs/benchmarks.md", 600)):
        lines = len((ROOT / path).read_text().splitlines())
        assert lines <= limit, f"{path} has {lines} lines (at most {limit}): older runs live in git history"
