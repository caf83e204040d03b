"""``python -m benchmarks.optimizer_step``: one step of each optimizer, timed side by side."""

import json

import pytest

from benchmarks import optimizer_step


def test_times_every_optimizer_and_writes_what_it_measured(tmp_path, capsys):
    out = tmp_path / "o.json"
    payload = optimizer_step.main(["--model", "tiny-llama", "--steps", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == payload
    names = set(payload["median_step_s"])
    assert {"adamw fused, float32", "AdamWBF16 reference, bfloat16"} <= names
    assert all(len(payload["step_s"][name]) == 2 and payload["median_step_s"][name] > 0 for name in names)
    assert names == set(payload["first_step_s"])
    assert "[optimizer_step] adamw fused, float32:" in capsys.readouterr().out


def test_refuses_no_steps():
    with pytest.raises(SystemExit):
        optimizer_step.main(["--steps", "0"])
