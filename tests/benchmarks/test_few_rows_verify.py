"""``python -m benchmarks.few_rows_verify``: batch-1 rollouts with the one-row verifies on the C++ kernel or
oneDNN."""

from __future__ import annotations

import json

import pytest
import yaml

from benchmarks import few_rows_verify
from tests.benchmarks.test_e2e_config import tiny_config


def test_plain_and_each_arm_are_rated_per_round_for_each_product(tmp_path, capsys):
    config = tiny_config()
    config["model"]["rollout_decode"] = "compiled"  # the oneDNN variant is a second compiled target
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = ["--config", str(path), "--arms", "chain2", "--prompts", "2", "--rounds", "2"]
    payload = few_rows_verify.main([*argv, "--max-new-tokens", "8", "--json", str(tmp_path / "f.json")])
    rates = payload["tokens_per_cpu_s"]
    assert set(rates) == {"kernel off", "kernel chain2", "onednn off", "onednn chain2"}
    assert all(len(v) == 2 and all(r > 0 for r in v) for v in rates.values())
    assert set(payload["speculative_vs_plain"]) == {"kernel chain2", "onednn chain2"}
    assert (
        json.loads((tmp_path / "f.json").read_text())["median_tokens_per_cpu_s"]
        == payload["median_tokens_per_cpu_s"]
    )
    assert "[few_rows_verify] kernel chain2:" in capsys.readouterr().out


def test_bad_counts_are_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        few_rows_verify.main(["--config", "x.yaml", "--rounds", "0"])
    assert "--rounds must be >= 1" in capsys.readouterr().err
