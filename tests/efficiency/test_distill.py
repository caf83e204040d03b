"""Hierarchical distillation: losses against hand-computed values, layer maps, projections, a step."""

from __future__ import annotations

import math

import pytest
import torch

from tests.efficiency.lm_helpers import collate, tiny_lm, toy_dataset
from tlt_lightning.efficiency.distill import (
    DistillConfig,
    HierarchicalDistillation,
    distill_step,
    hidden_state_loss,
    kd_kl_loss,
    proportional_layer_map,
)


def test_kd_kl_loss_by_hand():
    # Teacher logits (ln 9, 0) at T = 2 -> p = (3/4, 1/4); student logits 0 -> q = (1/2, 1/2).
    teacher = torch.tensor([[[math.log(9), 0.0]]])
    student = torch.zeros(1, 1, 2)
    kl = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert float(kd_kl_loss(student, teacher, 2.0)) == pytest.approx(4 * kl, rel=1e-6)  # T^2 = 4
    assert float(kd_kl_loss(teacher, teacher, 3.0)) == pytest.approx(0.0, abs=1e-7)
    # T = 1: no scaling; KL(p || q) with p = (9/10, 1/10), q = (1/2, 1/2).
    kl1 = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert float(kd_kl_loss(student, teacher, 1.0)) == pytest.approx(kl1, rel=1e-6)


def test_kd_kl_loss_averages_over_the_mask():
    teacher = torch.tensor([[[math.log(9), 0.0], [0.0, 5.0], [0.0, 0.0]]])
    student = torch.zeros(1, 3, 2)
    per_position = [float(kd_kl_loss(student[:, i : i + 1], teacher[:, i : i + 1], 2.0)) for i in range(3)]
    mask = torch.tensor([[1, 0, 1]])
    got = float(kd_kl_loss(student, teacher, 2.0, mask))
    assert got == pytest.approx((per_position[0] + per_position[2]) / 2, rel=1e-6)
    assert float(kd_kl_loss(student, teacher, 2.0)) == pytest.approx(sum(per_position) / 3, rel=1e-6)


def test_kd_kl_loss_sends_no_gradient_to_the_teacher():
    teacher = torch.randn(2, 3, 5, requires_grad=True)
    student = torch.randn(2, 3, 5, requires_grad=True)
    kd_kl_loss(student, teacher, 2.0).backward()
    assert teacher.grad is None and student.grad.abs().sum() > 0


def test_hidden_state_losses_by_hand():
    s = torch.tensor([[[1.0, 2.0], [1.0, 0.0]]])
    t = torch.tensor([[[0.0, 0.0], [0.0, 1.0]]])
    # mse: position 0 (1 + 4) / 2 = 2.5, position 1 (1 + 1) / 2 = 1 -> 1.75.
    assert float(hidden_state_loss(s, t, "mse")) == pytest.approx(1.75)
    assert float(hidden_state_loss(s, t, "mse", torch.tensor([[0, 1]]))) == pytest.approx(1.0)
    # cosine: [1, 0] vs [0, 1] is orthogonal (1), [1, 1] vs [2, 2] parallel (0).
    a = torch.tensor([[[1.0, 0.0], [1.0, 1.0]]])
    b = torch.tensor([[[0.0, 1.0], [2.0, 2.0]]])
    assert float(hidden_state_loss(a, b, "cosine")) == pytest.approx(0.5, abs=1e-6)
    with pytest.raises(ValueError, match="kind must be 'mse' or 'cosine', got 'l1'"):
        hidden_state_loss(a, b, "l1")


def test_normalized_hidden_state_loss_ignores_scale_by_hand():
    # layer_norm over features: [1, 3] and [0, 8] both become [-1, 1]; [4, 0] becomes [1, -1].
    s = torch.tensor([[[1.0, 3.0]]])
    assert float(hidden_state_loss(s, torch.tensor([[[0.0, 8.0]]]), "mse")) == pytest.approx(13.0)
    assert float(hidden_state_loss(s, torch.tensor([[[0.0, 8.0]]]), "mse", normalize=True)) == pytest.approx(
        0.0, abs=1e-4
    )
    assert float(hidden_state_loss(s, torch.tensor([[[4.0, 0.0]]]), "mse", normalize=True)) == pytest.approx(
        4.0, rel=1e-4
    )
    big = torch.tensor([[[5.0, -3.0, 9.0]]])
    assert float(hidden_state_loss(big, 100 * big, "mse", normalize=True)) == pytest.approx(0.0, abs=1e-4)


def test_proportional_layer_map():
    assert proportional_layer_map(4, 8) == {1: 2, 2: 4, 4: 8}
    assert proportional_layer_map(6, 30) == {2: 8, 3: 15, 6: 30}  # round(1.5) = 2 (banker's), round(7.5) = 8
    assert proportional_layer_map(2, 2, (0.1, 1.0)) == {1: 1, 2: 2}


