"""The sampler, distillation and QAT inside real (tiny) Lightning fits."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from tests.efficiency.lm_helpers import collate, tiny_lm, toy_dataset
from tlt_lightning.efficiency.distill import DistillConfig
from tlt_lightning.efficiency.sampler import ImportanceSampler, ImportanceSamplerConfig, LossScorer
from tlt_lightning.efficiency.training import DistillationModule, ImportanceSamplingCallback, QATCallback


class SFTModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_lm(seed=0).train()
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"])
        return self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        ).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _trainer(steps: int, callbacks: list[L.Callback], **kwargs) -> L.Trainer:
    args = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(max_steps=steps, callbacks=callbacks, **{**args, **kwargs})


def test_importance_sampler_as_a_lightning_data_hook_trains_the_proxy():
    data, proxy = toy_dataset(40), tiny_lm(seed=5)
    sampler = ImportanceSampler(
        len(data), LossScorer(proxy, data, collate), ImportanceSamplerConfig(batch_size=4, temperature=0.5)
    )
    callback = ImportanceSamplingCallback(sampler, proxy=proxy)
    before = proxy.model.layers[0].mlp.up_proj.weight.detach().clone()
    module = SFTModule()
    trainer = _trainer(3, [callback])
    trainer.fit(module, DataLoader(data, batch_sampler=sampler, collate_fn=collate))
    assert len(module.seen) == 3 and all(b.shape[0] == 4 for b in module.seen)
    metrics = trainer.callback_metrics
    assert {"sampler/selected_score", "sampler/candidate_score", "sampler/proxy_loss"} <= set(metrics)
    assert not torch.equal(before, proxy.model.layers[0].mlp.up_proj.weight)  # the proxy learnt
    state = callback.state_dict()
    assert state["sampler"]["batches_drawn"] >= 3
    callback.load_state_dict({})  # missing keys are tolerated


def test_callback_rejects_an_optimizer_without_a_proxy():
    sampler = ImportanceSampler(8, lambda idx: torch.zeros(len(idx)), ImportanceSamplerConfig(batch_size=2))
    with pytest.raises(ValueError, match="proxy_optimizer was given without a proxy"):
        ImportanceSamplingCallback(
            sampler, proxy_optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1)
        )


def test_distillation_module_with_qat_callback_converts_at_the_end():
    pytest.importorskip("torchao")
    from tlt_lightning.efficiency.qat import Int4QATConfig, fake_quantized_modules, quantized_modules

    student, teacher = tiny_lm(hidden=32, layers=2, seed=0), tiny_lm(hidden=64, layers=4, seed=1)
    teacher_state = {k: v.clone() for k, v in teacher.state_dict().items()}
    module = DistillationModule(student, teacher, DistillConfig(hidden_loss="cosine"), ce_weight=0.5)
    projection = module.distill.projections[0].weight.detach().clone()
    callback = QATCallback(Int4QATConfig(group_size=16), module="student")
    trainer = _trainer(3, [callback])
    trainer.fit(module, DataLoader(toy_dataset(12), batch_size=4, collate_fn=collate))
    assert callback.converted and fake_quantized_modules(student) == []
    assert len(quantized_modules(student)) == 14
    assert not teacher.training and all(
        torch.equal(v, teacher.state_dict()[k]) for k, v in teacher_state.items()
    )
    assert not torch.equal(projection, module.distill.projections[0].weight)  # projections train too
    assert {"distill/kl", "distill/hidden", "distill/ce"} <= set(trainer.callback_metrics)


def test_qat_callback_names_a_missing_module():
    pytest.importorskip("torchao")
    module = DistillationModule(tiny_lm(), tiny_lm(hidden=64, layers=4), DistillConfig.logits_only())
    with pytest.raises(ValueError, match="module='policy' is not a submodule of DistillationModule"):
        _trainer(1, [QATCallback(module="policy")]).fit(
            module, DataLoader(toy_dataset(4), batch_size=2, collate_fn=collate)
        )


class StudentAtStart(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.state = {k: v.clone() for k, v in pl_module.state_dict().items()}


def test_distillation_checkpoints_hold_no_teacher_and_resume(tmp_path):
    teacher = tiny_lm(hidden=64, layers=4, seed=1)
    teacher_state = {k: v.clone() for k, v in teacher.state_dict().items()}
    module = DistillationModule(tiny_lm(seed=0), teacher, DistillConfig(hidden_loss="cosine"))
    # Not a submodule: out of parameters() (so of DDP's buckets and broadcasts) and of state_dict().
    assert {id(p) for p in module.parameters()}.isdisjoint(id(p) for p in teacher.parameters())
    assert not any(k.startswith("teacher.") for k in module.state_dict())
    loader = DataLoader(toy_dataset(12), batch_size=4, collate_fn=collate)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    _trainer(2, [ckpt], enable_checkpointing=True).fit(module, loader)
    saved = torch.load(tmp_path / "epoch=0-step=1.ckpt", weights_only=False)
    keys = list(saved["state_dict"])
    assert not any(k.startswith("teacher.") for k in keys)
    assert any(k.startswith("student.") for k in keys) and any(k.startswith("distill.") for k in keys)
    assert not teacher.training and all(
        torch.equal(v, teacher.state_dict()[k]) for k, v in teacher_state.items()
    )

    # Resume: a fresh module with the same teacher, the student and projections from the checkpoint.
    resumed, start = (
        DistillationModule(tiny_lm(seed=9), teacher, DistillConfig(hidden_loss="cosine")),
        StudentAtStart(),
    )
    trainer = _trainer(3, [start])
    trainer.fit(resumed, loader, ckpt_path=tmp_path / "epoch=0-step=1.ckpt")
    assert trainer.global_step == 3
    assert start.state.keys() == saved["state_dict"].keys()
    assert all(torch.equal(start.state[k], v) for k, v in saved["state_dict"].items())
    # A checkpoint that still holds teacher weights (older versions saved them) loads as well.
    saved["state_dict"].update({f"teacher.{k}": v for k, v in teacher_state.items()})
    torch.save(saved, tmp_path / "old.ckpt")
    old = DistillationModule(tiny_lm(seed=9), teacher, DistillConfig(hidden_loss="cosine"))
    _trainer(2, []).fit(old, loader, ckpt_path=tmp_path / "old.ckpt")
    # It still moves with the module (device and dtype), as Lightning moves the student.
    module.to(torch.float64)
    assert {p.dtype for p in teacher.parameters()} == {torch.float64}
