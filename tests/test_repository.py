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
    files = [p for r in roots for p in ([r] if r.is_file() else r.rglob("*"))
             if p.is_file() and p.suffix in {".md", ".json", ".yaml", ".yml", ".sh", ".py", ".txt"}]
    assert len(files) > 50  # the walk found the docs and results
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files
             for m in MACHINE_PATH.finditer(p.read_text(errors="replace"))]
    assert found == [], "machine paths in published files (write them relative to the repository):\n" + "\n".join(found)