def test_a_layer_map_to_a_missing_layer_raises_naming_it():
    with pytest.raises(
        ValueError, match=r"layer_map entry 2: 9 points to teacher layer 9, which does not exist"
    ):
        HierarchicalDistillation(DistillConfig(layer_map={2: 9}), 4, 8, 32, 64)
    with pytest.raises(
        ValueError, match=r"layer_map entry 5: 8 points to student layer 5, which does not exist"
    ):
        HierarchicalDistillation(DistillConfig(layer_map={5: 8}), 4, 8, 32, 64)
    with pytest.raises(ValueError, match=r"layer_map entries must be ints >= 0, got -1: 2"):
        DistillConfig(layer_map={-1: 2})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 0.0}, "temperature must be a finite number > 0, got 0.0"),
        ({"hidden_loss": "l2"}, "hidden_loss must be 'mse' or 'cosine', got 'l2'"),
        ({"kl_weight": -1.0}, "kl_weight must be a finite number >= 0, got -1.0"),
        ({"fractions": (0.0, 1.0)}, r"fractions must be numbers in \(0, 1\], got 0.0"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistillConfig(**kwargs)
    with pytest.raises(TypeError, match="normalize_hidden must be a bool, got 1"):
        DistillConfig(normalize_hidden=1)


def test_total_loss_by_hand_with_known_projections():
    d = HierarchicalDistillation(
        DistillConfig(
            layer_map={1: 2, 2: 4}, hidden_weight=0.5, kl_weight=2.0, temperature=2.0, normalize_hidden=False
        ),
        2,
        4,
        2,
        3,
    )
    assert all(isinstance(p, torch.nn.Linear) for p in d.projections)
    with torch.no_grad():  # projection 0 pads with a zero, projection 1 is zero
        d.projections[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
        d.projections[1].weight.zero_()
    s_hidden = [torch.zeros(1, 1, 2), torch.tensor([[[1.0, 2.0]]]), torch.ones(1, 1, 2)]
    t_hidden = [torch.zeros(1, 1, 3)] * 2 + [
        torch.tensor([[[1.0, 0.0, 3.0]]]),
        torch.zeros(1, 1, 3),
        torch.tensor([[[3.0, 0.0, 0.0]]]),
    ]
    s_logits, t_logits = torch.zeros(1, 1, 2), torch.tensor([[[math.log(9), 0.0]]])
    with torch.no_grad():
        out = d(s_logits, t_logits, s_hidden, t_hidden)
    layer0 = ((1 - 1) ** 2 + (2 - 0) ** 2 + (0 - 3) ** 2) / 3  # [1, 2, 0] vs [1, 0, 3]
    layer1 = 9 / 3  # [0, 0, 0] vs [3, 0, 0]
    kl = 4 * (0.75 * math.log(1.5) + 0.25 * math.log(0.5))
    torch.testing.assert_close(out.per_layer, torch.tensor([layer0, layer1]))
    assert float(out.total) == pytest.approx(2.0 * kl + 0.5 * (layer0 + layer1) / 2, rel=1e-6)
    same = HierarchicalDistillation(DistillConfig(), 4, 8, 32, 32)
    assert all(isinstance(p, torch.nn.Identity) for p in same.projections)


def test_default_hidden_loss_ignores_the_teacher_scale():
    d = HierarchicalDistillation(DistillConfig(layer_map={1: 1}), 1, 1, 4, 4)  # identity projection
    g = torch.Generator().manual_seed(0)
    s_hidden = [torch.randn(2, 3, 4, generator=g) for _ in range(2)]
    t_hidden = [torch.randn(2, 3, 4, generator=g) for _ in range(2)]
    logits = torch.zeros(2, 3, 5)
    out = d(logits, logits, s_hidden, t_hidden).per_layer
    scaled = d(logits, logits, s_hidden, [7 * h for h in t_hidden]).per_layer  # a deeper, larger stream
    torch.testing.assert_close(out, scaled, atol=1e-4, rtol=1e-4)
    expected = hidden_state_loss(s_hidden[1], t_hidden[1], "mse", normalize=True)
    torch.testing.assert_close(out[0], expected)


def test_logits_only_is_the_kl_alone():
    d = HierarchicalDistillation(DistillConfig.logits_only(temperature=2.0), 2, 4, 2, 3)
    assert not d.needs_hidden_states and len(d.projections) == 0
    s, t = torch.zeros(1, 1, 2), torch.tensor([[[math.log(9), 0.0]]])
    out = d(s, t)
    assert float(out.total) == pytest.approx(float(out.kl)) and float(out.hidden) == 0.0


def test_distill_step_trains_student_and_projections_not_the_teacher():
    student, teacher = tiny_lm(hidden=32, layers=2, seed=0).train(), tiny_lm(hidden=64, layers=4, seed=1)
    teacher.requires_grad_(False)
    batch = collate(toy_dataset(4))
    d = HierarchicalDistillation.from_models(student, teacher, DistillConfig(hidden_loss="cosine"))
    assert d.layer_map == ((1, 2), (2, 4))  # N/4 and N/2 of a 2-layer student are both layer 1
    out = distill_step(student, teacher, d, batch, ce_weight=0.7)
    assert out.hidden.item() > 0 and out.kl.item() > 0
    # The CE part is the token-mean label loss: HF's own loss on the same labels.
    with torch.no_grad():
        hf = student(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        ).loss
    assert out.ce.item() == pytest.approx(hf.item(), rel=1e-5)
    assert out.total.item() == pytest.approx((out.kl + out.hidden + 0.7 * out.ce).item(), rel=1e-6)
    out.total.backward()
    assert all(p.grad is not None for p in d.parameters())
    assert all(p.grad is None for p in teacher.parameters())
    assert student.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0


def test_distill_step_rejects_a_negative_ce_weight():
    student, teacher = tiny_lm(), tiny_lm(hidden=64, layers=4)
    d = HierarchicalDistillation.from_models(student, teacher)
    with pytest.raises(ValueError, match="ce_weight must be a finite number >= 0, got -1"):
        distill_step(student, teacher, d, collate(toy_dataset(2)), ce_weight=-1)
