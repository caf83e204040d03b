"""The TRL GRPOTrainer peer of the end-to-end GRPO benchmark (needs the ``peers`` extra)."""

from __future__ import annotations

import math
import statistics
import sys

import pytest

pytest.importorskip("trl")

from benchmarks.trl_peer import run_trl_grpo
from tlt_lightning.rl.tasks import TaskConfig

GOOD = {
    "model": "smollm2-135m",
    "task": TaskConfig(name="chain_sum", size=8),
    "steps": 2,
    "prompts_per_step": 2,
    "group_size": 2,
    "max_new_tokens": 8,
    "lr": 1e-5,
}


@pytest.mark.parametrize(
    "name, value",
    [
        ("model", ""),
        ("task", {"name": "chain_sum"}),
        ("steps", 0),
        ("steps", 1.5),
        ("prompts_per_step", 0),
        ("prompts_per_step", 9),  # more than task.size
        ("group_size", 1),
        ("group_size", True),
        ("max_new_tokens", 0),
        ("lr", 0.0),
        ("lr", float("nan")),
        ("temperature", 0.0),
        ("temperature", float("inf")),
        ("seed", -1),
        ("dtype", "float64"),
        ("output_dir", ""),
        ("micro_batch_size", 3),  # does not divide 2 prompts x 2 completions
        ("micro_batch_size", 0),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(name, value, tmp_path):
    kwargs = {**GOOD, "output_dir": tmp_path, name: value}
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        run_trl_grpo(**kwargs)


@pytest.mark.slow
def test_two_trl_grpo_steps_on_smollm2(tmp_path):
    task = GOOD["task"]
    # Micro-batches of 2 completions: two accumulated forward/backward passes per optimizer step.
    out = run_trl_grpo(**GOOD, seed=0, output_dir=tmp_path / "trl", micro_batch_size=2)

    assert out["peer"] == "trl"
    import trl

    assert out["trl_version"] == trl.__version__
    steps = out["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    max_reward = 1.0 + task.format_weight
    for s in steps:
        assert math.isfinite(s["wall_s"]) and s["wall_s"] > 0
        assert math.isfinite(s["cpu_s"]) and s["cpu_s"] > 0
        assert s["reward_mean"] is not None and 0.0 <= s["reward_mean"] <= max_reward + 1e-6
        assert s["correctness_mean"] is not None and 0.0 <= s["correctness_mean"] <= 1.0
        assert 0.0 <= s["frac_reward_zero_std"] <= 1.0
        # Every completion has between 1 and max_new_tokens tokens.
        assert 1.0 <= s["completion_length_mean"] <= GOOD["max_new_tokens"]
    assert out["median_step_s"] == pytest.approx(statistics.median(s["wall_s"] for s in steps))
    assert math.isfinite(out["median_step_cpu_s"]) and out["median_step_cpu_s"] > 0
    # With seed 0, some group of this setup has rewards that differ (checked), so it has a gradient
    # and AdamW moves the policy; a group with equal rewards has none.
    assert any(s["frac_reward_zero_std"] < 1.0 for s in steps)
    assert out["weights_changed"] is True
    assert (
        out["config"]["per_device_train_batch_size"] == 2
        and out["config"]["gradient_accumulation_steps"] == 2
    )
    # Nothing is saved: no checkpoints.
    assert not list((tmp_path / "trl").glob("checkpoint-*"))


def test_missing_trl_raises_import_error_naming_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` now raises ImportError
    with pytest.raises(ImportError, match=r"tlt-lightning\[peers\]"):
        run_trl_grpo(**GOOD, output_dir=tmp_path)
