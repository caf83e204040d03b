"""What speculation saved against plain decoding, and the paid drafter training it funds."""

from __future__ import annotations

import pytest

from tlt_lightning.rollout.types import RolloutStats
from tlt_lightning.spot import SpotTrainerConfig
from tlt_lightning.spot.savings import PlainStepCost, SavingsAccount, speculation_savings


def stats(steps: list[tuple[int, float, int, bool]]) -> RolloutStats:
    """A rollout's stats from ``(rows, seconds, tokens, speculative)`` per decode step."""
    rows, times, tokens, spec = (list(x) for x in zip(*steps))
    return RolloutStats(step_batch_sizes=rows, step_times=times, step_tokens=tokens, step_speculative=spec)


def test_plain_cost_recovers_an_affine_step_time_and_extrapolates():
    cost = PlainStepCost()
    assert cost.seconds(4) == 0.0 and not cost.seconds_known
    cost.observe([(8, 0.050), (8, 0.054)])
    assert cost.seconds(1) == pytest.approx(0.052)  # one batch size: its mean
    fitted = PlainStepCost()
    fitted.observe([(b, 0.040 + 0.002 * b) for b in (8, 16, 32, 32)])
    assert fitted.seconds(1) == pytest.approx(0.042)  # below every observed size
    assert fitted.seconds(64) == pytest.approx(0.168)
    copy = PlainStepCost()
    copy.load_state_dict(fitted.state_dict())
    assert copy.seconds(3) == fitted.seconds(3)


def test_savings_count_each_speculative_step_against_the_plain_steps_it_replaced():
    cost = PlainStepCost()
    cost.observe([(1, 0.040), (4, 0.046)])  # 0.038 + 0.002 b
    rollout = stats([(4, 0.046, 4, False), (4, 0.060, 10, True), (1, 0.050, 3, True)])
    # 10 tokens at 4 rows = 2.5 plain steps of 0.046; 3 tokens at 1 row = 3 plain steps of 0.040.
    assert speculation_savings(rollout, cost) == pytest.approx(2.5 * 0.046 - 0.060 + 3 * 0.040 - 0.050)
    losing = stats([(2, 0.080, 2, True)])  # one token a row, slower than a plain step
    assert speculation_savings(losing, cost) == pytest.approx(0.042 - 0.080)
    assert speculation_savings(rollout, PlainStepCost()) == 0.0  # no plain step known: no claim


def test_the_account_credits_its_share_debits_losses_and_survives_a_round_trip():
    account = SavingsAccount(share=0.5)
    saved = account.deposit(stats([(2, 0.040, 2, False), (1, 0.038, 1, False), (1, 0.050, 3, True)]))
    # The plain steps of the same rollout price its speculative ones: 3 x 0.038 - 0.050.
    assert saved == pytest.approx(3 * 0.038 - 0.050) and account.budget_s() == pytest.approx(saved / 2)
    account.withdraw(0.02)
    lost = account.deposit(stats([(1, 0.2, 1, True)]))
    assert lost < 0 and account.budget_s() == pytest.approx(saved / 2 - 0.02 + lost / 2)
    copy = SavingsAccount(share=0.5)
    copy.load_state_dict(account.state_dict())
    assert copy.budget_s() == account.budget_s() and copy.cost.seconds(3) == account.cost.seconds(3)
    unbounded = SavingsAccount()  # no share: savings measured, no credit kept
    assert unbounded.deposit(stats([(1, 0.04, 1, False), (1, 0.05, 3, True)])) > 0
    unbounded.withdraw(5.0)
    assert unbounded.budget_s() is None


@pytest.mark.parametrize("share", [0, -1.0, float("nan"), "half"])
def test_a_bad_share_is_refused(share):
    with pytest.raises(ValueError, match="paid_share_of_savings"):
        SpotTrainerConfig(paid_share_of_savings=share)
