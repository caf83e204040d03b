import json

import pytest

from tlt_lightning.bench.rollout import length_summary
from tlt_lightning.cli import main


def test_length_summary_idle_fraction():
    import torch

    out = length_summary(torch.tensor([10, 20, 30, 100]))
    assert out["max"] == 100 and out["mean"] == 40
    assert out["idle_fraction_static_batch"] == pytest.approx(0.6)


@pytest.mark.slow
def test_bench_rollout_cli_writes_json_and_plot(tmp_path):
    path = tmp_path / "rollout.json"
    main(["--threads", "1", "bench", "rollout", "--batch-sizes", "2", "--max-new-tokens", "8",
          "--long-tail-requests", "4", "--long-tail-max-new", "16", "--repeats", "1", "--json", str(path)])
    data = json.loads(path.read_text())
    batch = data["batches"][0]
    assert batch["batch_size"] == 2 and batch["identical_outputs"] == 2  # greedy: same tokens as HF
    assert batch["tokens_per_s"] > 0 and batch["hf_tokens_per_s"] > 0
    assert set(data["long_tail"]["lengths"]) >= {"p50", "p90", "max", "idle_fraction_static_batch"}
    assert path.with_suffix(".png").stat().st_size > 10_000
