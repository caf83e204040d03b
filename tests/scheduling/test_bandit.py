"""BEGMABStrategy and its baselines on the simulated environment: convergence, adaptation, state, errors."""

from __future__ import annotations

import json
import math
import random

import pytest

from tlt_lightning.scheduling import BEGMABStrategy, FixedStrategy, SimulatedSDEnvironment, UCBStrategy
from tlt_lightning.scheduling.bucketed import default_arms
from tlt_lightning.scheduling.simulate import run_strategy
from tlt_lightning.speculative import DraftSpec, DraftStrategy, arm_key

CHAIN2, CHAIN4 = DraftSpec(2), DraftSpec(4)
# Epsilon-greedy needs several explored samples of every arm before the window medians rank arms
# whose rewards differ by 5-10% under ~11% noise; decisions before this step are not judged.
BURN_IN = 1000


def exploit_fractions(
    strategy, trace, start: int, stop: int, env, tolerance: float = 0.02
) -> dict[str, float]:
    """Per bucket, the fraction of exploit decisions in ``[start, stop)`` that picked the best arm or one
    within ``tolerance`` of its expected rate (under ~11% noise such arms are a coin flip apart)."""
    out = {}
    for b, label in enumerate(strategy.bucket_labels):
        rows = [
            r
            for r in trace
            if start <= r["step"] < stop
            and r["mode"] == "exploit"
            and strategy.bucket_of(r["batch_size"]) == b
        ]
        assert len(rows) > 100, label
        good = [
            env.expected_reward(r["batch_size"], r["arm"], r["step"]) >= (1 - tolerance) * r["oracle"]
            for r in rows
        ]
        out[label] = sum(good) / len(rows)
    return out


def drive(strategy, batch_sizes, rewards=lambda step, bs, arm: (2.0, 0.1)):
    """Feed ``strategy`` one update per batch size; returns the arms it chose."""
    chosen = []
    for step, bs in enumerate(batch_sizes):
        arm = strategy.select(bs)
        chosen.append(arm)
        strategy.update(bs, arm, *rewards(step, bs, arm))
    return chosen


# --------------------------------------------------------------------------- defaults and protocol
def test_defaults_give_every_bucket_several_arms_and_the_protocol():
    bandit = BEGMABStrategy()
    assert bandit.bucket_labels == ("1", "2-4", "5-20", "21+")
    assert all(len(arms) >= 2 for arms in bandit.arms)
    assert None in default_arms() and any(a is not None and not a.is_chain for a in default_arms())
    for strategy in (bandit, UCBStrategy(), FixedStrategy(CHAIN4)):
        assert isinstance(strategy, DraftStrategy)


def test_not_a_lightning_strategy():
    from lightning.pytorch.strategies import Strategy, StrategyRegistry

    assert not issubclass(BEGMABStrategy, Strategy)
    assert not any("begmab" in name.lower() for name in StrategyRegistry.available_strategies())
    assert "not** a Lightning ``Strategy``" in BEGMABStrategy.__doc__


def test_buckets_follow_thresholds():
    bandit = BEGMABStrategy(bucket_thresholds=(1, 2, 5, 21))
    assert [bandit.bucket_of(b) for b in (1, 2, 4, 5, 20, 21, 10_000)] == [0, 1, 1, 2, 2, 3, 3]


# --------------------------------------------------------------------------- decision rule
def test_untried_arms_are_tried_first_per_bucket():
    bandit = BEGMABStrategy(epsilon=1.0, seed=3)
    arms = default_arms()
    assert drive(bandit, [1] * len(arms)) == list(arms)
    # Another bucket starts its own untried phase, even with epsilon = 1.
    assert drive(bandit, [30] * len(arms)) == list(arms)
    assert {d.mode for d in bandit.history} == {"untried"}


def test_epsilon_zero_never_explores_once_all_are_tried():
    bandit = BEGMABStrategy(arms=[None, CHAIN2, CHAIN4], epsilon=0.0, seed=0)
    speed = {None: 1.0, CHAIN2: 3.0, CHAIN4: 2.0}
    drive(bandit, [3] * 200, rewards=lambda step, bs, arm: (speed[arm], 0.1))
    later = bandit.history[3:]
    assert {d.mode for d in later} == {"exploit"}
    assert all(d.arm == CHAIN2 for d in later)
    assert bandit.best_arms() == {"2-4": CHAIN2}


