"""The policy's optimizer choice, the bf16 policy's stochastically rounded AdamW, and torchao's 8-bit AdamW
state through Lightning checkpoints."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.rl.test_module import initial_params, make_module, make_trainer, params
from tlt_lightning.models import resolve_dtype
from tlt_lightning.rl.config import OptimConfig
from tlt_lightning.rl.optimizers import (
    PACKED,
    AdamWBF16,
    build_optimizer,
    pack_optimizer_states,
)


def test_adamw8bit_keeps_8_bit_moments_and_trains():
    pytest.importorskip("torchao.optim")
    from torchao.optim.subclass_8bit import OptimState8bit

    module = make_module(optimizer="adamw8bit", lr=1e-3)
    make_trainer(2).fit(module)
    embed = module.policy.get_input_embeddings().weight  # >= 4096 values: quantized moments
    state = module.trainer.optimizers[0].state[embed]
    assert isinstance(state["exp_avg"], OptimState8bit) and int(state["step"]) == 2
    assert not torch.equal(embed.detach(), initial_params()["model.embed_tokens.weight"])


def test_an_adamw8bit_fit_resumes_from_its_checkpoint_as_if_it_had_not_stopped(tmp_path):
    pytest.importorskip("torchao.optim")
    full = make_module(optimizer="adamw8bit", lr=1e-3)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    make_trainer(2, callbacks=[ckpt], enable_checkpointing=True).fit(full)
    saved = torch.load(tmp_path / "epoch=0-step=1.ckpt", weights_only=True)  # plain tensors only
    states = saved["optimizer_states"][0]["state"].values()
    packed = [v for s in states for v in s.values() if isinstance(v, dict)]
    assert packed and all(v["kind"] == PACKED for v in packed)
    resumed = make_module(optimizer="adamw8bit", lr=1e-3)
    make_trainer(2).fit(resumed, ckpt_path=tmp_path / "epoch=0-step=1.ckpt", weights_only=True)
    for name, value in params(full).items():
        assert torch.equal(params(resumed)[name], value), name


def test_packing_leaves_the_live_optimizer_state_alone():
    pytest.importorskip("torchao.optim")
    from torchao.optim import AdamW8bit

    weight = torch.nn.Parameter(torch.randn(64, 128))
    optimizer = AdamW8bit([weight])
    weight.grad = torch.randn_like(weight)
    optimizer.step()
    checkpoint = {"optimizer_states": [optimizer.state_dict()]}
    pack_optimizer_states(checkpoint)
    assert checkpoint["optimizer_states"][0]["state"][0]["exp_avg"]["kind"] == PACKED
    assert type(optimizer.state[weight]["exp_avg"]).__name__ == "OptimState8bit"


def test_adamw8bit_without_torchao_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    with pytest.raises(ImportError, match=r"tlt-lightning\[efficiency\]"):
        make_trainer(1).fit(make_module(optimizer="adamw8bit"))


def _moved(optimizer: str | None, steps: int = 50) -> float:
    """Mean change of bf16 weights ~N(0, 1) after ``steps`` AdamW steps of lr 1e-4 on a gradient of ones
    (each should move every weight by ~ -1e-4, an 80th of a bf16 step at 1); ``None``: PyTorch's AdamW."""
    weight = torch.nn.Parameter(torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).bfloat16())
    start = weight.detach().float().clone()
    opt = (
        torch.optim.AdamW([weight], lr=1e-4)
        if optimizer is None
        else build_optimizer([weight], OptimConfig(lr=1e-4, optimizer=optimizer), torch.device("cpu"))
    )
    for _ in range(steps):
        weight.grad = torch.ones_like(weight)
        opt.step()
    return float((weight.detach().float() - start).mean())


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_bf16_weights_take_updates_below_their_rounding_step_in_expectation(optimizer):
    if optimizer == "adamw8bit":
        pytest.importorskip("torchao.optim")
    assert _moved(optimizer) == pytest.approx(-50 * 1e-4, rel=0.1)
    assert abs(_moved(None)) < 0.1 * 50 * 1e-4  # the control: rounded to nearest, most updates are lost


