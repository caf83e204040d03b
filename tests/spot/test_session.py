"""SpotDrafter without Lightning: one RL step as plain calls, saving, state, errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tlt_lightning.drafter import save_drafter
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout.engine import RolloutEngine
from tlt_lightning.rollout.types import RolloutConfig
from tlt_lightning.spot import SpotConfig, SpotDrafter, SpotTrainerConfig, initial_drafter


@pytest.fixture(scope="module")
def llama() -> HFTarget:
    return HFTarget(load_model("tiny-llama").model)


def make_spot(llama, tmp_path, state=None, share=None, **config) -> SpotDrafter:
    training = SpotTrainerConfig(
        packing_budget=32, max_steps_per_rollout=2, max_seconds_per_rollout=None, paid_share_of_savings=share
    )
    config = SpotConfig(training=training, draft_vocab_size=None, checkpoint_interval=2, **config)
    return SpotDrafter(config, llama, tmp_path / "checkpoints", state=state)


def rollout(llama, spot: SpotDrafter, drafter, seed: int):
    """Four prompts' responses with the drafter's training features (as the module's rollouts)."""
    ids = torch.randint(
        3, llama.info.vocab_size, (4, 4), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    config = RolloutConfig(max_new_tokens=12, feature_layers=drafter.config.rollout_feature_layers)
    return RolloutEngine(llama, config).generate(ids, generator=torch.Generator().manual_seed(seed))


def weights(spot: SpotDrafter) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in spot.drafter.state_dict().items()}


def test_a_training_loop_drives_it_with_plain_calls(llama, tmp_path):
    spot = make_spot(llama, tmp_path)
    initial = weights(spot)
    for step in range(2):
        serving = spot.begin_step(step)
        assert serving is not spot.drafter  # the rollout drafts with a published copy
        spot.before_rollout()
        result = rollout(llama, spot, serving, seed=step)
        spot.after_rollout(result)
        total = spot.end_step(result)
        # One worker has no idle time: the paid budget (2 steps) is trained and published.
        assert total["tail_steps"] == 0 and total["paid_steps"] == 2 and total["paid_s"] > 0
    assert (spot.steps, spot.paid_steps, spot.rl_steps, spot.publisher.version) == (4, 4, 2, 2)
    assert spot.buffer.added == 8
    assert any(not torch.equal(initial[k], v) for k, v in weights(spot).items())
    assert not spot.due(1) and spot.due(2)
    path = spot.save(2)
    assert path is not None and spot.save(2) is None  # one save per step
    spot.close()  # waits for the write
    assert (tmp_path / "checkpoints" / "step-00000002").is_dir() and spot.last_checkpoint == path
    assert spot.summary()["drafter_steps"] == 4 and spot.params()["effective_kind"] == "eagle1"
    segments, paid = spot.timeline()
    assert {s.state.value for s in segments} >= {"busy"} and len(paid) == 2


def test_paid_training_spends_only_what_speculation_saved(llama, tmp_path):
    spot = make_spot(llama, tmp_path, share=1.0)

    def step(step: int, drafted: bool) -> dict[str, float]:
        credit, serving = spot.savings.budget_s(), spot.begin_step(step)
        spot.before_rollout()
        result = rollout(llama, spot, serving, seed=step)
        spot.after_rollout(result)
        if drafted:  # as if the last decode step had drafted: three tokens a row in one step's time
            result.stats.step_speculative[-1] = True
            result.stats.step_tokens[-1] *= 3
        total = spot.end_step(result)
        assert spot.savings.budget_s() == pytest.approx(credit + total["saved_s"] - total["paid_s"])
        return total

    plain = step(0, drafted=False)
    assert plain["saved_s"] == 0 and plain["paid_steps"] == 0  # nothing saved, nothing to spend
    drafted = step(1, drafted=True)
    assert drafted["saved_s"] > 0 and drafted["paid_steps"] >= 1
    credit = spot.savings.budget_s()
    assert (step(2, drafted=False)["paid_steps"] > 0) == (credit > 0)  # trains on credit only
    assert spot.state_dict()["savings"]["credit"] == spot.savings.budget_s()
    spot.close()


def test_rollouts_outside_a_step_are_ignored(llama, tmp_path):
    spot = make_spot(llama, tmp_path)
    with spot.publisher.acquire() as lease:
        result = rollout(llama, spot, lease.drafter, seed=0)
    spot.before_rollout()
    spot.after_rollout(result)  # e.g. an evaluation rollout: no data, no training
    assert spot.buffer.added == 0 and spot.steps == 0
    with pytest.raises(RuntimeError, match="end_step called without begin_step"):
        spot.end_step(result)
    spot.begin_step(0)
    spot.after_rollout(result)
    spot.after_rollout(result)  # a second rollout in one step is not added twice
    spot.end_step(result)  # nor added again here
    assert spot.buffer.added == 4


def test_state_round_trip_restores_drafter_counters_and_version(llama, tmp_path):
    spot = make_spot(llama, tmp_path)
    serving = spot.begin_step(0)
    spot.end_step(rollout(llama, spot, serving, seed=0))  # the buffer is filled here if not before
    state = spot.state_dict()
    assert state["buffer"]["items"] and "items" not in spot.state_dict(buffer_data=False)["buffer"]
    again = make_spot(llama, tmp_path, state=state)
    assert (again.steps, again.rl_steps, again.publisher.version) == (2, 1, 1)
    assert all(torch.equal(v, weights(again)[k]) for k, v in weights(spot).items())
    again.load_state_dict({"counters": {"steps": 7}})  # missing keys keep their values
    assert (again.steps, again.rl_steps, again.publisher.version) == (7, 1, 1)
    again.load_state_dict({"publisher": {"version": 5}})
    assert again.publisher.version == 6  # restored and the restored drafter published again
    spot.close(), again.close()


def test_initial_drafter_is_given_loaded_or_built(llama, tmp_path):
    built = initial_drafter(SpotConfig(draft_vocab_size=None), llama)
    assert built.dtype == torch.float32 and initial_drafter(SpotConfig(), llama, built) is built
    save_drafter(built, tmp_path / "saved")
    loaded = initial_drafter(SpotConfig(drafter_path=tmp_path / "saved"), llama)
    assert loaded.config == built.config
    with pytest.raises(ValueError, match="drafter_path='x' given, but the module already has a drafter"):
        initial_drafter(SpotConfig(drafter_path="x"), llama, built)
    with pytest.raises(ValueError, match="drafter_path 'nowhere' is not a drafter directory"):
        initial_drafter(SpotConfig(drafter_path="nowhere"), llama)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"training": {"lr": 1.0}}, r"training must be a SpotTrainerConfig, got \{'lr': 1.0\}"),
        ({"buffer_mb": -1}, r"buffer_mb must be a finite number > 0 \(MiB\), got -1"),
        ({"checkpoint_interval": 0}, "checkpoint_interval must be an int >= 1 or None, got 0"),
        ({"kind": "eagle2"}, r"kind must be one of \('eagle1', 'eagle3'\), got 'eagle2'"),
        ({"recency_decay": 2}, r"recency_decay must be in \(0, 1\], got 2"),
    ],
)
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpotConfig(**kwargs)


def test_the_package_does_not_import_lightning():
    code = (
        "import sys, tlt_lightning.spot; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'lightning'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