def test_reward_is_tokens_per_second_and_best_is_window_median():
    bandit = BEGMABStrategy(arms=[None, CHAIN2], epsilon=0.0, window=3, statistic="median")
    bandit.update(8, CHAIN2, accepted_tokens=2.5, step_time=0.5)
    assert bandit.history[-1].reward == pytest.approx(2.5 * 8 / 0.5)
    assert bandit.history[-1].mode == "unpaired"
    # One huge outlier does not move the median of [40, 40, 1e6] much; None's median is 50.
    bandit.update(8, CHAIN2, 2.5, 0.5)
    bandit.update(8, CHAIN2, 2.5, 0.5 / 25_000)
    bandit.update(8, None, 1.0, 0.16)
    assert bandit.best_arms() == {"5-20": None}
    assert bandit.values()["5-20"] == {"off": pytest.approx(50.0), "chain2": pytest.approx(40.0)}
    assert set(bandit.values()["1"].values()) == {None}  # nothing tried at batch 1 yet
    assert bandit.select(8) is None


def test_the_mean_rates_a_chain_by_its_throughput_where_the_median_sees_one_token():
    # Batch 1: plain emits 1 token per 10 ms step (100 tok/s); a chain emits 1 token in 11 of 20 steps
    # and 3 in 9 of them, per 12 ms step: 158 tok/s on average, but its median step is one token (83 tok/s).
    for statistic, best, chain in (("mean", CHAIN2, 1.9 / 0.012), ("median", None, 1 / 0.012)):
        bandit = BEGMABStrategy(arms=[None, CHAIN2], epsilon=0.0, statistic=statistic)
        for k in range(100):
            bandit.update(1, None, 1.0, 0.010)
            bandit.update(1, CHAIN2, 3.0 if k % 20 < 9 else 1.0, 0.012)
        assert bandit.best_arms()["1"] == best
        assert bandit.values()["1"] == {"off": pytest.approx(100.0), "chain2": pytest.approx(chain)}
    with pytest.raises(ValueError, match=r"statistic must be one of \['mean', 'median'\], got 'max'"):
        BEGMABStrategy(statistic="max")


def test_same_seed_same_choices_different_seed_differs():
    env_sizes = [1, 3, 12, 48] * 150

    def run(seed):
        return drive(BEGMABStrategy(epsilon=0.3, seed=seed), env_sizes)

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_fixed_strategy_always_returns_its_arm():
    for arm in (None, CHAIN4):
        fixed = FixedStrategy(arm)
        assert drive(fixed, [1, 7, 64, 2, 500]) == [arm] * 5
        assert fixed.best_arms() == {"1+": arm}
    with pytest.raises(ValueError, match="unknown arm"):
        FixedStrategy(CHAIN4).update(4, CHAIN2, 1.0, 0.1)


# --------------------------------------------------------------------------- simulated environment
def test_begmab_converges_to_each_buckets_best_arm():
    env = SimulatedSDEnvironment(change_at=None, seed=0)
    assert len({arm_key(env.best_arm(bs, 0)) for bs in env.batch_sizes}) == 4  # a different best per bucket
    bandit = BEGMABStrategy(seed=0)
    trace = run_strategy(bandit, env, 3000)
    fractions = exploit_fractions(bandit, trace, BURN_IN, 3000, env)
    assert min(fractions.values()) >= 0.85, fractions
    assert {label: arm_key(arm) for label, arm in bandit.best_arms().items()} == {
        label: arm_key(env.best_arm(bs, 0)) for label, bs in zip(bandit.bucket_labels, env.batch_sizes)
    }


def test_ucb_converges_on_the_simulated_env():
    ucb, env = UCBStrategy(), SimulatedSDEnvironment(change_at=None, seed=0)
    trace = run_strategy(ucb, env, 3000)
    fractions = exploit_fractions(ucb, trace, BURN_IN, 3000, env)
    assert min(fractions.values()) >= 0.8, fractions


