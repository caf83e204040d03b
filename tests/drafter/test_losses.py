from __future__ import annotations

import math

import pytest
import torch

from tlt_lightning.drafter import DrafterLoss
from tlt_lightning.drafter.losses import (
    acceptance_rate,
    draft_vocab_mass,
    feature_loss,
    soft_ce,
    top1_agreement,
)
from tlt_lightning.speculative import sample, verify_chain


def test_feature_loss_hand_computed():
    pred = torch.tensor([[0.0, 3.0], [1.0, 1.0]])
    target = torch.tensor([[0.5, 0.0], [1.0, 1.0]])
    # Row 0: 0.5 * 0.5^2 = 0.125 and 3 - 0.5 = 2.5 -> 1.3125; row 1: 0.
    assert feature_loss(pred, target).item() == pytest.approx(1.3125 / 2)
    assert feature_loss(pred, target, torch.tensor([True, False])).item() == pytest.approx(1.3125)
    assert feature_loss(pred, target, torch.tensor([False, False])).item() == 0.0


def test_soft_ce_hand_computed():
    draft = torch.tensor([[0.0, math.log(3.0)]])  # q = [1/4, 3/4]
    target = torch.tensor([[0.0, 0.0]])  # p = [1/2, 1/2]
    expected = -(0.5 * math.log(0.25) + 0.5 * math.log(0.75))
    assert soft_ce(draft, target).item() == pytest.approx(expected, rel=1e-6)
    # Reduced vocabulary: the target is restricted to the draft tokens and renormalised.
    target_full = torch.tensor([[0.0, 5.0, 0.0]])
    t2d = torch.tensor([True, False, True])
    assert soft_ce(draft, target_full, t2d=t2d).item() == pytest.approx(expected, rel=1e-6)
    # The minimum is the entropy, reached when the drafter matches the target.
    assert soft_ce(target, target).item() == pytest.approx(math.log(2.0), rel=1e-6)


def test_soft_ce_mask_and_shape_error():
    draft = torch.tensor([[0.0, 0.0], [10.0, -10.0]])
    target = torch.tensor([[0.0, 0.0], [-10.0, 10.0]])
    assert soft_ce(draft, target, torch.tensor([True, False])).item() == pytest.approx(
        math.log(2.0), rel=1e-6
    )
    with pytest.raises(
        ValueError, match=r"draft logits \[2, 2\] do not match the \(restricted\) target logits \[2, 3\]"
    ):
        soft_ce(draft, torch.zeros(2, 3))


def test_top1_agreement_with_d2t():
    draft = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])  # argmax draft ids 1, 0, 1
    d2t = torch.tensor([2, 3])  # draft 0 -> target 2, draft 1 -> target 4
    target = torch.zeros(3, 6)
    target[0, 4] = target[1, 2] = target[2, 5] = 1.0  # agree, agree, disagree
    assert top1_agreement(draft, target, d2t=d2t).item() == pytest.approx(2 / 3)
    assert top1_agreement(draft, target, torch.tensor([True, False, True]), d2t).item() == pytest.approx(0.5)


def test_acceptance_rate_hand_computed():
    draft = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])  # q = [1/4, 3/4], [1/2, 1/2]
    target = torch.tensor([[0.0, 0.0], [0.0, 0.0]])  # p = [1/2, 1/2]
    # sum(min(p, q)): 1/4 + 1/2 = 3/4, and 1 where q == p.
    assert acceptance_rate(draft, target).item() == pytest.approx(0.875)
    assert acceptance_rate(draft, target, torch.tensor([True, False])).item() == pytest.approx(0.75)
    # Reduced vocabulary: against the target renormalised on the draft tokens, as soft_ce.
    target_full = torch.tensor([[0.0, 5.0, 0.0]])
    t2d = torch.tensor([True, False, True])
    assert acceptance_rate(draft[:1], target_full, t2d=t2d).item() == pytest.approx(0.75)
    with pytest.raises(ValueError, match=r"draft logits \[2, 2\] do not match"):
        acceptance_rate(draft, torch.zeros(2, 3))


def test_acceptance_rate_is_what_speculative_sampling_accepts():
    """The metric equals the rate at which verify_chain accepts one draft sampled from q."""
    g = torch.Generator().manual_seed(0)
    B, V = 4, 7
    draft_logits, target_logits = torch.randn(B, V, generator=g) * 2, torch.randn(B, V, generator=g) * 2
    q, p = draft_logits.softmax(-1), target_logits.softmax(-1)
    n = 20_000
    qs = q.repeat(n, 1)  # [n * B, V]
    drafts = sample(qs, g)
    target_probs = p.repeat(n, 1)[:, None].expand(-1, 2, -1)  # [n * B, K + 1 = 2, V]
    result = verify_chain(target_probs, qs[:, None], drafts[:, None], g)
    empirical = result.num_accepted.float().view(n, B).mean(0)  # [B]
    expected = torch.stack(
        [acceptance_rate(draft_logits[i : i + 1], target_logits[i : i + 1]) for i in range(B)]
    )
    # Binomial standard error <= 0.5 / sqrt(n) = 0.0035: allow 5 of them.
    torch.testing.assert_close(empirical, expected, atol=0.018, rtol=0)
    assert acceptance_rate(draft_logits, target_logits).item() == pytest.approx(
        float(expected.mean()), rel=1e-6
    )


