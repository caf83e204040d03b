"""``python -m benchmarks e2e --config``: a fit config with TLT against itself without TLT."""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import pytest
import yaml

from benchmarks.e2e_config import (
    absolute_drafter_paths,
    compare,
    core_share,
    decode_buckets,
    equal_work_speedup,
    frozen_drafter,
    read_records,
    run,
    summarise,
    without_tlt,
)

ROOT = Path(__file__).resolve().parents[2]
TLT = [
    {"class_path": "tlt_lightning.callbacks.SpotDrafterCallback"},
    {"class_path": "tlt_lightning.callbacks.BanditCallback"},
    {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}},
]


def tiny_config() -> dict:
    config = yaml.safe_load((ROOT / "configs" / "grpo_tiny.yaml").read_text())
    config["trainer"].update(logger=False, callbacks=copy.deepcopy(TLT), enable_progress_bar=False)
    config["model"]["rollout_progress"] = False
    return config


def test_without_tlt_drops_the_tlt_callbacks_and_speculation_only():
    config = tiny_config()
    base = without_tlt(config)
    assert [c["class_path"] for c in base["trainer"]["callbacks"]] == [TLT[2]["class_path"]]
    assert base["model"]["speculative"] == {**config["model"]["speculative"], "enabled": False}
    assert config["trainer"]["callbacks"] == TLT  # the original is left as it was
    rest = {k: v for k, v in base["model"].items() if k != "speculative"}
    assert rest == {k: v for k, v in config["model"].items() if k != "speculative"}


def test_the_frozen_variant_drafts_with_the_spot_drafters_start_and_never_trains_it():
    config = tiny_config()
    frozen = frozen_drafter(config)
    paths = [c["class_path"] for c in frozen["trainer"]["callbacks"]]
    assert paths == [TLT[1]["class_path"], TLT[2]["class_path"]]  # the bandit stays, spot training goes
    assert (
        frozen["model"]["speculative"]["drafter_kind"] == "eagle1"
        and frozen["model"]["speculative"]["enabled"]
    )
    config["trainer"]["callbacks"] = [{**TLT[0], "init_args": {"config": {"drafter_path": "a/b"}}}, *TLT[1:]]
    assert frozen_drafter(config)["model"]["speculative"]["drafter_path"] == "a/b"
    with pytest.raises(ValueError, match="needs a config with a SpotDrafterCallback"):
        frozen_drafter(without_tlt(config))


def test_relative_drafter_paths_are_resolved_against_the_config_files_directory(tmp_path):
    (tmp_path / "drafters" / "a").mkdir(parents=True)
    config = tiny_config()
    config["model"]["speculative"]["drafter_path"] = "drafters/a"
    spot = {**TLT[0], "init_args": {"config": {"drafter_path": "drafters/a"}}}
    config["trainer"]["callbacks"] = [spot, {**TLT[1], "init_args": {"config": {"drafter_path": "missing"}}}]
    out = absolute_drafter_paths(config, tmp_path)
    resolved = str((tmp_path / "drafters" / "a").resolve())
    assert out["model"]["speculative"]["drafter_path"] == resolved
    assert out["trainer"]["callbacks"][0]["init_args"]["config"]["drafter_path"] == resolved
    # not a directory there (a URI, a typo): left as written, for fit to resolve or report
    assert out["trainer"]["callbacks"][1]["init_args"]["config"]["drafter_path"] == "missing"
    assert config["model"]["speculative"]["drafter_path"] == "drafters/a"  # the original is left as it was