@pytest.mark.parametrize("window", [50, 100])
def test_window_follows_a_change_of_the_best_arm(window):
    change, steps, majority = 2000, 4000, 20
    env = SimulatedSDEnvironment(change_at=change, seed=1)
    changed = [bs for bs in env.batch_sizes if env.best_arm(bs, 0) != env.best_arm(bs, change)]
    assert changed  # the drafter degrades: some buckets get a new best arm
    bandit = BEGMABStrategy(window=window, seed=1)
    trace = run_strategy(bandit, env, steps)
    for bs in changed:
        rows = [r for r in trace if r["batch_size"] == bs and r["step"] >= change]
        exploit = [(k, r["arm"] == r["best"]) for k, r in enumerate(rows, 1) if r["mode"] == "exploit"]
        # Bucket steps until the majority of the last `majority` exploit decisions pick the new best.
        followed = None
        for j in range(majority, len(exploit) + 1):
            if sum(hit for _, hit in exploit[j - majority : j]) > majority // 2:
                followed = exploit[j - 1][0]
                break
        assert followed is not None, bs
        assert followed <= 3 * window + majority, (bs, followed)
        settled = [hit for k, hit in exploit if k > len(rows) // 2]
        assert sum(settled) / len(settled) >= 0.85


def test_unbounded_statistics_do_not_follow_the_change():
    """Control: with a window longer than the run the old best arm keeps its median."""
    env = SimulatedSDEnvironment(change_at=2000, seed=1)
    bandit = BEGMABStrategy(window=10_000, seed=1)
    trace = run_strategy(bandit, env, 4000)
    bs = 12  # chain2 -> off
    late = [r for r in trace if r["batch_size"] == bs and r["mode"] == "exploit" and r["step"] >= 2250]
    assert sum(r["arm"] == r["best"] for r in late) / len(late) < 0.5


# --------------------------------------------------------------------------- state
@pytest.mark.parametrize(
    "make", [lambda: BEGMABStrategy(epsilon=0.3, window=20, seed=5), lambda: UCBStrategy(window=40)]
)
def test_state_dict_round_trip_resumes_the_same_decisions(make):
    n, m = 400, 400
    original = make()
    env = SimulatedSDEnvironment(change_at=None, seed=2)
    run_strategy(original, env, n)
    state = json.loads(json.dumps(original.state_dict()))  # plain Python only: survives JSON
    sizes = [env.sample_batch_size() for _ in range(m)]
    noise = [env.observe(1, CHAIN2, 0) for _ in range(m)]

    def cont(strategy):
        return drive(strategy, sizes, rewards=lambda step, bs, arm: noise[step])

    restored = make()
    restored.load_state_dict(state)
    assert restored.counts == original.counts and restored.history == original.history
    assert cont(original) == cont(restored)
    assert original.state_dict() == restored.state_dict()


def test_load_state_dict_tolerates_missing_keys_and_rejects_other_arms():
    bandit = BEGMABStrategy(seed=0)
    drive(bandit, [1, 3, 12, 48] * 10)
    state = bandit.state_dict()
    assert state["arms"][0][1] == {
        "num_steps": 1,
        "topk": 1,
        "num_draft_tokens": 1,
        "sampled": False,
        "min_confidence": 0.0,
        "fork_depth": 1,
    }
    fresh = BEGMABStrategy(seed=0)
    fresh.load_state_dict({})
    fresh.load_state_dict({"windows": state["windows"]})
    assert fresh.best_arms() == bandit.best_arms()
    # A checkpoint from before min_confidence existed names the same arms.
    older = [
        [a and {k: v for k, v in a.items() if k != "min_confidence"} for a in bucket]
        for bucket in state["arms"]
    ]
    BEGMABStrategy(seed=0).load_state_dict({**state, "arms": older})
    with pytest.raises(ValueError, match="do not match the configured arms"):
        BEGMABStrategy(arms=[None, CHAIN2]).load_state_dict(state)
    with pytest.raises(ValueError, match="bucket_thresholds"):
        BEGMABStrategy(bucket_thresholds=(1, 8)).load_state_dict(state)
    with pytest.raises(ValueError, match="unknown arm 'chain9'"):
        BEGMABStrategy().load_state_dict({"windows": {"1": {"chain9": [1.0]}}})
    with pytest.raises(ValueError, match="unknown bucket '3-7'"):
        BEGMABStrategy().load_state_dict({"counts": {"3-7": {"off": 1}}})
    with pytest.raises(ValueError, match="not a valid DraftSpec"):
        BEGMABStrategy().load_state_dict({"arms": [[{"depth": 3}]]})


def test_heatmap_png_is_written(tmp_path):
    bandit = BEGMABStrategy(seed=0)
    run_strategy(bandit, SimulatedSDEnvironment(change_at=None), 300)
    edges, rows = bandit.heatmap_data(num_bins=10)
    assert len(edges) == 11 and [label for label, _, _ in rows] == list(bandit.bucket_labels)
    for _, _keys, matrix in rows:
        col_sums = [sum(col) for col in zip(*matrix)]
        assert all(math.isnan(s) or s == pytest.approx(1.0) for s in col_sums)
    path = bandit.plot_heatmap(tmp_path / "sub" / "heat.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"arms": []}, ValueError, "arms must not be empty"),
        ({"arms": [[None], []], "bucket_thresholds": (1, 4)}, ValueError, "arms for bucket 1 is empty"),
        ({"arms": [[None], [CHAIN2]]}, ValueError, "2 per-bucket lists but bucket_thresholds defines 4"),
        ({"arms": [None, "chain4"]}, TypeError, "arms must hold DraftSpec"),
        ({"arms": [None, [CHAIN2]]}, TypeError, "not a mix"),
        ({"arms": [CHAIN2, CHAIN2]}, ValueError, "duplicates"),
        (
            {"bucket_thresholds": (2, 5)},
            ValueError,
            "bucket_thresholds must be strictly increasing ints starting at 1",
        ),
        ({"bucket_thresholds": (1, 5, 5)}, ValueError, "bucket_thresholds must be strictly increasing"),
        ({"bucket_thresholds": ()}, ValueError, "bucket_thresholds"),
        ({"epsilon": -0.1}, ValueError, "epsilon must be a number in \\[0, 1\\], got -0.1"),
        ({"epsilon": 1.5}, ValueError, "epsilon must be a number in \\[0, 1\\]"),
        ({"epsilon": float("nan")}, ValueError, "epsilon"),
        ({"window": 0}, ValueError, "window must be an int >= 1, got 0"),
    ],
)
def test_bad_configuration(kwargs, error, match):
    with pytest.raises(error, match=match):
        BEGMABStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"c": -1.0}, "c must be a finite number >= 0"),
        ({"window": 0}, "window must be an int >= 1"),
        ({"arms": []}, "arms"),
    ],
)
def test_bad_ucb_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        UCBStrategy(**kwargs)


