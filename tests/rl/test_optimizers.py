"""The policy's optimizer choice, and torchao's 8-bit AdamW state through Lightning checkpoints."""

from __future__ import annotations

import sys

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.rl.test_module import initial_params, make_module, make_trainer, params
from tlt_lightning.rl.optimizers import PACKED, pack_optimizer_states


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
