import json

import pytest
import torch

from benchmarks.__main__ import main


@pytest.mark.slow
def test_spot_bench_on_the_real_model(tmp_path):
    """Every part on SmolLM2 with tiny settings: packing fills rows, latencies are measured, the two
    DDP fits both ran, the spot-trained one trained in the tail and drew its timeline."""
    path = tmp_path / "spot.json"
    main(
        [
            "--threads",
            "1",
            "spot",
            "--task",
            "chain_sum",
            "--packing-rollouts",
            "6",
            "--packing-budget",
            "64",
            "--packing-repeats",
            "1",
            "--windows",
            "4",
            "--checkpoint-repeats",
            "1",
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "2",
            "--max-new-tokens",
            "12",
            "--threshold",
            "4",
            "--depth",
            "2",
            "--decode",  # the fits' plumbing: compiled rollouts have tests of their own
            "hf",
            "--out",
            str(tmp_path / "runs"),
            "--json",
            str(path),
        ]
    )
    data = json.loads(path.read_text())
    packing = data["packing"]
    assert packing["settings"]["num_rollouts"] == 6 and packing["settings"]["vocab_size"] == 49152
    assert packing["packed"]["fill_ratio"] >= packing["padded"]["fill_ratio"] and packing["speedup"] > 0
    # The last rank to finish trains only when the collective saying so is late (a loaded machine): rarely.
    assert 0 < data["preemption"]["windows"] and data["preemption"]["last_finisher_windows"] <= 1
    checkpoint = data["checkpoint"]
    assert checkpoint["settings"]["hidden_size"] == 576 and checkpoint["checkpoint_mb"] > 10
    assert 0 < checkpoint["async_blocking_s"] and 0 < checkpoint["sync_s"]
    ddp = data["ddp"]
    for name in ("frozen", "spot"):
        assert [s["step"] for s in ddp[name]["steps"]] == [1, 2]
        assert all(s["tokens"] > 0 and s["wall_s"] > 0 for s in ddp[name]["steps"])
    spot = ddp["spot"]["spot_training"]
    assert 0 <= spot["idle_fraction_recovered"] <= 1
    assert len(spot["tail_steps_per_rank"]) == 2
    assert ddp["overhead"]["per_step"] == pytest.approx(
        ddp["spot"]["median"]["wall_s"] / ddp["frozen"]["median"]["wall_s"] - 1
    )
    assert torch.tensor(spot["preemption_latency_s"]).ge(0).all()
    assert path.with_suffix(".png").stat().st_size > 10_000


def test_spot_bench_rejects_bad_arguments(tmp_path, capsys):
    with pytest.raises(ValueError, match="--prompts-per-step is split over 2 ranks"):
        main(["spot", "--prompts-per-step", "3"])
    with pytest.raises(SystemExit) as refused:  # a positive int by its type: the parser refuses 0
        main(["spot", "--windows", "0"])
    assert refused.value.code == 2 and 'key "windows"' in capsys.readouterr().err
    with pytest.raises(ValueError, match="is not a drafter directory"):
        main(["spot", "--drafter", str(tmp_path / "nowhere")])
    with pytest.raises(ValueError, match="--rollouts-cache .* is not a file"):
        main(["spot", "--rollouts-cache", str(tmp_path / "none.pt")])
