"""SpotTrainer without Lightning: batch stream, local and paid steps, step-weighted averaging, state."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from tests.drafter.conftest import generate_rollouts, make_drafter
from tlt_lightning.spot import BufferConfig, DrafterSample, RolloutBuffer, SpotTrainer, SpotTrainerConfig
from tlt_lightning.spot import trainer as spot_trainer_module
from tlt_lightning.spot.trainer import PaidTraining


def filled_buffer(llama, drafter, step: int = 0, prompts: int = 8) -> RolloutBuffer:
    buffer = RolloutBuffer(BufferConfig(max_mb=64))
    buffer.add(generate_rollouts(llama, drafter.config, prompts=prompts, tokens=16), step=step)
    return buffer


def make_trainer(
    llama, init: int = 0, rank: int = 0, buffer: RolloutBuffer | None = None, **config
) -> SpotTrainer:
    """A trainer of a fresh drafter (weights seeded by ``init``); ``config`` overrides SpotTrainerConfig."""
    drafter = make_drafter(llama, seed=init)
    buffer = buffer if buffer is not None else filled_buffer(llama, drafter)
    config = {"packing_budget": 32, "max_seconds_per_rollout": None, **config}
    return SpotTrainer(drafter, llama, buffer, SpotTrainerConfig(**config), rank=rank)


def snapshot(trainer: SpotTrainer) -> dict:
    """Weights and AdamW state, as plain CPU copies."""
    params = [p for p in trainer.drafter.parameters() if p.requires_grad]
    state = [{k: v.detach().clone() for k, v in trainer.optimizer.state[p].items()} for p in params]
    return {"params": [p.detach().clone() for p in params], "state": state}


def assert_equal(a: dict, b: dict) -> None:
    assert len(a["params"]) == len(b["params"])
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)
    for sa, sb in zip(a["state"], b["state"]):
        assert sa.keys() == sb.keys() == {"exp_avg", "exp_avg_sq", "step"}
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


# ---------------------------------------------------------------------------------- local steps


def test_train_one_takes_a_local_step_and_begin_step_restarts_the_sums(llama):
    trainer = make_trainer(llama)
    before = snapshot(trainer)
    trainer.begin_step(0)
    assert trainer.train_one() and trainer.train_one()
    assert trainer.steps == 2 and math.isfinite(trainer.loss_sum) and 0 <= trainer.top1_sum <= 2
    assert not torch.equal(before["params"][0], snapshot(trainer)["params"][0])
    trainer.begin_step(1)
    assert trainer.policy_step == 1 and trainer.loss_sum == trainer.top1_sum == 0.0 and trainer.steps == 2


def test_steps_inside_a_callers_autocast_region_train_as_outside_it(llama):
    """A fit under bf16-mixed calls the trainer inside autocast, which caches each weight's cast for the
    whole region: without its own precision, the second step would run on the first one's weights."""
    outside, inside = make_trainer(llama), make_trainer(llama)
    outside.begin_step(0), inside.begin_step(0)
    for _ in range(3):
        outside.train_one()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(3):
            inside.train_one()
    assert inside.loss_sum == outside.loss_sum
    assert_equal(snapshot(inside), snapshot(outside))


def test_unrolled_total_variation_training_is_the_configured_objective(llama):
    trainer = make_trainer(llama, unroll_steps=3, accept_weight=1.0)
    assert (trainer.loss_cfg.unroll_steps, trainer.loss_cfg.accept_weight) == (3, 1.0)
    plain = make_trainer(llama)
    trainer.begin_step(0), plain.begin_step(0)
    assert trainer.train_one() and plain.train_one()
    # the same first batch and weights: the unrolled steps and the acceptance term add to the loss
    assert trainer.loss_sum > plain.loss_sum and math.isfinite(trainer.loss_sum)


def test_empty_buffer_or_zero_budget_trains_nothing(llama):
    drafter = make_drafter(llama)
    trainer = SpotTrainer(drafter, llama, RolloutBuffer(), SpotTrainerConfig(max_steps_per_rollout=2))
    trainer.begin_step(0)
    assert not trainer.train_one() and trainer.train_paid() is None and trainer.steps == 0
    trainer = make_trainer(llama, max_steps_per_rollout=0, max_seconds_per_rollout=1.0)
    assert trainer.train_paid() is None and trainer.steps == 0


# ---------------------------------------------------------------------------------- paid budget


