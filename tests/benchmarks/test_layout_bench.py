import json

import pytest

from benchmarks.__main__ import main


@pytest.mark.slow
def test_bench_layout_times_the_layouts_side_by_side(tmp_path):
    path = tmp_path / "layout.json"
    main(
        [
            "--threads",
            "1",
            "layout",
            "--batch-sizes",
            "1",
            "2",
            "--max-new-tokens",
            "6",
            "--drafter",
            "examples/drafters/smollm2-countdown",
            "--arms",
            "chain2",
            "--repeats",
            "2",
            "--layouts",
            "out_in",
            "in_out",
            "packed",
            "--json",
            str(path),
        ]
    )
    data = json.loads(path.read_text())
    assert data["layouts"] == ["out_in", "in_out", "packed"]
    assert [w["workload"] for w in data["workloads"]] == [
        "plain, batch 1",
        "plain, batch 2",
        "chain2, batch 1",
    ]
    for w in data["workloads"]:
        assert w["out_in_tokens_per_s"] > 0 and "out_in_speedup" not in w
        for layout in ("in_out", "packed"):
            assert w[f"{layout}_speedup"] == pytest.approx(
                w[f"{layout}_tokens_per_s"] / w["out_in_tokens_per_s"]
            )
    assert path.with_suffix(".png").stat().st_size > 10_000


def test_bench_layout_needs_two_layouts():
    with pytest.raises(ValueError, match="at least two different layouts"):
        main(["layout", "--layouts", "packed", "packed"])


def test_bench_layout_rejects_off_as_an_arm():
    with pytest.raises(ValueError, match="speculative strategies only"):
        main(["layout", "--drafter", "examples/drafters/smollm2-countdown", "--arms", "off"])
