"""The efficiency callbacks inside a real (tiny) Lightning fit."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from tlt_lightning.efficiency import host_memory
from tlt_lightning.efficiency.activation_checkpointing import is_activation_checkpointed
from tlt_lightning.efficiency.callbacks import (
    ActivationCheckpointingCallback,
    HostMemoryCallback,
    LayerwisePrecisionCallback,
)
from tlt_lightning.efficiency.memory import measure_step
from tlt_lightning.efficiency.precision import PrecisionConfig
from tlt_lightning.models import load_model


class TinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = load_model("tiny-llama", seed=0).model.train()
        self.seen_checkpointed: list[list[bool]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen_checkpointed.append([is_activation_checkpointed(b) for b in self.model.model.layers])
        loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(module: L.LightningModule, callback: L.Callback, steps: int = 3) -> L.Trainer:
    data = torch.randint(3, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return trainer


def test_dynamic_checkpointing_callback_profiles_applies_and_removes():
    module = TinyLM()
    callback = ActivationCheckpointingCallback(budget_fraction=0.6, blocks="model.model.layers.*", repeats=1)
    trainer = _fit(module, callback)
    plan = callback.plan
    assert plan is not None and any(plan.checkpointed)
    # Profiling calls training_step without checkpointing; the real steps run with the plan.
    assert module.seen_checkpointed[-1] == list(plan.checkpointed)
    assert trainer.callback_metrics["checkpoint/blocks"] == len(plan.indices)
    assert not any(is_activation_checkpointed(b) for b in module.model.model.layers)  # undone at teardown
    state = callback.state_dict()
    resumed = ActivationCheckpointingCallback(budget_fraction=0.6, blocks="model.model.layers.*")
    resumed.load_state_dict(state)
    resumed.load_state_dict({})  # missing keys are tolerated
    module2 = TinyLM()
    _fit(module2, resumed, steps=1)
    assert module2.seen_checkpointed == [list(plan.checkpointed)]  # reused without profiling
    # Another budget: refused, or applied (a new plan, profiled again), never the old plan silently.
    other = ActivationCheckpointingCallback(budget_fraction=1.0, blocks="model.model.layers.*", repeats=1)
    match = r"ActivationCheckpointingCallback.budget_fraction: 0.6 -> 1.0\n.*resume_overrides=apply"
    with pytest.raises(ValueError, match=match):
        other.load_state_dict(state)
    other.resume_overrides = "apply"
    other.load_state_dict(state)
    module3 = TinyLM()
    _fit(module3, other, steps=1)
    assert not any(other.plan.checkpointed) and module3.seen_checkpointed[-1] == [False] * len(
        plan.checkpointed
    )


def test_dynamic_checkpointing_callback_budget_holds():
    module = TinyLM()
    callback = ActivationCheckpointingCallback(
        budget_fraction=0.5, repeats=1
    )  # blocks: the longest ModuleList
    _fit(module, callback, steps=1)
    from tlt_lightning.efficiency.activation_checkpointing import apply_activation_checkpointing

    ids = torch.randint(3, 128, (4, 32))
    with apply_activation_checkpointing(list(module.model.model.layers), callback.plan):
        measured = measure_step(lambda: module.model(input_ids=ids, labels=ids, use_cache=False).loss)
    assert measured.peak_bytes <= callback.plan.peak_bytes


def test_dynamic_checkpointing_callback_rejects_bad_budget():
    with pytest.raises(ValueError, match="exactly one of memory_budget and budget_fraction"):
        ActivationCheckpointingCallback()
    with pytest.raises(ValueError, match=r"budget_fraction must be a number in \(0, 1\]"):
        ActivationCheckpointingCallback(budget_fraction=2.0)
    module = TinyLM()
    with pytest.raises(ValueError, match="budget_fraction=0.01 gives memory_budget="):
        _fit(module, ActivationCheckpointingCallback(budget_fraction=0.01, repeats=1), steps=1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_layerwise_precision_callback(dtype):
    module = TinyLM()
    callback = LayerwisePrecisionCallback(PrecisionConfig(compute_dtype=dtype), module="model")
    trainer = _fit(module, callback)
    assert torch.isfinite(trainer.callback_metrics["loss"])
    assert not any("forward" in m.__dict__ for m in module.modules())  # undone at teardown
    if dtype == "float16":
        assert trainer.callback_metrics["precision/scale/attention"] == 2.0**16
        assert callback.state_dict()["scalers"]["mlp"]["scale"] == 2.0**16
        assert callback.skipped_steps == 0
        state = callback.state_dict()
        other = LayerwisePrecisionCallback(PrecisionConfig(compute_dtype="bfloat16"), module="model")
        with pytest.raises(
            ValueError, match=r"LayerwisePrecisionCallback.config.compute_dtype: 'float16' -> 'bf"
        ):
            other.load_state_dict(state)
        other.resume_overrides = "apply"
        other.load_state_dict(state)
        assert other.skipped_steps == 0


def test_layerwise_precision_callback_skips_overflowing_steps():
    module = TinyLM()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    callback = LayerwisePrecisionCallback(PrecisionConfig(compute_dtype="float16", init_scale=2.0**60))
    _fit(module, callback, steps=2)
    assert callback.skipped_steps == 2  # 2^60 overflows fp16 in every group: nothing was updated
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert all(s["scale"] == 2.0**58 for s in callback.state_dict()["scalers"].values())
    with pytest.raises(ValueError, match="module='policy' is not a submodule"):
        _fit(TinyLM(), LayerwisePrecisionCallback(module="policy"), steps=1)


def test_host_memory_callback_sets_the_threshold_trims_every_step_and_logs_rss(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "set_mmap_threshold", lambda n: calls.append(("threshold", n)) or True)
    monkeypatch.setattr(host_memory, "trim", lambda: calls.append(("trim",)) or True)
    monkeypatch.setattr(host_memory, "glibc", lambda: object())
    trainer = _fit(TinyLM(), HostMemoryCallback(mmap_threshold=65536), steps=3)
    assert calls == [("threshold", 65536)] + [("trim",)] * 3
    assert trainer.callback_metrics["memory/rss_mb"] > 10


def test_host_memory_callback_refuses_a_bad_threshold_and_warns_without_glibc(monkeypatch):
    with pytest.raises(ValueError, match="mmap threshold"):
        HostMemoryCallback(mmap_threshold=2**30)
    monkeypatch.setattr(host_memory, "glibc", lambda: None)
    monkeypatch.setattr(host_memory, "trim", lambda: False)
    with pytest.warns(UserWarning, match="not glibc"):
        _fit(TinyLM(), HostMemoryCallback(), steps=1)
