import json

import pytest

from benchmarks.__main__ import main
from benchmarks.strategies import parse_bandit_spec, standardized_ms_per_token
from tlt_lightning.drafter import Drafter, DrafterConfig, save_drafter
from tlt_lightning.models import HFTarget, load_model


@pytest.mark.slow
def test_bench_strategies_runs_every_arm_and_the_bandit(tmp_path):
    target = HFTarget(load_model("smollm2-135m", dtype="bfloat16").model)
    drafter = tmp_path / "drafter"
    save_drafter(Drafter(DrafterConfig.from_target(target, draft_vocab_size=512), target), drafter)
    path = tmp_path / "strategies.json"
    main(
        [
            "--threads",
            "1",
            "strategies",
            "--drafter",
            str(drafter),
            "--requests",
            "3",
            "--groups",
            "2",
            "--max-new-tokens",
            "6",
            "--threshold",
            "4",
            "--warm-rollouts",
            "1",
            "--json",
            str(path),
            "--bandits",
            "batch/1,2,5,21",
            "request/1,2,3",
        ]
    )
    data = json.loads(path.read_text())
    runs = data["runs"]
    assert set(runs) == {
        "off",
        "off (again)",
        "chain1",
        "chain2",
        "chain4",
        "tree4x2/8",
        "tree5x4/15",
        "BEG-MAB batch/1,2,5,21",
        "BEG-MAB request/1,2,3",
    }
    assert runs["off"]["sd_steps"] == 0 and runs["chain4"]["sd_steps"] == runs["chain4"]["steps"]
    # Random drafter, yet every fixed run emits 2 groups x 3 requests x 6 tokens. The bandit's runs
    # depend on timing (its rewards are measured), so they sample other tokens and may end early.
    bandit_runs = {"BEG-MAB batch/1,2,5,21", "BEG-MAB request/1,2,3"}
    assert all(
        r["tokens"] == 36 and [g["tokens"] for g in r["groups"]] == [18, 18]
        for name, r in runs.items()
        if name not in bandit_runs
    )
    assert all(0 < runs[name]["tokens"] <= 36 for name in bandit_runs)
    assert all(r["cpu_ms_per_token"] > 0 and r["std_ms_per_token"] > 0 for r in runs.values())
    off_mix = {b: tok for b, (_, tok) in runs["off"]["by_batch_size"].items()}
    assert off_mix == {b: tok for b, (_, tok) in runs["off (again)"]["by_batch_size"].items()}
    assert sum(off_mix.values()) == 36 - 6  # the prefill samples each request's first token
    assert data["best_fixed"] in runs and data["off_runs_ratio"] > 0
    for name in bandit_runs:
        b = data["bandits"][name]
        assert b["vs_best_fixed"] > 0 and sum(sum(c.values()) for c in b["counts"].values()) > 0
        measured = sum(sum(c.values()) for c in b["measured_counts"].values())
        assert measured == sum(r["steps"] for r in runs[name]["groups"])  # threshold 4 > 3 requests
        tried = {(k, a) for k, c in b["counts"].items() for a, n in c.items() if n}
        rated = {(k, a) for k, v in b["values"].items() for a, x in v.items() if x is not None}
        assert rated == tried and all(x > 0 for v in b["values"].values() for x in v.values() if x)
    assert list(data["bandits"]["BEG-MAB request/1,2,3"]["counts"]) == ["1", "2", "3+"]
    assert path.with_suffix(".png").stat().st_size > 10_000


def test_bench_strategies_rejects_bad_counts(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:  # a positive int by its type: the parser refuses 0
        main(["strategies", "--drafter", str(tmp_path), "--requests", "0"])
    assert refused.value.code == 2 and 'key "requests"' in capsys.readouterr().err


def test_bench_strategies_bandit_specs():
    assert parse_bandit_spec("batch/1,2,5,21") == (False, (1, 2, 5, 21))
    assert parse_bandit_spec("request/1") == (True, (1,))
    for bad in ("tokens/1,2", "request", "batch/1,x", "batch/"):
        with pytest.raises(ValueError, match="is not REWARD/THRESHOLDS"):
            parse_bandit_spec(bad)
    with pytest.raises(ValueError, match="bucket_thresholds must be strictly increasing"):
        main(["strategies", "--drafter", "unused", "--bandits", "batch/1,5,2"])


def test_bench_strategies_arms_are_named_like_arm_key():
    with pytest.raises(ValueError, match="--arms must include 'off'"):
        main(["strategies", "--drafter", "unused", "--arms", "chain2", "chain4"])
    with pytest.raises(ValueError, match=r"arm 'chain' is not 'off', 'chain<depth>'"):
        main(["strategies", "--drafter", "unused", "--arms", "off", "chain"])


def test_standardized_cost_reweights_to_the_reference_mix():
    run = {1: (0.5, 10), 8: (0.2, 40)}  # 50 ms per token alone, 5 ms per token among 8
    assert standardized_ms_per_token(run, {1: 10, 8: 40}) == pytest.approx(1e3 * 0.7 / 50)  # its own mix: raw
    assert standardized_ms_per_token(run, {1: 1, 8: 1}) == pytest.approx(27.5)
    # Batch sizes the run never decoded at take the nearest one's cost (ties: the smaller batch).
    assert standardized_ms_per_token(run, {2: 1}) == pytest.approx(50.0)
    assert standardized_ms_per_token(run, {6: 1, 30: 1}) == pytest.approx(5.0)
    assert standardized_ms_per_token({2: (1.0, 10), 4: (1.0, 20)}, {3: 1}) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="decoded no tokens"):
        standardized_ms_per_token({1: (0.1, 0)}, {1: 1})
    with pytest.raises(ValueError, match="reference decoded no tokens"):
        standardized_ms_per_token(run, {})