def test_bad_fixed_arm():
    with pytest.raises(TypeError, match="DraftSpec"):
        FixedStrategy("chain4")


@pytest.mark.parametrize(
    "strategy", [BEGMABStrategy(), UCBStrategy(), FixedStrategy(None)], ids=["begmab", "ucb", "fixed"]
)
def test_bad_select_and_update(strategy):
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
            strategy.select(bad)
        with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
            strategy.update(bad, None, 1.0, 0.1)
    with pytest.raises(ValueError, match="unknown arm"):
        strategy.update(2, DraftSpec(7, 3, 9), 1.0, 0.1)
    with pytest.raises(ValueError, match="unknown arm"):
        strategy.update(2, "off", 1.0, 0.1)
    for bad_time in (0.0, -0.1, math.inf, math.nan):
        with pytest.raises(ValueError, match="step_time must be"):
            strategy.update(2, None, 1.0, bad_time)
    with pytest.raises(ValueError, match="accepted_tokens must be >= 0"):
        strategy.update(2, None, -1.0, 0.1)
    with pytest.raises(TypeError, match="accepted_tokens must be a real number"):
        strategy.update(2, None, "many", 0.1)
    assert strategy.history == []  # nothing was recorded by the rejected calls


def test_bad_environment():
    with pytest.raises(ValueError, match="acceptance must be in \\(0, 1\\)"):
        SimulatedSDEnvironment(acceptance=1.0)
    with pytest.raises(ValueError, match="batch_sizes"):
        SimulatedSDEnvironment(batch_sizes=())


