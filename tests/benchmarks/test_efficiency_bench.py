import json

import pytest

from benchmarks.__main__ import main

TINY = [
    "--steps",
    "4",
    "--train-size",
    "64",
    "--eval-size",
    "16",
    "--batch-size",
    "4",
    "--teacher-steps",
    "3",
    "--qat-steps",
    "2",
    "--hidden",
    "32",
    "--layers",
    "2",
    "--teacher-hidden",
    "64",
    "--teacher-layers",
    "2",
    "--proxy-hidden",
    "32",
    "--holdout-steps",
    "2",
    "--evals",
    "2",
]


@pytest.mark.parametrize("part", ["sampler", "distill", "qat"])
def test_bench_efficiency_cli_writes_json_and_plot(part, tmp_path, capsys):
    """Each part end to end at toy size (seconds); the real sizes are the defaults, see docs/efficiency.md."""
    if part == "qat":
        pytest.importorskip("torchao")
    path = tmp_path / f"{part}.json"
    extra = ["--scratch"] if part == "qat" else []
    main(["--threads", "1", "efficiency", "--part", part, *TINY, *extra, "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["benchmark"] == f"efficiency-{part}" and data["task"]["eval"] == 16
    if part == "sampler":
        assert {r["variant"] for r in data["runs"]} == {"uniform", "importance", "rho"}
        budget = data["token_budget"]
        for r in data["runs"]:  # equal tokens: every run stops at the first step past the budget
            assert budget <= r["tokens"] < budget + 4 * 64 and len(r["curve"]) == 2
    elif part == "distill":
        assert set(data["variants"]) == {
            "ce",
            "logits-kd",
            "hierarchical-mse",
            "hierarchical-mse-raw",
            "hierarchical-cosine",
        }
        assert data["variants"]["hierarchical-mse"]["train_terms"]["hidden"] > 0
        assert (
            data["variants"]["hierarchical-mse"]["layer_map"]
            and not data["variants"]["logits-kd"]["layer_map"]
        )
    else:
        variants = data["variants"]
        assert set(variants) == {
            "fp32-phase1",
            "fp32",
            "ptq",
            "qat",
            "scratch-fp32",
            "scratch-ptq",
            "scratch-qat",
        }
        assert variants["qat"]["quantized_modules"] == variants["ptq"]["quantized_modules"] == 2 * 7
        # The converted model computes what fake quantization computed in training.
        for name in ("qat", "scratch-qat"):
            assert variants[name]["final"]["loss"] == pytest.approx(
                variants[name]["fake_quant_eval"]["loss"], rel=1e-4
            )
    assert path.with_suffix(".png").stat().st_size > 10_000
    assert "wrote" in capsys.readouterr().out
