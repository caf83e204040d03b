"""GRPO with ``rollout_backend="vllm"``: against the CPU stand-in for vLLM (tests/vllm/fake_vllm.py)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from tests.rl.test_module import PROMPTS, even_reward, make_module, make_trainer
from tests.vllm.fake_vllm import fake_vllm_module
from tlt_lightning.rl.module import GRPOModule
from tlt_lightning.rl.sources import TokenPromptSource
from tlt_lightning.rl.vllm_rollouts import check_vllm_settings
from tlt_lightning.vllm import backend as vb


@pytest.fixture
def fake_vllm(monkeypatch):
    """vLLM is the fake; the engines it builds are kept to look at."""
    api, built = fake_vllm_module(), []
    fake = api.LLM

    def llm(model, **kwargs):
        built.append(fake(model, **kwargs))
        return built[-1]

    api.LLM = llm
    monkeypatch.setattr(vb, "require_vllm", lambda: api)
    return built


class Recorded(GRPOModule):
    """After each rollout: its weight version, and whether the engine served exactly the policy's weights."""

    def rollout(self, prompts, generator=None):
        result = super().rollout(prompts, generator)
        served = dict(self.vllm_rollouts.backend.llm.model.named_parameters())
        self.record.append(
            (
                result.stats.weights_version,
                all(torch.equal(served[k], p) for k, p in self.policy.named_parameters()),
            )
        )
        return result


def test_grpo_samples_on_vllm_and_refreshes_the_policy_every_step(fake_vllm):
    module = make_module(cls=Recorded, rollout_backend="vllm", speculative=False, vllm={"device": "cpu"})
    module.record = []
    trainer = make_trainer(3)
    trainer.fit(module)
    assert trainer.callback_metrics["rollout/weights_version"] == 2  # logged every step
    assert len(fake_vllm) == 1  # one engine for the whole fit
    # Built on the initial weights, then refreshed once per optimizer step: always the policy's own weights.
    assert module.record == [(0, True), (1, True), (2, True)]
    assert module.vllm_rollouts.backend is None and module.vllm_rollouts.workdir is None  # closed at fit end


def test_vllm_rollouts_carry_drafter_features_from_a_target_forward(fake_vllm):
    module = make_module(rollout_backend="vllm", speculative=False, vllm={"device": "cpu"})
    module.rollout_feature_layers = (4,)

    class Check(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            for r in outputs["rollout"].rollouts:
                assert r.features is not None and r.features.shape == (r.length, 1, 64)

    make_trainer(1, callbacks=[Check()]).fit(module)


def test_speculative_vllm_rollouts_serve_the_drafter_and_refresh_it(fake_vllm):
    module = make_module(rollout_backend="vllm", drafter_kind="eagle3", vllm={"device": "cuda"})
    make_trainer(2).fit(module)
    assert fake_vllm[0].kwargs["speculative_config"]["method"] == "eagle3"
    assert [c for c in fake_vllm[0].rpc_calls if c[1] == "drafter"]  # the drafter went in with the policy


def test_on_the_cpu_sampled_speculation_on_vllm_is_refused_naming_the_defect(fake_vllm):
    module = make_module(rollout_backend="vllm", drafter_kind="eagle1", vllm={"device": "cpu"})
    with pytest.raises(
        ValueError,
        match="samples wrongly with speculative decoding.*serve sampled rollouts without a drafter",
    ):
        make_trainer(1).fit(module)


@pytest.mark.parametrize(
    "settings, error, message",
    [
        (
            {"model": "x"},
            ValueError,
            r"vllm: unknown settings \['model'\].*model and drafter are the module's",
        ),
        ({"num_speculative_tokens": 0}, ValueError, "num_speculative_tokens must be an int >= 1, got 0"),
        ({"dtype": "int8"}, ValueError, "dtype must be one of"),
    ],
)
def test_vllm_settings_are_checked_at_construction(settings, error, message):
    with pytest.raises(error, match=message):
        GRPOModule(
            model="tiny-llama",
            rollout_backend="vllm",
            vllm=settings,
            prompt_source=TokenPromptSource(PROMPTS, even_reward),
        )
    with pytest.raises(
        ValueError, match=r"rollout_backend must be one of \('engine', 'vllm'\), got 'sglang'"
    ):
        GRPOModule(model="tiny-llama", rollout_backend="sglang")
    assert check_vllm_settings(None) == {}
