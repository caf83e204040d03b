import math
import random

import pytest

from tlt_lightning.scheduling import BEGMABStrategy, StepCosts, UCBStrategy
from tlt_lightning.scheduling.bucketed import ACCEPT_REFRESH, PROBE_EVERY
from tlt_lightning.scheduling.crossover import (
    estimate_accept,
    expected_tokens,
    paying_arms,
    predicted_speedup,
)
from tlt_lightning.speculative import DraftSpec, arm_key

CHAIN2, CHAIN4, TREE = DraftSpec(2), DraftSpec(4), DraftSpec(4, 2, 8)

# Shaped like SmolLM2 on one CPU core: a verify rides along at one row, costs its queries at seven.
COSTS = StepCosts(
    {
        1: {"off": 0.024, "chain2": 0.030, "chain4": 0.038, "tree4x2/8": 0.045},
        7: {"off": 0.031, "chain2": 0.068, "chain4": 0.100, "tree4x2/8": 0.150},
    },
    context=480,
)


def sample_tokens(arm: DraftSpec, alpha: float, rng: random.Random) -> int:
    """Tokens one request emits in a chain step when each draft is accepted with probability ``alpha``."""
    accepted = 0
    while accepted < arm.num_steps and rng.random() < alpha:
        accepted += 1
    return accepted + 1


def test_expected_tokens_of_a_chain_is_the_truncated_geometric_sum():
    for k in (1, 2, 6):
        for alpha in (0.0, 0.3, 0.9):
            assert expected_tokens(DraftSpec(k), alpha) == pytest.approx(sum(alpha**i for i in range(k + 1)))
    assert expected_tokens(DraftSpec(3), 1.0) == 4.0
    # Siblings give a rejected draft another chance: a tree of the same depth emits more.
    assert expected_tokens(DraftSpec(4, 2, sampled=True), 0.6) > expected_tokens(CHAIN4, 0.6)
    assert expected_tokens(TREE, 0.6) > expected_tokens(CHAIN4, 0.6)


@pytest.mark.parametrize("alpha", [0.35, 0.64, 0.85])
def test_estimate_accept_recovers_the_acceptance_from_steps_of_several_arms(alpha):
    rng = random.Random(0)
    steps = []
    for i in range(3000):
        arm = (CHAIN2, CHAIN4, DraftSpec(6))[i % 3]
        n = 1 + i % 5
        steps.append((arm, sum(sample_tokens(arm, alpha, rng) for _ in range(n)) / n, n))
    assert estimate_accept(steps) == pytest.approx(alpha, abs=0.02)
    assert math.isnan(estimate_accept([(None, 1.0, 4)]))  # plain steps say nothing of the drafter


def test_step_costs_interpolate_between_batch_sizes_and_round_trip(tmp_path):
    assert COSTS.step_seconds(4, CHAIN2) == pytest.approx(0.030 + 0.038 * 3 / 6)
    assert COSTS.step_seconds(1, None) == 0.024
    assert COSTS.step_seconds(12, None) == 0.031  # beyond the measured sizes: the nearest one's
    assert COSTS.step_seconds(3, DraftSpec(6)) is None  # never measured
    assert StepCosts.load(COSTS.save(tmp_path / "costs.json")) == COSTS
    with pytest.raises(ValueError, match="finite and > 0"):
        StepCosts({1: {"off": 0.0}}, 10)
    with pytest.raises(ValueError, match="batch sizes >= 1"):
        StepCosts({}, 10)


def test_paying_arms_keep_plain_and_unmeasured_arms_and_drop_predicted_losers():
    assert predicted_speedup(COSTS, 7, CHAIN2, 0.64) < 1 < predicted_speedup(COSTS, 1, CHAIN2, 0.64)
    arms = [None, CHAIN2, CHAIN4, TREE, DraftSpec(6)]
    assert paying_arms(COSTS, arms, 1, 0.64) == tuple(arms)
    assert paying_arms(COSTS, arms, 7, 0.64) == (None, DraftSpec(6))
    assert paying_arms(COSTS, arms, 7, 0.75) == (None, CHAIN2, DraftSpec(6))  # a better drafter pays there