def test_a_bf16_policy_trains_with_stochastic_rounding_and_bf16_moments():
    module = make_module(dtype="bfloat16", lr=1e-3)
    make_trainer(2).fit(module)
    (optimizer,) = module.trainer.optimizers
    embed = module.policy.get_input_embeddings().weight
    assert embed.dtype == torch.bfloat16 and isinstance(optimizer, AdamWBF16)
    assert (
        optimizer.state[embed]["exp_avg"].dtype == torch.bfloat16 and int(optimizer.state[embed]["step"]) == 2
    )
    assert not torch.equal(embed.detach().float(), initial_params()["model.embed_tokens.weight"].float())
    # The rollouts sample the updated policy: its packed weight copies were refreshed after the steps.
    hidden = torch.randn(1, 3, embed.shape[1], dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(module.rollout_target.lm_head(hidden), F.linear(hidden, embed.detach()))


def test_a_bf16_fit_resumes_from_its_checkpoint_as_if_it_had_not_stopped(tmp_path):
    full = make_module(dtype="bfloat16", lr=1e-3)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    make_trainer(2, callbacks=[ckpt], enable_checkpointing=True).fit(full)
    resumed = make_module(dtype="bfloat16", lr=1e-3)
    make_trainer(2).fit(resumed, ckpt_path=tmp_path / "epoch=0-step=1.ckpt", weights_only=True)
    for name, value in params(full).items():
        assert torch.equal(params(resumed)[name], value), name


def test_torchaos_adamw_state_resumes_in_adamw_bf16():
    """Checkpoints of bf16 policies trained before AdamWBF16 (torchao's _AdamW) resume with it."""
    optim = pytest.importorskip("torchao.optim")
    weight = torch.nn.Parameter(torch.randn(8, 16).bfloat16())
    theirs = optim._AdamW([weight], lr=1e-3, bf16_stochastic_round=True)
    weight.grad = torch.randn_like(weight)
    theirs.step()
    ours = AdamWBF16([weight], lr=1e-3)
    ours.load_state_dict(theirs.state_dict())  # lr a tensor there
    ours.step()
    state = ours.state[weight]
    assert int(state["step"]) == 2 and state["exp_avg"].dtype == torch.bfloat16
    assert set(state) == set(theirs.state[weight])


def test_adamw_bf16_rounds_by_its_seed_not_by_torchs_generator():
    """DDP replicas whose global generators drifted apart still round alike (and stay identical)."""

    def stepped(seed: int, rng_state: int) -> torch.Tensor:
        weight = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        optimizer = AdamWBF16([weight], lr=1e-3, weight_decay=0.0, seed=seed)
        torch.manual_seed(rng_state)
        for _ in range(3):
            weight.grad = torch.ones_like(weight)
            optimizer.step()
        return weight.detach()

    assert torch.equal(stepped(0, rng_state=1), stepped(0, rng_state=2))
    assert not torch.equal(stepped(0, rng_state=1), stepped(1, rng_state=1))


def test_adamw_bf16_refuses_bad_hyperparameters():
    with pytest.raises(ValueError, match=r"betas in \[0, 1\)"):
        AdamWBF16([torch.nn.Parameter(torch.zeros(2))], betas=(0.9, 1.0))


@pytest.mark.parametrize(("flags", "expected"), [(["amx_bf16"], "bfloat16"), ([], "float32")])
def test_auto_policy_dtype_is_bf16_where_bf16_is_native(monkeypatch, flags, expected):
    monkeypatch.setattr("tlt_lightning.models.hardware.cpu_bf16_instructions", lambda: flags)
    assert resolve_dtype("auto") == expected
    assert resolve_dtype("float16") == "float16"
