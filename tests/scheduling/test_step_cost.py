"""StepCostModel: reproducible mode of the bucketed strategies (rewards from a modelled step cost)."""

from __future__ import annotations

import random

import pytest

from tests.scheduling.test_bandit import drive
from tlt_lightning.scheduling import BEGMABStrategy, StepCostModel
from tlt_lightning.speculative import DraftSpec


def test_cost_model_makes_decisions_independent_of_wall_time():
    """Same seed, same accepted tokens, wildly different step times: identical state in reproducible mode."""
    sizes = [1, 3, 3, 12, 1, 40, 2, 7] * 60

    def run(cost_model, time_seed):
        noise = random.Random(time_seed)
        bandit = BEGMABStrategy(seed=3, epsilon=0.3, cost_model=cost_model)
        drive(
            bandit,
            sizes,
            rewards=lambda step, bs, arm: (1.0 + (arm is not None) * 0.5, noise.uniform(0.01, 1.0)),
        )
        return bandit

    a, b = run(StepCostModel(), 0), run(StepCostModel(), 1)
    assert a.reproducible and a.state_dict() == b.state_dict()
    assert [d.arm for d in a.history] == [d.arm for d in b.history]
    # The reward is the modelled one: tokens * batch / modelled seconds.
    d = a.history[-1]  # the last step ran at batch size sizes[-1] = 7
    tokens = 1.0 + (d.arm is not None) * 0.5
    assert d.bucket == "5-20" and d.reward == pytest.approx(tokens * 7 / StepCostModel().step_time(7, d.arm))
    # Wall time: the same seed decides differently once timing differs.
    c, e = run(None, 0), run(None, 1)
    assert not c.reproducible and [x.arm for x in c.history] != [x.arm for x in e.history]


def test_cost_model_ranks_deep_drafts_first_at_batch_1_and_off_at_large_batch():
    model = StepCostModel()
    deep, off = DraftSpec(6), None
    # Expected tokens 3 for the deep chain vs 1 off: it pays at batch 1 ...
    assert 3 * 1 / model.step_time(1, deep) > 1 * 1 / model.step_time(1, off)
    # ... and loses at batch 64, where verifying 6 tokens per request is real compute.
    assert 3 * 64 / model.step_time(64, deep) < 1 * 64 / model.step_time(64, off)


def test_cost_model_state_and_errors():
    bandit = BEGMABStrategy(cost_model=StepCostModel(base_time=0.1))
    drive(bandit, [1, 2, 3])
    state = bandit.state_dict()
    assert state["cost_model"] == {
        "base_time": 0.1,
        "token_time": 0.0015,
        "draft_time": 0.006,
        "draft_token_time": 0.00005,
    }
    same = BEGMABStrategy(cost_model=StepCostModel(base_time=0.1))
    same.load_state_dict(state)
    assert same.state_dict() == state
    with pytest.raises(
        ValueError, match=r"learned with modelled cost .* but this strategy uses wall time.*same reproducible"
    ):
        BEGMABStrategy().load_state_dict(state)
    with pytest.raises(ValueError, match="cannot change cost_model after 3 updates"):
        bandit.use_cost_model(None)
    with pytest.raises(TypeError, match="cost_model must be a StepCostModel or None .*got dict"):
        BEGMABStrategy(cost_model={"base_time": 1.0})
    with pytest.raises(
        ValueError, match=r"StepCostModel.token_time must be a finite number >= 0 \(seconds\), got -1"
    ):
        StepCostModel(token_time=-1)
    with pytest.raises(ValueError, match="StepCostModel.base_time must be > 0 .*got 0"):
        StepCostModel(base_time=0)
    with pytest.raises(TypeError, match="seed must be an int, got 1.5"):
        BEGMABStrategy(seed=1.5)