def test_both_runs_of_a_tiny_config_are_recorded_per_rank_and_step(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    args = argparse.Namespace(
        config=str(path), steps=2, devices=None, threads=1, out=str(tmp_path / "out"),
        json=str(tmp_path / "e2e.json"), skip_steps=0, baseline_first=False, bracket=True,
    )  # fmt: skip
    payload = run(args)
    assert payload["order"] == ["tlt", "baseline", "baseline_again"]
    again = read_records(tmp_path / "out" / "baseline_again" / "records")[1]
    base = read_records(tmp_path / "out" / "baseline" / "records")[1]
    assert [r["lengths"] for (r,) in again] == [r["lengths"] for (r,) in base]  # the same work again
    assert (
        payload["drift"]
        == payload["runs"]["baseline_again"]["step_s"] / payload["runs"]["baseline"]["step_s"]
    )
    assert math.isfinite(payload["speedup"]) and payload["speedup"] > 0
    for name in ("tlt", "baseline"):
        starts, steps = read_records(tmp_path / "out" / name / "records")
        assert list(starts) == [0] and [[r["step"] for r in ranks] for ranks in steps] == [[1], [2]]
        for (record,) in steps:
            assert record["wall_s"] >= record["rollout_s"] + record["train_s"] > 0
            assert len(record["lengths"]) == 16 and record["tokens"] == sum(record["lengths"])
            assert (
                record["forward_tokens"] > 0
            )  # zero-advantage groups are skipped: not bounded below by tokens
            assert 0 <= record["tail_share"] <= 1 and record["peak_rss_mb"] > 0
            assert record["graph_compile_s"] == 0.0  # grpo_tiny decodes eagerly: nothing compiles
            assert {"rollout", "train"} <= set(record["phase_peak_mb"])
            decoded = sum(row[3] for modes in record["decode"].values() for row in modes.values())
            assert decoded == record["tokens"] - 16  # every token but the prefill's one per request
            for n, modes in record["decode"].items():  # the same steps by arm: "off" is plain
                arms = record["decode_arms"][n]
                assert arms.get("off") == modes.get("plain")
                spec = [sum(row[i] for arm, row in arms.items() if arm != "off") for i in range(4)]
                assert spec == pytest.approx(modes.get("spec", [0, 0.0, 0.0, 0]))
        tensors = steps[0][0]["tensors"]["mb"]  # after step 1: Adam's state exists, the gradients are freed
        assert tensors["policy"] > 0 and tensors["optimizer"] > tensors["policy"] and tensors["grads"] == 0
        assert payload["runs"][name] == summarise(steps, 0)
    assert all(r["accept_length"] == 0.0 for (r,) in base)  # no speculative step without TLT
    assert all(r["drafter_s"] == 0.0 for (r,) in base)
    assert all(set(modes) == {"plain"} for (r,) in base for modes in r["decode"].values())
    assert all(set(arms) == {"off"} for (r,) in base for arms in r["decode_arms"].values())
    saved = json.loads(Path(args.json).read_text())
    assert saved["runs"]["tlt"]["step_s"] == payload["runs"]["tlt"]["step_s"] and saved["complete"] is True
    assert Path(args.json).with_suffix(".png").stat().st_size > 0


def test_decode_buckets_pool_rank_steps_into_rates_per_range_and_mode():
    records = [
        {"decode": {"1": {"plain": [10, 1.0, 0.5, 10], "spec": [4, 1.0, 1.0, 12]}}},
        {"decode": {"3": {"plain": [2, 0.5, 0.5, 6]}}},
        {"decode": {"1": {"plain": [10, 1.0, 1.0, 10]}, "40": {"plain": [1, 0.5, 0.5, 40]}}},
        {},  # a record of a run before decode tables
    ]
    buckets = decode_buckets(records)
    assert list(buckets) == ["1", "2-4", "17+"]
    assert buckets["1"]["plain"] == {"steps": 20, "tokens_per_s": 10.0, "tokens_per_cpu_s": 20 / 1.5,
                                     "tokens_per_step": 1.0}  # fmt: skip
    assert buckets["1"]["spec"]["tokens_per_step"] == 3.0 and "spec" not in buckets["2-4"]
    assert buckets["17+"]["plain"]["tokens_per_s"] == 80.0
    # Another run, faster at batch 1 only (20 tokens in 1.5 s): this run's 32 batch-1 tokens (3 s here) would
    # take it 2.4 s; the other buckets take the same 0.5 + 0.5 s in both.
    faster = [{"decode": {"1": {"plain": [10, 0.5, 0.5, 10]}}}, *records[1:]]
    summary = {"decode_buckets": buckets}
    assert equal_work_speedup(summary, {"decode_buckets": decode_buckets(faster)}) == pytest.approx(
        (3.0 + 0.5 + 0.5) / (32 / (20 / 1.5) + 0.5 + 0.5)
    )
    assert equal_work_speedup(summary, {"decode_buckets": decode_buckets(records[:1])}) is None
    by_arm = [{"decode_arms": {"1": {"off": [2, 0.1, 0.1, 2], "chain4": [2, 0.2, 0.2, 5]}}}, {}]
    arms = decode_buckets(by_arm, "decode_arms")
    assert list(arms) == ["1"] and arms["1"]["chain4"]["tokens_per_step"] == 2.5
    assert arms["1"]["off"]["tokens_per_s"] == pytest.approx(20.0)


def test_steps_whose_decode_waited_for_a_core_are_flagged():
    def record(step: int, rank: int, wall: float, cpu: float) -> dict:
        common = dict(wall_s=10.0, rollout_s=6.0, train_s=4.0, drafter_s=0.0, tail_share=1.0, peak_rss_mb=1.0)
        common.update(tokens=100, lengths=[100], reward=0.0, accuracy=0.0)
        return dict(common, step=step, rank=rank, decode={"1": {"plain": [100, wall, cpu, 100]}})

    assert core_share(record(1, 0, 2.0, 1.0)) == 0.5 and core_share(record(1, 0, 0.5, 0.1)) is None
    steps = [[record(s, 0, 2.0, 1.9), record(s, 1, 2.0, 1.2 if s == 3 else 2.0)] for s in (1, 2, 3)]
    assert summarise(steps, 0)["contended_steps"] == [3]
    assert summarise(steps[:2], 0)["contended_steps"] == []


def test_a_bracketed_baseline_is_averaged_and_its_drift_reported():
    def summary(step_s: float) -> dict:
        return {
            "step_s": step_s,
            "rollout_s": step_s / 2,
            "decode_buckets": {},
            "train_ms_per_forward_token": 10.0,
        }

    runs = {"baseline": summary(50.0), "tlt": summary(40.0), "frozen": summary(45.0)}
    assert compare(runs)["speedup"] == 1.25 and "drift" not in compare(runs)
    out = compare({**runs, "baseline_again": summary(40.0)})  # the machine got faster: the mean is 45 s
    assert out["speedup"] == 45 / 40 and out["frozen_speedup"] == 1.0 and out["drift"] == 0.8
    assert out["rollout_speedup"] == 22.5 / 20 and list(out["decode_speedup_equal_work"]) == ["tlt", "frozen"]
    slower = compare({**runs, "tlt": {**runs["tlt"], "train_ms_per_forward_token": 12.5}})
    assert slower["train_speedup_equal_work"] == {"tlt": 0.8, "frozen": 1.0}