def drive(strategy, batch_size: int, alpha: float, steps: int, rng: random.Random, costs=COSTS) -> list[str]:
    """Decode ``steps`` steps at ``batch_size`` with acceptance ``alpha``; the arms chosen."""
    chosen = []
    for _ in range(steps):
        arm = strategy.select(batch_size)
        tokens = 1.0 if arm is None else sample_tokens(arm, alpha, rng)
        seconds = costs.step_seconds(batch_size, arm) or 0.05
        strategy.update(batch_size, arm, tokens, seconds)
        chosen.append(arm_key(arm))
    return chosen


@pytest.mark.parametrize("cls", [BEGMABStrategy, UCBStrategy])
def test_a_strategy_with_step_costs_tries_a_predicted_loser_only_as_a_probe(cls):
    strategy = cls([None, CHAIN2, CHAIN4, TREE], (1, 2, 5))
    strategy.use_step_costs(COSTS, accept=0.64)
    rng = random.Random(1)
    chosen = drive(strategy, 7, 0.64, 200, rng)
    probes = [d for d in strategy.history if d.mode == "probe"]
    # Only a probe every PROBE_EVERY selections runs speculation there (the one predicted closest).
    assert chosen.count("off") == 200 - len(probes) and len(probes) == 200 // (PROBE_EVERY + 1)
    assert {d.arm for d in probes} == {CHAIN2} and strategy.candidates(7) == (None,)
    assert "chain2" in drive(strategy, 1, 0.64, 200, rng)  # where a verify rides along, arms are tried
    # Its acceptance estimate follows the steps it sees: a drafter at 0.97 makes chain 2 pay at 7 rows.
    drive(strategy, 1, 0.97, 600, rng)
    assert strategy.accept_estimate > 0.9
    assert CHAIN2 in strategy.candidates(7)
    strategy.use_step_costs(None)
    assert strategy.candidates(7) == tuple(strategy.arms[2])


def test_an_estimate_fallen_below_every_crossover_recovers_through_probes():
    # Verifies cost more here (chain 2 needs alpha ~0.47 at one row): a poor start prunes every arm.
    costs = StepCosts({1: {"off": 0.024, "chain2": 0.040, "chain4": 0.055}}, context=480)
    strategy = BEGMABStrategy([None, CHAIN2, CHAIN4], (1, 2, 5), seed=0)
    strategy.use_step_costs(costs, accept=0.64)
    rng = random.Random(1)
    drive(strategy, 1, 0.1, 300, rng, costs)
    assert strategy.accept_estimate < 0.47 and strategy.candidates(1) == (None,)
    # The drafter learns: probes see it, the estimate follows, and speculation comes back.
    drive(strategy, 1, 0.9, 600, rng, costs)
    assert strategy.accept_estimate > 0.8 and strategy.candidates(1) == (None, CHAIN2, CHAIN4)
    assert drive(strategy, 1, 0.9, 300, rng, costs).count("off") < 30


def test_the_prior_acceptance_outweighs_a_few_early_steps():
    strategy = BEGMABStrategy([None, CHAIN2], (1,), seed=0)
    strategy.use_step_costs(COSTS, accept=0.64)
    for _ in range(ACCEPT_REFRESH):  # one refresh's worth of chain-2 steps that accept nothing
        strategy.update(1, CHAIN2, 1.0, 0.03)
    assert 0.3 < strategy.accept_estimate < 0.64


def test_without_step_costs_the_bandit_decides_as_before():
    plain, costed = BEGMABStrategy(seed=3), BEGMABStrategy(seed=3)
    costed.use_step_costs(COSTS)
    costed.use_step_costs(None)
    assert drive(plain, 3, 0.6, 300, random.Random(5)) == drive(costed, 3, 0.6, 300, random.Random(5))


def test_use_step_costs_refuses_nonsense():
    strategy = BEGMABStrategy()
    with pytest.raises(ValueError, match="accept must be a probability"):
        strategy.use_step_costs(COSTS, accept=1.0)
    with pytest.raises(ValueError, match="margin must be > 0"):
        strategy.use_step_costs(COSTS, margin=0)
    with pytest.raises(TypeError, match="StepCosts or None"):
        strategy.use_step_costs({"1": {"off": 0.1}})
