"""The bandit benchmark: BEG-MAB vs UCB vs every fixed arm on the simulated environment."""

import json

import pytest

from benchmarks.__main__ import main as bench
from benchmarks.bandit import main, run_bandit_benchmark
from tlt_lightning.scheduling.bucketed import default_arms
from tlt_lightning.speculative import arm_key


def test_bandit_cli_writes_json_and_plot(tmp_path, capsys):
    path = tmp_path / "bandit.json"
    bench(["bandit", "--steps", "1500", "--json", str(path)])
    data = json.loads(path.read_text())
    assert {"begmab", "ucb", "fixed:off"} <= set(data["strategies"])
    assert 0 < data["strategies"]["begmab"]["reward_vs_oracle"] <= 1.05
    assert path.with_suffix(".png").stat().st_size > 10_000
    assert "reward / per-bucket oracle" in capsys.readouterr().out


def test_benchmark_reports_and_beats_every_fixed_arm(tmp_path):
    result = main(tmp_path / "bandit.json", tmp_path / "bandit.png", steps=2000, seed=0)
    on_disk = json.loads((tmp_path / "bandit.json").read_text())
    assert on_disk["best_fixed"] == result["best_fixed"]
    assert (tmp_path / "bandit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    strategies = on_disk["strategies"]
    assert set(strategies) == {"begmab", "begmab-decay", "ucb"} | {
        f"fixed:{arm_key(a)}" for a in default_arms()
    }
    assert strategies["begmab"]["total_reward_vs_best_fixed"] > 1.0
    assert strategies["ucb"]["total_reward_vs_best_fixed"] > 1.0
    assert set(strategies["begmab"]["steps_to_follow_change"]) == {"2-4", "5-20", "21+"}


def test_bad_benchmark():
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        run_bandit_benchmark(steps=0)
