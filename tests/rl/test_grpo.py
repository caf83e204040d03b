"""GRPO math against hand-computed values: advantages, token log-probabilities, the clipped loss."""

from __future__ import annotations

import math

import pytest
import torch

from tlt_lightning.rl.grpo import group_advantages, grpo_loss, token_logprobs

# ---------------------------------------------------------------------------------- advantages


def test_group_advantages_hand_computed():
    # Group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025.
    # Group 2: all equal -> exactly 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, group_size=4, eps=0.0)
    a = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a, 0, 0, 0, 0]))


def test_group_advantages_unscaled_is_dr_grpo():
    rewards = torch.tensor([3.0, 1.0, 0.0, 0.0, 0.0, 1.5])
    adv = group_advantages(rewards, group_size=3, scale=False)
    # means 4/3 and 0.5
    torch.testing.assert_close(adv, torch.tensor([5 / 3, -1 / 3, -4 / 3, -0.5, -0.5, 1.0]))


def test_group_advantages_eps_and_constant_groups():
    # std of [0, 2] is sqrt(2); eps = 1 adds to it.
    adv = group_advantages(torch.tensor([0.0, 2.0]), group_size=2, eps=1.0)
    torch.testing.assert_close(adv, torch.tensor([-1 / (math.sqrt(2) + 1), 1 / (math.sqrt(2) + 1)]))
    # 0.1 * 3 / 3 != 0.1 in floats: the constant group must still give exactly 0, not noise / eps.
    adv = group_advantages(torch.tensor([0.1, 0.1, 0.1]), group_size=3)
    assert torch.equal(adv, torch.zeros(3))
    # A group of one has no variance.
    assert torch.equal(group_advantages(torch.tensor([1.0, 5.0]), group_size=1), torch.zeros(2))


@pytest.mark.parametrize(
    ("rewards", "G", "match"),
    [
        (torch.ones(6), 4, "not a multiple of group_size=4"),
        (torch.ones(2, 2), 2, r"rewards must be 1-D"),
        (torch.tensor([1.0, float("nan")]), 2, "finite"),
        (torch.ones(4), 0, "group_size must be an int >= 1, got 0"),
    ],
)
def test_group_advantages_errors(rewards, G, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size=G)


# ---------------------------------------------------------------------------------- log-probs


def test_token_logprobs_hand_computed():
    # probs [1/4, 3/4] and [1/2, 1/2]
    logits = torch.log(torch.tensor([[[1.0, 3.0], [2.0, 2.0]]]))
    lp = token_logprobs(logits, torch.tensor([[1, 0]]))
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.75), math.log(0.5)]]))
    # temperature 2: softmax([0, ln 3] / 2) = [1, sqrt 3] / (1 + sqrt 3)
    lp = token_logprobs(logits[:, :1], torch.tensor([[0]]), temperature=2.0)
    torch.testing.assert_close(lp, torch.tensor([[math.log(1 / (1 + math.sqrt(3)))]]))


def test_token_logprobs_matches_log_softmax_in_chunks_and_grads():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, requires_grad=True)
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    ref = (logits / 0.7).log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    lp = token_logprobs(logits, tokens, temperature=0.7, chunk_elements=23)  # 2 rows per chunk: 8 chunks
    torch.testing.assert_close(lp, ref)
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(grad, ref_grad)


def test_token_logprobs_bf16_logits_in_float32():
    logits = torch.randn(2, 3, 7).bfloat16()
    tokens = torch.zeros(2, 3, dtype=torch.long)
    lp = token_logprobs(logits, tokens)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, logits.float().log_softmax(-1)[..., 0])


def test_token_logprobs_errors():
    with pytest.raises(ValueError, match=r"logits must be \[B, T, V\] and tokens \[B, T\]"):
        token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be finite and > 0, got 0"):
        token_logprobs(torch.zeros(1, 1, 4), torch.zeros(1, 1, dtype=torch.long), temperature=0)


# ---------------------------------------------------------------------------------- the loss


def _lp(*ratios: float) -> torch.Tensor:
    return torch.log(torch.tensor([list(ratios)]))


