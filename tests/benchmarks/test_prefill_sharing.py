"""``python -m benchmarks.prefill_sharing``: a GRPO rollout's prefill shared between a group's copies and per
request, side by side."""

from __future__ import annotations

import json

import pytest
import yaml

from benchmarks import prefill_sharing
from tests.benchmarks.test_e2e_config import tiny_config


def test_both_prefills_are_timed_round_by_round_and_compared(tmp_path, monkeypatch, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    calls = []
    real = prefill_sharing.RolloutEngine._prefill

    def prefill(self, ids, batch, generator):
        calls.append(len(prefill_sharing.engine_module._distinct(ids)[0]))
        return real(self, ids, batch, generator)

    monkeypatch.setattr(prefill_sharing.RolloutEngine, "_prefill", prefill)
    argv = ["--config", str(path), "--prompts", "3", "--group-size", "4", "--rounds", "3"]
    payload = prefill_sharing.main([*argv, "--json", str(tmp_path / "p.json")])
    assert payload["requests"] == 12 and len(payload["seconds"]["shared"]) == 3
    assert all(s > 0 for times in payload["seconds"].values() for s in times) and payload["speedup"] > 0
    assert sorted(calls) == [3, 3, 3, 12, 12, 12]  # shared: 3 distinct prompts; per request: all 12
    assert json.loads((tmp_path / "p.json").read_text())["median_seconds"] == payload["median_seconds"]
    assert "prefill of 12 requests (3 prompts x 4)" in capsys.readouterr().out


def test_bad_counts_are_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        prefill_sharing.main(["--config", "x.yaml", "--group-size", "0"])
    assert "--group-size must be >= 1" in capsys.readouterr().err
