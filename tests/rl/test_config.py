"""GRPOModule's grouped settings: each field checked where it is built, the error naming it."""

from __future__ import annotations

import pytest

from tlt_lightning.rl import OptimConfig, SpeculativeConfig, TaskConfig
from tlt_lightning.rl.config import as_config
from tlt_lightning.rollout import RolloutConfig


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"group_size": 1}, r"optim.group_size must be an int >= 2 \(GRPO's advantage.*, got 1"),
        ({"group_size": 4.0}, "optim.group_size must be an int >= 2.*, got 4.0"),
        ({"prompts_per_step": 0}, "optim.prompts_per_step must be an int >= 1, got 0"),
        ({"micro_batch_size": 0}, "optim.micro_batch_size must be an int >= 1 or None, got 0"),
        ({"micro_batch_tokens": 0.5}, "optim.micro_batch_tokens must be an int >= 1 .* or None, got 0.5"),
        ({"sequence_multiple": 0}, "optim.sequence_multiple must be an int >= 1 .*, got 0"),
        ({"lr": 0.0}, "optim.lr must be finite and > 0, got 0.0"),
        ({"lr": float("inf")}, "optim.lr must be finite and > 0, got inf"),
        ({"weight_decay": -1.0}, "optim.weight_decay must be >= 0, got -1.0"),
        ({"clip_eps": -0.1}, "optim.clip_eps must be >= 0, got -0.1"),
        ({"clip_eps_high": -0.1}, "optim.clip_eps_high must be >= 0 or None, got -0.1"),
        ({"kl_coef": -0.1}, "optim.kl_coef must be >= 0, got -0.1"),
        ({"aggregation": "mean"}, r"optim.aggregation must be one of \('token', 'sequence'\), got 'mean'"),
        ({"max_grad_norm": 0.0}, "optim.max_grad_norm must be > 0 or None, got 0.0"),
        ({"optimizer": "adam8"}, r"optim.optimizer must be one of \('adamw', 'adamw8bit'\), got 'adam8'"),
    ],
)
def test_optim_fields_are_checked_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"drafter_kind": "eagle2"},
            "speculative.drafter_kind must be 'eagle1', 'eagle3' or None, got 'eagle2'",
        ),
        ({"sd_steps": 0}, "speculative.sd_steps must be an int >= 1, got 0"),
        ({"threshold": True}, "speculative.threshold must be an int >= 1, got True"),
    ],
)
def test_speculative_fields_are_checked_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kwargs)


def test_defaults_are_grpo_module_s_defaults():
    optim, spec = OptimConfig(), SpeculativeConfig()
    assert (optim.group_size, optim.prompts_per_step, optim.lr, optim.micro_batch_size) == (4, 4, 1e-6, 8)
    assert optim.aggregation == "token" and optim.max_grad_norm == 1.0 and optim.clip_eps_high is None
    assert spec.enabled and (spec.drafter_kind, spec.drafter_path, spec.sd_steps, spec.threshold) == (
        None,
        None,
        4,
        32,
    )


def test_as_config_takes_the_config_a_dict_of_its_fields_or_none():
    optim = OptimConfig(lr=0.5)
    assert as_config(optim, OptimConfig, "optim") is optim
    assert as_config({"lr": 0.5}, OptimConfig, "optim") == optim
    assert as_config(None, RolloutConfig, "rollout") == RolloutConfig()
    assert as_config({"name": "countdown"}, TaskConfig, "task").name == "countdown"
    with pytest.raises(
        TypeError, match="optim must be a OptimConfig, a dict of its fields or None, got float"
    ):
        as_config(0.5, OptimConfig, "optim")
    with pytest.raises(TypeError, match="unexpected keyword argument 'lrr'"):
        as_config({"lrr": 0.5}, OptimConfig, "optim")
