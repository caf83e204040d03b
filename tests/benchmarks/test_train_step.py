"""``python -m benchmarks.train_step``: one optimizer step's gradient, micro-batched three ways."""

from __future__ import annotations

import json

import pytest
import yaml

from benchmarks import train_step
from tests.benchmarks.test_e2e_config import tiny_config


def test_each_micro_batching_computes_the_same_gradient_in_fewer_padded_tokens(tmp_path, capsys):
    config = tiny_config()
    config["model"]["optim"]["micro_batch_size"] = 2
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    lengths = ["12", "1", "3", "16", "2", "9", "16", "4"]  # two groups, in rollout order
    argv = [
        "--config",
        str(path),
        "--lengths",
        *lengths,
        "--budgets",
        "24",
        "--rounds",
        "2",
        "--precision",
        "32-true",
    ]
    payload = train_step.main([*argv, "--json", str(tmp_path / "t.json")])
    variants = payload["variants"]
    assert list(variants) == ["rows", "rows, head on tokens", "tokens 24"]
    assert all(len(v["cpu_s"]) == 2 and v["median_cpu_s"] > 0 for v in variants.values())
    assert all(v["grad_diff"] < 1e-5 for v in variants.values())  # the same gradient
    # sequences of 4 prompt tokens + lengths: pairs in order pad to 2 * (16 + 20 + 13 + 20) = 138;
    # longest first, at most 24 tokens and 2 rows: (20), (20), (16), (13), (8, 7), (6, 5) = 97
    assert variants["rows"]["padded_tokens"] == 138 and variants["rows"]["micro_batches"] == 4
    assert variants["tokens 24"]["padded_tokens"] == 20 + 20 + 16 + 13 + 2 * 8 + 2 * 6
    assert json.loads((tmp_path / "t.json").read_text())["lengths"] == [int(n) for n in lengths]
    assert "[train_step] tokens 24:" in capsys.readouterr().out


def test_lengths_must_be_whole_groups(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    with pytest.raises(SystemExit):
        train_step.main(["--config", str(path), "--lengths", "3", "4", "5"])
    assert "multiple of group_size = 4" in capsys.readouterr().err
