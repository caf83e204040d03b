"""Shared fixtures: tiny random targets and their greedy rollouts with drafter features."""

from __future__ import annotations

import os

import pytest
import torch

from tlt_lightning.drafter import Drafter, DrafterConfig
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout.engine import RolloutEngine
from tlt_lightning.rollout.types import RolloutConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def llama() -> HFTarget:
    return HFTarget(load_model("tiny-llama").model)


@pytest.fixture(scope="session")
def qwen2() -> HFTarget:
    return HFTarget(load_model("tiny-qwen2").model)


@pytest.fixture(params=["tiny-llama", "tiny-qwen2"])
def target(request, llama, qwen2) -> HFTarget:
    return llama if request.param == "tiny-llama" else qwen2


def make_drafter(
    target: HFTarget, kind: str = "eagle1", draft_vocab_size: int | None = None, seed: int = 0, **kwargs
) -> Drafter:
    torch.manual_seed(seed)
    return Drafter(DrafterConfig.from_target(target, kind, draft_vocab_size), target, **kwargs)


def generate_rollouts(
    target: HFTarget,
    config: DrafterConfig,
    prompts: int = 16,
    tokens: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
):
    """``prompts`` random 4-token prompts, ``tokens`` new tokens each, with the drafter's training
    features."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.info.vocab_size, (prompts, 4), generator=g).tolist()
    rollout_cfg = RolloutConfig(
        max_new_tokens=tokens, temperature=temperature, feature_layers=config.rollout_feature_layers
    )
    return (
        RolloutEngine(target, rollout_cfg)
        .generate(ids, generator=torch.Generator().manual_seed(seed))
        .rollouts
    )
