"""``python -m benchmarks memory``: a fit's tensors by owner and its peak memory by phase."""

from __future__ import annotations

import argparse
import json
import time

import pytest
import yaml

from benchmarks.memory import MemoryProbe, run
from tests.benchmarks.test_e2e_config import tiny_config
from tlt_lightning.efficiency.host_memory import rss_mb


def test_the_probe_keeps_each_phases_peak_and_starts_over_when_taken():
    probe = MemoryProbe(interval=0.001)
    try:
        probe.before_rollout()
        time.sleep(0.05)
        probe.after_rollout(None)
        time.sleep(0.05)
        peaks = probe.take()
        assert {"rollout", "train"} <= set(peaks) and 0 < peaks["train"] <= rss_mb() + 1
        time.sleep(0.05)
        assert set(probe.take()) == {"train"}  # only what was sampled since the last take
    finally:
        probe.close()


def test_a_tiny_fit_is_broken_down_by_owner_and_phase(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    args = argparse.Namespace(
        config=str(path), steps=2, devices=None, threads=1, out=str(tmp_path / "out"),
        json=str(tmp_path / "memory.json"),
    )  # fmt: skip
    payload = run(args)
    (rank,) = payload["ranks"].values()
    assert rank["peak_rss_mb"] >= max(rank["phase_peak_mb"].values()) > 0
    assert {"setup", "rollout", "train"} <= set(rank["phase_peak_mb"])
    assert rank["tensors_mb"]["policy"] > 0 and rank["tensors_mb"]["drafter"] > 0
    assert 0 < len(rank["other_largest"]) <= 8  # "[shape] dtype MiB", largest first
    sizes = [float(entry.rsplit(" ", 1)[1]) for entry in rank["other_largest"]]
    assert sizes == sorted(sizes, reverse=True)
    assert sum(sizes) <= rank["tensors_mb"]["other"] + 0.1 * len(sizes)  # each rounded to 0.1
    if rank["resident_mb"]:  # Linux: the anonymous memory holds every tensor
        assert rank["resident_mb"]["anonymous"] >= sum(rank["tensors_mb"].values()) - 1
        assert rank["resident_mb"]["anonymous"] + rank["resident_mb"]["file"] <= rank["peak_rss_mb"] + 1
    assert json.loads((tmp_path / "memory.json").read_text())["ranks"]["0"] == rank
    times = payload["times"]  # medians of step 2 alone here
    assert 0 < times["rollout_s"] <= times["step_s"] and 0 < times["train_s"] <= times["step_s"]
    assert times["rollout_tokens_per_s"] > 0
    out = capsys.readouterr().out
    assert "peak RSS by phase" in out and "resident after the last step" in out


def test_a_drafter_path_relative_to_the_config_file_reaches_the_fit_absolute(tmp_path, monkeypatch):
    import benchmarks.e2e_config

    (tmp_path / "drafters" / "a").mkdir(parents=True)
    (tmp_path / "configs").mkdir()
    config = tiny_config()
    config["trainer"]["callbacks"][0]["init_args"] = {"config": {"drafter_path": "../drafters/a"}}
    path = tmp_path / "configs" / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    seen = []

    def fit_config(config, name, args):
        seen.append(config)
        raise RuntimeError("stop here")

    monkeypatch.setattr(benchmarks.e2e_config, "fit_config", fit_config)
    args = argparse.Namespace(config=str(path), steps=1, devices=None, threads=1, out=str(tmp_path / "out"))
    with pytest.raises(RuntimeError, match="stop here"):
        run(args)
    spot = seen[0]["trainer"]["callbacks"][0]["init_args"]["config"]
    assert spot["drafter_path"] == str((tmp_path / "drafters" / "a").resolve())
