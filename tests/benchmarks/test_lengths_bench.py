"""``python -m benchmarks lengths``: a fit config's rollouts with and without speculation, side by side."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from benchmarks.__main__ import parse
from benchmarks.lengths import ks_distance, ks_pvalue, run, sign_flip_pvalue, summarise
from tests.benchmarks.test_e2e_config import tiny_config
from tlt_lightning.rl.crossover import calibration_sizes


def test_the_sign_flip_test_tells_a_shift_from_noise():
    noise = torch.randn(64, generator=torch.Generator().manual_seed(0))
    assert sign_flip_pvalue(noise, 1999) > 0.05
    assert sign_flip_pvalue(noise + 1.0, 1999) == pytest.approx(1 / 2000)  # no flip reaches it
    assert sign_flip_pvalue(torch.zeros(8), 99) == 1.0  # nothing to tell apart


def test_the_ks_distance_and_its_p_value():
    a = torch.arange(100.0)
    assert ks_distance(a, a) == 0.0 and ks_pvalue(0.0, 100, 100) == 1.0
    assert ks_distance(a, a + 100) == 1.0 and ks_pvalue(1.0, 100, 100) < 1e-20
    assert ks_distance(a, a + 10) == pytest.approx(0.1)
    assert 0.3 < ks_pvalue(0.1, 100, 100) < 0.9  # a tenth apart in 100 draws: within chance


def _rows(lengths, rewards=None):
    rewards = rewards or [0.0] * len(lengths)
    return [
        {"group": 0, "prompt": i // 2, "length": n, "reward": r, "correct": float(r >= 1)}
        for i, (n, r) in enumerate(zip(lengths, rewards, strict=True))
    ]


def test_the_summary_compares_every_arm_with_plain_decoding():
    plain = [10, 12, 30, 8, 64, 64, 5, 7] * 4
    longer = [min(2 * n + 4, 64) for n in plain]  # what a length bias would do, capped
    arms = summarise(
        {"off": _rows(plain), "same": _rows(plain[::-1]), "longer": _rows(longer)}, cap=64, permutations=999
    )
    assert arms["off"]["at_cap"] == 8 and arms["off"]["max"] == 64 and "vs_off" not in arms["off"]
    assert arms["same"]["vs_off"]["ks_distance"] == 0.0 and arms["same"]["vs_off"]["ks_p"] == 1.0
    assert arms["longer"]["vs_off"]["mean_length_ratio"] > 1.4
    assert arms["longer"]["vs_off"]["length_sign_flip_p"] < 0.01
    assert arms["longer"]["at_cap"] > arms["off"]["at_cap"]


def test_a_tiny_configs_arms_are_drawn_scored_and_compared(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    argv = ["lengths", "--config", str(path), "--arms", "off", "chain2", "begmab", "--groups", "2"]
    argv += ["--prompts", "3", "--permutations", "99", "--json", str(tmp_path / "lengths.json")]
    payload = run(parse(["--threads", "1", *argv]))
    assert payload["responses_per_arm"] == 2 * 3 * 4  # groups x prompts x the config's group size
    assert set(payload["arms"]) == {"off", "chain2", "begmab"}
    for arm, stats in payload["arms"].items():
        assert len(payload["lengths"][arm]) == 24 and max(payload["lengths"][arm]) <= 16  # the config's cap
        assert stats["decode"]["tokens"] == sum(payload["lengths"][arm]) and 0 <= stats["reward"] <= 1
        if arm != "off":
            assert stats["decode"]["mean_accept_length"] >= 1
            assert 0 < stats["vs_off"]["length_sign_flip_p"] <= 1 and 0 <= stats["vs_off"]["ks_p"] <= 1
            assert 0 <= stats["vs_off"]["lengths_changed"] <= 24 and stats["decode"]["speedup_vs_off"] > 0
            assert all(b["cpu_vs_off"] > 0 for b in stats["decode"]["buckets"].values() if "cpu_vs_off" in b)
        buckets = stats["decode"]["buckets"]
        steps = sum(b["steps"] for b in buckets.values())
        assert sum(b["tokens"] for b in buckets.values()) + 24 == stats["decode"]["tokens"]  # + the prefill's
        assert steps > 0 and stats["decode"]["other_seconds"] > 0
    written = json.loads((tmp_path / "lengths.json").read_text())
    assert written["arms"] == payload["arms"] and written["complete"]
    assert (tmp_path / "lengths.png").stat().st_size > 0
    assert "[bench lengths] chain2: mean" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--arms", "chain2", "off"], "must start with 'off'"),
        (["--arms", "off", "chain2", "chain2"], "repeat none"),
        (["--groups", "0"], "--groups must be >= 1"),
        (["--config", "missing.yaml"], "no such file"),
    ],
)
def test_bad_options_are_refused_before_any_model_loads(tmp_path, argv, match):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    with pytest.raises(ValueError, match=match):
        run(parse(["lengths", "--config", str(path), *argv]))


def test_a_crash_keeps_the_groups_done(tmp_path, monkeypatch):
    import benchmarks.lengths

    rows = benchmarks.lengths._rollout_rows

    def crash_in_the_second_group(module, result, indices, group):
        if group == 1:
            raise RuntimeError("killed")
        return rows(module, result, indices, group)

    monkeypatch.setattr(benchmarks.lengths, "_rollout_rows", crash_in_the_second_group)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    argv = ["lengths", "--config", str(path), "--arms", "off", "chain2", "--groups", "2", "--prompts", "2"]
    with pytest.raises(RuntimeError, match="killed"):
        run(parse([*argv, "--json", str(tmp_path / "lengths.json")]))
    kept = json.loads((tmp_path / "lengths.json").read_text())
    assert not kept["complete"] and kept["groups_done"] == 1
    assert [len(kept["rows"][arm]) for arm in ("off", "chain2")] == [8, 8]


def test_steps_are_counted_in_batch_buckets_and_rated_against_plain():
    from types import SimpleNamespace

    from benchmarks.lengths import add_step_buckets, bucket_edges, bucket_rates

    assert bucket_edges(8) == [1, 2, 5, 8] and bucket_edges(2) == [1, 2] and bucket_edges(1000)[-1] == 1000
    edges = bucket_edges(8)
    plain, fast = {}, {}
    steps = SimpleNamespace(
        step_batch_sizes=[40, 8, 6, 3, 1], step_times=[1.0, 0.5, 0.4, 0.3, 0.2],
        step_cpu_times=[1.0, 0.5, 0.4, 0.3, 0.2], step_tokens=[40, 8, 6, 3, 1],
    )  # fmt: skip
    add_step_buckets(plain, steps, edges)
    add_step_buckets(plain, steps, edges)
    assert plain == {
        "8+": [3.0, 3.0, 96, 4],
        "5-7": [0.8, 0.8, 12, 2],
        "2-4": [0.6, 0.6, 6, 2],
        "1": [0.4, 0.4, 2, 2],
    }
    steps.step_tokens = [40, 8, 12, 3, 2]  # twice the tokens at 5-7 and at 1 in the same time
    add_step_buckets(fast, steps, edges)
    rates = bucket_rates(fast, plain)
    assert rates["5-7"]["vs_off"] == pytest.approx(2.0) and rates["1"]["cpu_vs_off"] == pytest.approx(2.0)
    assert rates["8+"]["vs_off"] == pytest.approx(1.0) and rates["2-4"]["tokens_per_s"] == pytest.approx(10.0)
    assert "vs_off" not in bucket_rates(plain, None)["1"]


def test_the_crossover_arm_is_bandit_with_the_machines_step_costs(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_LIGHTNING_CACHE", str(tmp_path / "cache"))
    config = tiny_config()
    # The tiny config decodes eagerly (where "auto" measures nothing); a low threshold: few sizes to measure.
    config["model"].setdefault("speculative", {}).update(crossover="measure", threshold=4)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = ["lengths", "--config", str(path), "--arms", "off", "crossover", "--groups", "1", "--prompts", "2"]
    payload = run(parse(["--threads", "1", *argv, "--json", str(tmp_path / "lengths.json")]))
    measured = payload["step_costs"]["seconds"]
    # A size where the random tiny model ended rows too early to time a step is left out.
    assert measured and {int(b) for b in measured} <= set(calibration_sizes(4))
    assert all("off" in row for row in measured.values())
    assert payload["arms"]["crossover"]["decode"]["tokens"] > 0
