import json

from benchmarks.__main__ import main


def test_bench_activation_checkpointing_cli_writes_json_and_plot(tmp_path, capsys):
    path = tmp_path / "checkpoint.json"
    main(
        [
            "--threads",
            "1",
            "activation-checkpointing",
            "--layers",
            "4",
            "--hidden",
            "64",
            "--vocab",
            "256",
            "--seq-len",
            "64",
            "--repeats",
            "1",
            "--steps",
            "1",
            "--json",
            str(path),
        ]
    )
    data = json.loads(path.read_text())
    variants = data["variants"]
    assert set(variants) == {
        "none",
        "static",
        "optimal-layers",
        "optimal-sublayers",
        "greedy-sublayers",
        "all",
    }
    budget = data["budget_mb"]
    assert variants["static"]["measured_peak_mb"] == budget
    for name in ("optimal-layers", "optimal-sublayers", "greedy-sublayers"):  # static's memory, at most
        assert variants[name]["measured_peak_mb"] <= budget
    # Over the same blocks static is one feasible plan: the optimum never recomputes more.
    assert (
        variants["optimal-layers"]["predicted_recompute_ms"] <= variants["static"]["predicted_recompute_ms"]
    )
    assert variants["none"]["measured_peak_mb"] > budget > variants["all"]["measured_peak_mb"]
    assert path.with_suffix(".png").stat().st_size > 10_000
    assert "wrote" in capsys.readouterr().out
