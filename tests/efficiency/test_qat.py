"""INT4 QAT through torchao: prepare / train / convert round trip on CPU, PTQ, errors."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchao")

from tests.efficiency.lm_helpers import collate, tiny_lm, toy_dataset
from tlt_lightning.efficiency.distill import DistillConfig, HierarchicalDistillation, distill_step
from tlt_lightning.efficiency.qat import (
    Int4QATConfig,
    convert_qat,
    fake_quantized_modules,
    prepare_qat,
    quantize_ptq,
    quantized_modules,
)

LINEARS_PER_LAYER = 7  # q k v o gate up down


def _logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@pytest.mark.parametrize("activations", ["none", "int8"])
def test_prepare_train_convert_round_trip(activations):
    config = Int4QATConfig(group_size=16, activations=activations)
    student, teacher = tiny_lm(hidden=32, layers=2, seed=0), tiny_lm(hidden=64, layers=2, seed=1)
    batch = collate(toy_dataset(4))
    reference = _logits(student, batch)
    params = dict(student.named_parameters())
    prepare_qat(student, config)
    assert len(fake_quantized_modules(student)) == 2 * LINEARS_PER_LAYER  # lm_head skipped
    assert all(params[n] is p for n, p in student.named_parameters())  # same parameter objects
    fake = _logits(student, batch)
    assert (fake - reference).abs().max() > 1e-4  # the forward pass sees the rounding

    distill = HierarchicalDistillation.from_models(student, teacher, DistillConfig())
    opt = torch.optim.AdamW([*student.parameters(), *distill.parameters()], lr=1e-2)
    before = student.model.layers[0].mlp.up_proj.weight.detach().clone()
    student.train()
    for _ in range(3):  # QAT jointly with distillation: gradients pass the rounding (straight-through)
        opt.zero_grad()
        distill_step(student, teacher, distill, batch, ce_weight=1.0).total.backward()
        opt.step()
    student.eval()
    assert not torch.equal(before, student.model.layers[0].mlp.up_proj.weight.detach())
    trained_fake = _logits(student, batch)
    trained_float = {n: p.detach().clone() for n, p in student.named_parameters()}

    convert_qat(student, config)
    assert fake_quantized_modules(student) == []
    assert len(quantized_modules(student)) == 2 * LINEARS_PER_LAYER
    assert type(student.lm_head.weight) is torch.nn.Parameter  # skipped: still a plain fp32 weight
    converted = _logits(student, batch)
    # The converted model computes what training saw (int8 activations: same rounding too).
    torch.testing.assert_close(converted, trained_fake, atol=1e-4, rtol=1e-4)

    ptq = tiny_lm(hidden=32, layers=2, seed=0)
    with torch.no_grad():
        for n, p in ptq.named_parameters():
            p.copy_(trained_float[n])
    quantize_ptq(ptq, config)  # PTQ of the same weights is the same model
    torch.testing.assert_close(_logits(ptq, batch), converted, atol=1e-4, rtol=1e-4)


def test_converted_weights_hold_int4_values_per_group():
    config = Int4QATConfig(group_size=16)
    model = prepare_qat(tiny_lm(hidden=32, layers=1), config)
    convert_qat(model, config)
    weight = model.model.layers[0].mlp.down_proj.weight  # [32, 64]: 4 groups of 16 per row
    q = weight.qdata
    assert q.min() >= -8 and q.max() <= 7
    assert weight.scale.numel() == 32 * 64 // 16
    dequant = weight.dequantize()
    assert dequant.shape == (32, 64)
    # Every group of 16 holds at most 16 distinct levels.
    groups = dequant.reshape(32, 4, 16)
    assert max(len(torch.unique(g)) for g in groups.reshape(-1, 16)) <= 16


def test_per_channel_round_trip_has_one_scale_per_row():
    config = Int4QATConfig(group_size=None)
    model = tiny_lm(hidden=32, layers=1)
    batch = collate(toy_dataset(2))
    prepare_qat(model, config)
    fake = _logits(model, batch)
    convert_qat(model, config)
    weight = model.model.layers[0].mlp.down_proj.weight  # [32, 64]
    assert weight.scale.numel() == 32 and weight.qdata.min() >= -8 and weight.qdata.max() <= 7
    torch.testing.assert_close(_logits(model, batch), fake, atol=1e-4, rtol=1e-4)


def test_ptq_changes_outputs_and_skips_the_head():
    model = tiny_lm(hidden=32, layers=2)
    batch = collate(toy_dataset(2))
    before = _logits(model, batch)
    quantize_ptq(model, Int4QATConfig(group_size=32))
    assert "lm_head" not in quantized_modules(model) and len(quantized_modules(model)) == 14
    assert (_logits(model, batch) - before).abs().max() > 1e-4


def test_bad_arguments_raise_naming_them():
    with pytest.raises(
        ValueError, match=r"group_size must be an int >= 1 or None \(per output channel\), got 0"
    ):
        Int4QATConfig(group_size=0)
    with pytest.raises(ValueError, match="activations must be 'none' or 'int8', got 'int4'"):
        Int4QATConfig(activations="int4")
    model = tiny_lm(hidden=32, layers=1)
    with pytest.raises(ValueError, match=r"group_size=24 does not divide in_features \[32, 64\]"):
        prepare_qat(model, Int4QATConfig(group_size=24))
    with pytest.raises(ValueError, match="no fake-quantized module: call prepare_qat first"):
        convert_qat(model)
    with pytest.raises(ValueError, match="no nn.Linear of LlamaForCausalLM is left to quantize"):
        prepare_qat(model, Int4QATConfig(skip=("*",)))
    prepare_qat(model, Int4QATConfig(group_size=32))
    with pytest.raises(ValueError, match="already prepared for QAT"):
        prepare_qat(model, Int4QATConfig(group_size=32))
    with pytest.raises(TypeError, match="config must be an Int4QATConfig"):
        quantize_ptq(copy.deepcopy(tiny_lm()), {"group_size": 32})