def test_grpo_loss_positive_advantage_clips_high():
    # ratios [1.5, 0.5], A = 1, eps 0.2: min(1.5, 1.2) = 1.2 (clipped), min(0.5, 0.8) = 0.5.
    logprobs = _lp(1.5, 0.5).requires_grad_()
    out = grpo_loss(logprobs, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2))
    torch.testing.assert_close(out.loss, torch.tensor(-(1.2 + 0.5) / 2))
    torch.testing.assert_close(out.pg_loss, out.loss)
    assert float(out.clip_fraction) == 0.5
    torch.testing.assert_close(out.ratio_mean, torch.tensor(1.0))
    assert float(out.kl) == 0.0
    # Clipped token: no gradient. Unclipped: d(-r A / 2)/dlogp = -r A / 2 = -0.25.
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.25]]))


def test_grpo_loss_negative_advantage_clips_low():
    # A = -1: min(-1.5, -1.2) = -1.5, min(-0.5, -0.8) = -0.8 (clipped) -> loss (1.5 + 0.8) / 2.
    out = grpo_loss(_lp(1.5, 0.5), torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2))
    torch.testing.assert_close(out.loss, torch.tensor(1.15))
    assert float(out.clip_fraction) == 0.5


def test_grpo_loss_clip_higher():
    # eps_high 0.6: ratio 1.5 is inside [0.8, 1.6] -> not clipped.
    out = grpo_loss(
        _lp(1.5, 0.5), torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), clip_eps_high=0.6
    )
    torch.testing.assert_close(out.loss, torch.tensor(-(1.5 + 0.5) / 2))
    assert float(out.clip_fraction) == 0.0


def test_grpo_loss_k3_kl():
    # logp = 0 (ratio 1), ref = ln 2: k3 = e^{ln 2} - ln 2 - 1 = 1 - ln 2.
    logprobs = torch.zeros(1, 1, requires_grad=True)
    ref = torch.full((1, 1), math.log(2.0))
    out = grpo_loss(
        logprobs, torch.zeros(1, 1), torch.tensor([0.5]), torch.ones(1, 1), kl_coef=0.1, ref_logprobs=ref
    )
    kl = 1 - math.log(2.0)
    torch.testing.assert_close(out.kl, torch.tensor(kl))
    torch.testing.assert_close(out.pg_loss, torch.tensor(-0.5))
    torch.testing.assert_close(out.loss, torch.tensor(-0.5 + 0.1 * kl))
    # d k3 / d logp = -e^{ref - logp} + 1 = -1; d pg / d logp = -A r = -0.5.
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    torch.testing.assert_close(grad, torch.tensor([[-0.5 - 0.1]]))


def test_grpo_loss_token_vs_sequence_aggregation():
    # Ratio 1 everywhere, so per-token pg = -A. Sequence 0: A = 1, 1 token; sequence 1: A = -2, 3 tokens.
    logprobs = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    token = grpo_loss(logprobs, logprobs, adv, mask, aggregation="token")
    torch.testing.assert_close(token.loss, torch.tensor((-1.0 + 3 * 2.0) / 4))
    seq = grpo_loss(logprobs, logprobs, adv, mask, aggregation="sequence")
    torch.testing.assert_close(seq.loss, torch.tensor((-1.0 + 2.0) / 2))


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_grpo_loss_micro_batches_add_up_with_num_items(aggregation):
    g = torch.Generator().manual_seed(1)
    logprobs = torch.randn(4, 5, generator=g)
    old = logprobs + 0.3 * torch.randn(4, 5, generator=g)
    adv = torch.randn(4, generator=g)
    mask = torch.rand(4, 5, generator=g) < 0.7
    mask[:, 0] = True
    whole = grpo_loss(logprobs, old, adv, mask, aggregation=aggregation)
    n = mask.sum() if aggregation == "token" else 4
    parts = [
        grpo_loss(logprobs[i], old[i], adv[i], mask[i], aggregation=aggregation, num_items=n)
        for i in (slice(0, 1), slice(1, 4))
    ]
    torch.testing.assert_close(parts[0].loss + parts[1].loss, whole.loss)


def test_grpo_loss_errors():
    lp, adv, mask = torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"advantages must be \[B\] = \[2\], got shape \[3\]"):
        grpo_loss(lp, lp, torch.zeros(3), mask)
    with pytest.raises(ValueError, match=r"mask must have the shape of logprobs \[2, 3\], got \[2, 2\]"):
        grpo_loss(lp, lp, adv, torch.ones(2, 2))
    with pytest.raises(ValueError, match="aggregation must be one of"):
        grpo_loss(lp, lp, adv, mask, aggregation="mean")
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logprobs"):
        grpo_loss(lp, lp, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="clip_eps must be in"):
        grpo_loss(lp, lp, adv, mask, clip_eps=1.5)
