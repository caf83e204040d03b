import json

import pytest

from benchmarks.__main__ import main


@pytest.mark.slow
def test_e2e_bench_on_the_real_model(tmp_path):
    """Both runs on SmolLM2 with tiny settings: step records, a breakdown that adds up, the plot."""
    path = tmp_path / "e2e.json"
    main(
        [
            "--threads",
            "1",
            "e2e",
            "--task",
            "chain_sum",
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "2",
            "--max-new-tokens",
            "10",
            "--threshold",
            "5",
            "--depth",
            "2",
            "--decode",  # the fits' plumbing: compiled rollouts have tests of their own
            "hf",
            "--drafter-steps",
            "1",
            "--drift-every",
            "2",
            "--drift-tokens",
            "8",
            "--out",
            str(tmp_path / "runs"),
            "--json",
            str(path),
        ]
    )
    data = json.loads(path.read_text())
    assert set(data["runs"]) == {"baseline", "tlt"} and data["config"]["rollout_dtype"] == "bfloat16"
    for name, run in data["runs"].items():
        assert [s["step"] for s in run["steps"]] == [1, 2]
        for s in run["steps"]:
            parts = s["rollout_s"] + s["reward_s"] + s["train_s"] + s["drafter_s"]
            assert 0 < parts <= s["wall_s"] and s["cpu_s"] > 0 and s["tokens"] > 0
            assert 0 <= s["reward_mean"] <= 1.1
            # Only the TLT run speculates (4 requests, threshold 5: every step) and trains a drafter.
            assert (s["sd_step_fraction"] > 0) == (name == "tlt") and (s["drafter_s"] > 0) == (name == "tlt")
        assert 0 < run["median"]["rollout_share"] < 1 and run["median"]["wall_ms_per_token"] > 0
    assert data["speedup"]["wall"] == pytest.approx(
        data["runs"]["baseline"]["median"]["wall_s"] / data["runs"]["tlt"]["median"]["wall_s"]
    )
    assert [h["step"] for h in data["runs"]["tlt"]["drift"]] == [0, 2] and "drift" not in data["runs"][
        "baseline"
    ]
    assert path.with_suffix(".png").stat().st_size > 10_000


def test_e2e_bench_rejects_bad_arguments(tmp_path, capsys):
    with pytest.raises(ValueError, match="--group-size must be >= 2"):
        main(["e2e", "--group-size", "1"])
    with pytest.raises(SystemExit) as refused:  # a positive int by its type: the parser refuses 0
        main(["e2e", "--steps", "0"])
    assert refused.value.code == 2 and 'key "steps"' in capsys.readouterr().err
    with pytest.raises(ValueError, match="is not a drafter directory"):
        main(["e2e", "--drafter", str(tmp_path / "nowhere")])
