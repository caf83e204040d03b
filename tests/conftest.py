"""Shared fixtures: tiny random targets for fast tests, the real SmolLM2 for tests marked slow."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(int(os.environ.get("TLT_TEST_THREADS", "1")))

# After the lines above: the environment must be set before transformers is first imported.
from tlt_lightning.models import HFTarget, load_model  # noqa: E402


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-qwen2"])
def tiny_target(request) -> HFTarget:
    return HFTarget(load_model(request.param, seed=0).model)


@pytest.fixture(scope="session")
def tiny_llama() -> HFTarget:
    return HFTarget(load_model("tiny-llama", seed=0).model)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (converted once into the user cache)."""
    return load_model("smollm2-135m")


@pytest.fixture
def fresh_compile() -> None:
    """Forget what ``torch.compile`` compiled so far, for tests about compiling itself (its counters, and
    Inductor's in-process caches, which would serve an earlier test's code)."""
    torch._dynamo.reset()