def test_with_the_vocab_mass_acceptance_is_what_sampling_accepts_from_a_reduced_vocabulary():
    """Drafts live on 5 of 9 target tokens: verify_chain with the target's full distribution accepts
    at the rate acceptance_rate gives with vocab_mass, below the renormalised rate."""
    g = torch.Generator().manual_seed(2)
    B, V = 3, 9
    t2d = torch.tensor([True, False, True, True, False, True, False, True, False])
    target_logits, draft_logits = torch.randn(B, V, generator=g) * 2, torch.randn(B, 5, generator=g) * 2
    mass = draft_vocab_mass(target_logits, t2d)
    torch.testing.assert_close(mass, target_logits.softmax(-1)[:, t2d].sum(-1))
    n = 20_000
    q = torch.zeros(B, V)
    q[:, t2d] = draft_logits.softmax(-1)
    qs = q.repeat(n, 1)
    drafts = sample(qs, g)
    target_probs = target_logits.softmax(-1).repeat(n, 1)[:, None].expand(-1, 2, -1)
    empirical = (
        verify_chain(target_probs, qs[:, None], drafts[:, None], g).num_accepted.float().view(n, B).mean(0)
    )
    expected = torch.stack(
        [
            acceptance_rate(
                draft_logits[i : i + 1], target_logits[i : i + 1], t2d=t2d, vocab_mass=mass[i : i + 1]
            )
            for i in range(B)
        ]
    )
    torch.testing.assert_close(empirical, expected, atol=0.018, rtol=0)
    renormalised = torch.stack(
        [acceptance_rate(draft_logits[i : i + 1], target_logits[i : i + 1], t2d=t2d) for i in range(B)]
    )
    assert bool((expected < renormalised - 0.02).all())
    assert draft_vocab_mass(target_logits, None).tolist() == [1.0] * B


def test_accept_weight_trains_for_acceptance():
    """Minimising the total-variation term alone drives the acceptance rate towards 1."""
    g = torch.Generator().manual_seed(1)
    target = torch.randn(8, 16, generator=g) * 3
    draft = torch.zeros(8, 16, requires_grad=True)
    loss_fn = DrafterLoss(feature_weight=0.0, ce_weight=0.0, accept_weight=1.0)
    h = torch.zeros(8, 4)
    before = acceptance_rate(draft, target).item()
    optimizer = torch.optim.Adam([draft], lr=0.1)
    for _ in range(300):
        optimizer.zero_grad()
        out = loss_fn(h, draft, h, target)
        out.loss.backward()
        optimizer.step()
    assert out.loss.item() == pytest.approx(1 - out.accept.item(), abs=1e-6)
    assert before < 0.5 and out.accept.item() > 0.97


def test_drafter_loss_combines_with_weights():
    pred, tgt = torch.tensor([[0.0, 3.0]]), torch.tensor([[0.5, 0.0]])
    draft, target = torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([[0.0, 0.0]])
    ce = -(0.5 * math.log(0.25) + 0.5 * math.log(0.75))
    out = DrafterLoss()(pred, draft, tgt, target)
    assert out.loss.item() == pytest.approx(1.3125 + 0.1 * ce, rel=1e-6)
    assert out.feature_loss.item() == pytest.approx(1.3125) and out.ce_loss.item() == pytest.approx(
        ce, rel=1e-6
    )
    assert out.top1.item() == 0.0  # the target's tie resolves to token 0, the drafter picks 1
    assert out.accept.item() == pytest.approx(0.75)
    eagle3 = DrafterLoss.for_kind("eagle3")(pred, draft, tgt, target)
    assert eagle3.loss.item() == pytest.approx(ce, rel=1e-6) and eagle3.feature_loss.item() == 0.0
    tv = DrafterLoss.for_kind("eagle1", accept_weight=2.0)(pred, draft, tgt, target)
    assert tv.loss.item() == pytest.approx(1.3125 + 0.1 * ce + 2.0 * 0.25, rel=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"feature_weight": -1.0}, r"feature_weight must be a number >= 0, got -1.0"),
        ({"feature_weight": 0.0, "ce_weight": 0.0}, "all 0: nothing to train"),
        ({"accept_weight": -0.5}, r"accept_weight must be a number >= 0, got -0.5"),
        ({"unroll_steps": 0}, r"unroll_steps must be an int >= 1, got 0"),
        ({"step_decay": 1.5}, r"step_decay must be in \(0, 1\], got 1.5"),
    ],
)
def test_drafter_loss_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DrafterLoss(**kwargs)
    with pytest.raises(ValueError, match="kind must be 'eagle1' or 'eagle3'"):
        DrafterLoss.for_kind("eagle2")