def test_decaying_epsilon_explores_less_and_still_converges():
    env = SimulatedSDEnvironment(seed=2)
    constant, decaying = (
        BEGMABStrategy(seed=2),
        BEGMABStrategy(seed=2, epsilon_half_life=200, epsilon_floor=0.01),
    )
    explored = {}
    for name, bandit in (("constant", constant), ("decaying", decaying)):
        trace = run_strategy(bandit, env, 4000)
        explored[name] = sum(r["mode"] == "explore" for r in trace[2000:])
        exploit = [r["arm"] == r["best"] for r in trace[2000:] if r["mode"] == "exploit"]
        assert sum(exploit) / len(exploit) >= 0.85, name
    # ~10% of late decisions explore at a constant epsilon, ~1% once each bucket's epsilon has decayed.
    assert explored["constant"] > 150 and explored["decaying"] < 60
    assert 0.01 < decaying.epsilon_of(0) < 0.02
    assert constant.epsilon_of(0) == 0.1


def test_decaying_epsilon_arguments_are_checked():
    with pytest.raises(ValueError, match="epsilon_half_life must be an int >= 1 or None, got 0"):
        BEGMABStrategy(epsilon_half_life=0)
    with pytest.raises(ValueError, match=r"epsilon_floor must be a number in \[0, epsilon=0.1\], got 0.2"):
        BEGMABStrategy(epsilon_half_life=10, epsilon_floor=0.2)


def test_parse_arm_inverts_arm_key():
    from tlt_lightning.speculative import parse_arm

    arms = (
        DraftSpec(8),
        DraftSpec(3, 2, 5),
        DraftSpec(6, 2, sampled=True),
        DraftSpec(10, min_confidence=0.25),
        DraftSpec(6, 2, sampled=True, fork_depth=3),
    )
    for arm in (*default_arms(), *arms):
        assert parse_arm(arm_key(arm)) == arm
    assert parse_arm("chain10@.5") == DraftSpec(10, min_confidence=0.5)
    for bad in (
        "",
        "chain",
        "tree4x2",
        "chain0",
        "on",
        "chain6x",
        "chain6x1",
        "chain6@",
        "chain6@1.2.3",
        "chain6@1",
        "chain6f2",
        "chain6x2f",
        "chain6x2f7",
        "chain6x2f2@0.1",
    ):
        with pytest.raises(ValueError):
            parse_arm(bad)


def _shrinking_rollouts(bandit: BEGMABStrategy, rollouts: int = 8, seed: int = 0) -> dict[str, int]:
    """The 5-20 bucket as a rollout sees it: the batch only shrinks, steps cost the same at every
    batch size (memory-bound), and chain2 emits 10% more tokens than plain decoding per step."""
    rng = random.Random(seed)
    picks = {"off": 0, "chain2": 0}
    for _ in range(rollouts):
        for batch_size in range(20, 4, -1):
            for _ in range(rng.randint(5, 40)):
                arm = bandit.select(batch_size)
                tokens, seconds = (1.1 if arm == CHAIN2 else 1.0), 0.1 * rng.lognormvariate(0, 0.1)
                bandit.update(batch_size, arm, tokens, seconds)
                picks[arm_key(arm)] += 1
    return picks


def test_per_request_rewards_are_not_fooled_by_a_shrinking_batch():
    """The issue's reward (tokens/s of the whole batch) falls as the batch shrinks, whatever the
    arm: with it the bandit often runs the worse arm here; per request it runs the better one."""
    kwargs = dict(arms=[None, CHAIN2], epsilon=0.1, epsilon_half_life=300)
    plain = [_shrinking_rollouts(BEGMABStrategy(**kwargs, seed=s), seed=s) for s in range(6)]
    per_request = [
        _shrinking_rollouts(BEGMABStrategy(**kwargs, seed=s, per_request=True), seed=s) for s in range(6)
    ]
    assert sum(p["off"] for p in plain) > 0.3 * sum(sum(p.values()) for p in plain), plain
    assert all(p["chain2"] >= 0.9 * sum(p.values()) for p in per_request), per_request
    kwargs["seed"] = 0
    bandit = BEGMABStrategy(**kwargs, per_request=True)
    bandit.update(8, CHAIN2, 1.1, 0.1)
    assert bandit.history[-1].reward == pytest.approx(88.0)  # the logged reward is the issue's
    assert bandit.values()["5-20"]["chain2"] == pytest.approx(11.0)  # the statistic is per request
    with pytest.raises(ValueError, match="per_request=True does not match the configured per_request=False"):
        BEGMABStrategy(**kwargs).load_state_dict(bandit.state_dict())