class FakeClock:
    """``time.perf_counter`` / ``time.time`` that only move when a (fake) drafter step runs."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s, self.calls = 1000.0, step_s, 0

    def step(self) -> bool:
        self.now += self.step_s
        self.calls += 1
        return True


def test_paid_budget_in_steps(llama):
    trainer = make_trainer(llama, max_steps_per_rollout=3)
    trainer.begin_step(0)
    paid = trainer.train_paid()
    assert isinstance(paid, PaidTraining) and paid.steps == 3 and trainer.steps == 3
    assert paid.seconds > 0 and paid.start > 0


def test_paid_budget_in_seconds_starts_no_step_the_time_left_cannot_hold(llama, monkeypatch):
    clock = FakeClock(step_s=0.03)
    monkeypatch.setattr(
        spot_trainer_module, "time", SimpleNamespace(perf_counter=lambda: clock.now, time=lambda: clock.now)
    )
    trainer = make_trainer(llama, max_steps_per_rollout=None, max_seconds_per_rollout=0.1)
    trainer.train_one = clock.step
    paid = trainer.train_paid()
    # After 2 steps (0.06 s) a third fits (0.09 <= 0.1); after 3 a fourth would end at 0.12 > 0.1.
    assert paid.steps == clock.calls == 3 and paid.seconds == pytest.approx(0.09) and paid.start == 1000.0

    trainer = make_trainer(llama, max_steps_per_rollout=2, max_seconds_per_rollout=0.1)
    trainer.train_one = clock.step
    assert trainer.train_paid().steps == 2  # the step budget binds first
    # A tighter bound for one call (a savings account's credit): 0.05 s holds one step then stops.
    trainer = make_trainer(llama, max_steps_per_rollout=None, max_seconds_per_rollout=0.1)
    trainer.train_one = clock.step
    assert trainer.train_paid(max_seconds=0.05).steps == 1 and trainer.train_paid(max_seconds=1.0).steps == 3
    assert trainer.train_paid(max_seconds=0.0) is None and trainer.train_paid(max_seconds=-0.2) is None


def test_paid_training_stops_when_the_stream_runs_dry(llama):
    trainer = make_trainer(llama, max_steps_per_rollout=5)
    calls = iter([True, False])
    trainer.train_one = lambda: next(calls)
    assert trainer.train_paid().steps == 1


# ---------------------------------------------------------------------------------- batch stream


def sample(tokens: range, step: int, hidden: int, seed: int) -> DrafterSample:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(tokens.start, tokens.stop, (8,), generator=g)
    return DrafterSample(torch.arange(3), ids, torch.randn(8, 1, hidden, generator=g), step)


def test_stream_prefers_recent_policy_steps(llama):
    drafter = make_drafter(llama)
    hidden = llama.info.hidden_size
    buffer = RolloutBuffer(BufferConfig(max_mb=64, decay=0.5))
    buffer.add([sample(range(3, 40), 0, hidden, i) for i in range(10)], step=0)  # old: tokens < 40
    buffer.add([sample(range(64, 120), 5, hidden, 10 + i) for i in range(10)], step=5)  # new: >= 64
    trainer = SpotTrainer(drafter, llama, buffer, SpotTrainerConfig(packing_budget=4))
    trainer.begin_step(5)
    stream = trainer.stream(trainer.generator())
    tokens = torch.cat([next(stream).tokens.flatten() for _ in range(40)])
    tokens = tokens[tokens > 0]  # padding is 0
    recent = (tokens >= 64).float().mean().item()
    assert recent > 0.8, recent  # weight 0.5 ** 5: an old rollout is 32x less likely per draw


def stream_tokens(trainer: SpotTrainer, n: int = 6) -> list[list[int]]:
    stream = trainer.stream(trainer.generator())
    return [next(stream).tokens.flatten().tolist() for _ in range(n)]


def test_stream_is_reproducible_for_the_same_seed_step_and_rank(llama):
    a = make_trainer(llama)
    buffer = a.buffer
    b = make_trainer(llama, buffer=buffer)
    for t in (a, b):
        t.begin_step(3)
    assert stream_tokens(a) == stream_tokens(b)
    b.begin_step(4)
    assert stream_tokens(a) != stream_tokens(b)  # another policy step: other draws
    for t in (
        make_trainer(llama, buffer=buffer, rank=1),
        make_trainer(llama, buffer=buffer, seed=1),
    ):  # rank, seed
        t.begin_step(3)
        assert stream_tokens(t) != stream_tokens(a)
    # Two trainers, same data and step: the same drafter after the same local steps.
    c, d = make_trainer(llama, buffer=buffer), make_trainer(llama, buffer=buffer)
    for t in (c, d):
        t.begin_step(2)
        assert t.train_one() and t.train_one()
    assert_equal(snapshot(c), snapshot(d))


# ---------------------------------------------------------------------------------- averaging


def average_two(trainers: list[SpotTrainer], weights: list[float]) -> None:
    """Both ranks call ``average`` at once; the fake ``reduce`` sums their tensors (same order on both)."""
    barrier, parts = threading.Barrier(2, timeout=60), {}

    def reducer(rank: int):
        def reduce(flat: torch.Tensor) -> torch.Tensor:
            parts[rank] = flat.clone()
            barrier.wait()
            total = parts[0] + parts[1]
            barrier.wait()
            return total

        return reduce

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(trainers[r].average, reducer(r), weights[r]) for r in range(2)]
        for future in futures:
            future.result()  # re-raises a rank's error here


def two_ranks(llama, steps: tuple[int, int]) -> list[SpotTrainer]:
    buffer = make_trainer(llama).buffer
    trainers = [make_trainer(llama, buffer=buffer, rank=r) for r in range(2)]  # identical initial drafters
    for trainer, n in zip(trainers, steps):
        trainer.begin_step(0)
        for _ in range(n):
            assert trainer.train_one()
    return trainers


def test_weights_one_and_zero_reproduce_the_trained_rank_exactly(llama):
    trainers = two_ranks(llama, (2, 0))  # rank 1 took no step: it has no AdamW state yet
    trained = snapshot(trainers[0])
    average_two(trainers, [1.0, 0.0])
    assert_equal(snapshot(trainers[0]), trained)
    assert_equal(snapshot(trainers[1]), trained)  # moments and step count created on rank 1
    trainers[1].begin_step(1)
    assert trainers[1].train_one()  # its optimizer state is usable


def test_equal_weights_give_the_mean(llama):
    trainers = two_ranks(llama, (2, 1))
    a, b = snapshot(trainers[0]), snapshot(trainers[1])
    average_two(trainers, [0.5, 0.5])
    mean = {
        "params": [x * 0.5 + y * 0.5 for x, y in zip(a["params"], b["params"])],
        "state": [{k: sa[k] * 0.5 + sb[k] * 0.5 for k in sa} for sa, sb in zip(a["state"], b["state"])],
    }
    assert mean["state"][0]["step"].item() == 1.5
    assert_equal(snapshot(trainers[0]), mean)
    assert_equal(snapshot(trainers[1]), mean)


# ---------------------------------------------------------------------------------- state


def test_state_dict_roundtrip_and_missing_keys(llama):
    source = make_trainer(llama)
    source.begin_step(0)
    source.train_one()
    state = source.state_dict()
    assert list(state) == ["drafter_config", "drafter", "optimizer"]
    assert state["drafter_config"] == source.drafter.config.to_dict()
    source.train_one()  # the state is a copy: later steps do not change it
    assert not all(torch.equal(v, source.drafter.state_dict()[k]) for k, v in state["drafter"].items())
    restored = make_trainer(llama, init=5, buffer=source.buffer)
    before = snapshot(restored)
    restored.load_state_dict({})  # missing keys keep the current values
    assert all(torch.equal(x, y) for x, y in zip(before["params"], snapshot(restored)["params"]))
    restored.load_state_dict(state)
    for key, value in state["drafter"].items():
        assert torch.equal(restored.drafter.state_dict()[key], value), key
    for p, s in state["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(restored.optimizer.state_dict()["state"][p][k], v)


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0}, "lr must be a finite number > 0, got 0"),
        ({"lr": float("inf")}, "lr must be a finite number > 0, got inf"),
        ({"packing_budget": 1}, "packing_budget must be an int >= 2, got 1"),
        ({"packing_budget": True}, "packing_budget must be an int >= 2, got True"),
        ({"max_steps_per_rollout": -1}, "max_steps_per_rollout must be an int >= 0 or None, got -1"),
        ({"max_seconds_per_rollout": 0.0}, "max_seconds_per_rollout must be a finite number > 0 or None"),
        (
            {"max_steps_per_rollout": None, "max_seconds_per_rollout": None},
            "max_steps_per_rollout and max_seconds_per_rollout are both None",
        ),
        ({"weight_decay": -0.1}, "weight_decay must be a number >= 0, got -0.1"),
        ({"max_grad_norm": 0}, "max_grad_norm must be a number > 0 or None, got 0"),
        ({"seed": 1.5}, "seed must be an int >= 0, got 1.5"),
        ({"unroll_steps": 0}, "unroll_steps must be an int >= 1, got 0"),
        ({"accept_weight": -1.0}, "accept_weight must be a number >= 0, got -1.0"),
    ],
)
def test_bad_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpotTrainerConfig(**kwargs)


def test_bad_call_arguments_name_the_argument(llama):
    drafter = make_drafter(llama)
    with pytest.raises(ValueError, match="rank must be an int >= 0, got -1"):
        SpotTrainer(drafter, llama, RolloutBuffer(), rank=-1)
    trainer = SpotTrainer(drafter, llama, RolloutBuffer())
    with pytest.raises(ValueError, match="policy_step must be an int >= 0, got -2"):
        trainer.begin_step(-2)
    with pytest.raises(ValueError, match=r"weight must be a number in \[0, 1\], got 1.5"):
        trainer.average(lambda flat: flat, 1.5)
    with pytest.raises(ValueError, match=r"weight must be a number in \[0, 1\], got nan"):
        trainer.average(lambda flat: flat, float("nan"))
