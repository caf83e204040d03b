"""Budgeted checkpointing: gradients unchanged, budgets respected (measured), the DP optimal."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from torch import nn

from tlt_lightning.efficiency.activation_checkpointing import (
    ActivationCheckpointProfile,
    BlockCost,
    DynamicActivationCheckpointing,
    Gap,
    apply_activation_checkpointing,
    find_blocks,
    is_activation_checkpointed,
    plan_greedy,
    plan_optimal,
    plan_static,
    profile_blocks,
)
from tlt_lightning.efficiency.memory import measure_step
from tlt_lightning.models import load_model

SUBLAYERS = ["model.layers.*.self_attn", "model.layers.*.mlp"]


@pytest.fixture(params=["sdpa", "eager"])
def llama(request):
    model = load_model("tiny-llama", seed=0).model.train()
    model.config._attn_implementation = request.param  # eager: [B, h, T, T] weights and a 4-D mask
    ids = torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(0))
    return model, lambda: model(input_ids=ids, labels=ids, use_cache=False).loss


def _grads(model: nn.Module, forward) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # dropout draws the same masks in both runs
    forward().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("patterns", ["model.layers.*", SUBLAYERS])
def test_checkpointing_changes_no_gradient(llama, patterns):
    model, forward = llama
    blocks = find_blocks(model, patterns)
    reference = _grads(model, forward)
    for flags in ([True] * len(blocks), plan_static(len(blocks)).checkpointed):
        with apply_activation_checkpointing(blocks, flags):
            grads = _grads(model, forward)
        assert grads.keys() == reference.keys()
        for name in reference:  # same ops on the same inputs on CPU: bit for bit
            torch.testing.assert_close(grads[name], reference[name], rtol=0, atol=0, msg=name)


def test_checkpointing_replays_dropout():
    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3), nn.GELU()) for _ in range(3)
    ).train()
    x = torch.randn(8, 16)

    def forward():
        h = x
        for b in blocks:
            h = b(h)
        return h.square().sum()

    reference = _grads(blocks, forward)
    with apply_activation_checkpointing(list(blocks), [True, True, True]):
        grads = _grads(blocks, forward)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=0, atol=0)


def test_handle_removes_and_keeps_state_dict():
    model = load_model("tiny-llama").model
    keys = list(model.state_dict())
    blocks = find_blocks(model)
    handle = apply_activation_checkpointing(blocks, [True, False, True, False])
    assert [is_activation_checkpointed(b) for b in blocks] == [True, False, True, False]
    assert list(model.state_dict()) == keys
    copied = copy.deepcopy(model)  # the wrapper follows the copy, not the original
    assert copied.model.layers[0].forward.forward.__self__ is copied.model.layers[0]
    handle.remove()
    assert not any(is_activation_checkpointed(b) for b in blocks)
    with torch.no_grad():  # inference through a checkpointed block is a plain call
        ids = torch.tensor([[5, 6, 7]])
        torch.testing.assert_close(copied(ids).logits, model(ids).logits)


# ------------------------------------------------------------------------------- budgets
@pytest.mark.parametrize("patterns", ["model.layers.*", SUBLAYERS])
def test_profile_predicts_the_measured_peak(llama, patterns):
    model, forward = llama
    blocks = find_blocks(model, patterns)
    profile = profile_blocks(blocks, forward, repeats=1)
    assert measure_step(forward).peak_bytes == profile.max_peak_bytes  # exact without checkpointing
    with apply_activation_checkpointing(blocks, [True] * len(blocks)):
        assert measure_step(forward).peak_bytes <= profile.min_peak_bytes  # recomputation stops early


@pytest.mark.parametrize("patterns", ["model.layers.*", SUBLAYERS])
def test_optimal_plan_respects_the_budget_measured(llama, patterns):
    model, forward = llama
    blocks = find_blocks(model, patterns)
    profile = profile_blocks(blocks, forward, repeats=1)
    lo, hi = profile.min_peak_bytes, profile.max_peak_bytes
    for fraction in (0.0, 0.25, 0.5, 0.75, 0.99):
        budget = int(lo + fraction * (hi - lo))
        plan = plan_optimal(profile, budget)
        with apply_activation_checkpointing(blocks, plan):
            measured = measure_step(forward).peak_bytes
        assert measured <= plan.peak_bytes <= budget, (fraction, plan)


def test_dynamic_checkpointing_applies_a_plan_within_budget(llama):
    model, forward = llama
    blocks = find_blocks(model)
    plan, handle = DynamicActivationCheckpointing(budget_fraction=0.6, repeats=1).apply(blocks, forward)
    with handle:
        assert [is_activation_checkpointed(b) for b in blocks] == list(plan.checkpointed)
        measured = measure_step(forward).peak_bytes
    assert any(plan.checkpointed) and measured <= plan.peak_bytes
    assert not any(is_activation_checkpointed(b) for b in blocks)


# ------------------------------------------------------------------------------- the DP
def _random_profile(rng: random.Random, n: int, transients: int) -> ActivationCheckpointProfile:
    blocks = []
    for _ in range(n):
        out = rng.randint(0, 4)
        held = out + rng.randint(0, 12)
        blocks.append(
            BlockCost(
                held,
                out,
                held + rng.randint(0, 5),
                rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]),
                tuple(j for j in range(transients) if rng.random() < 0.4),
            )
        )
    gaps = []
    for _ in range(n + 1):
        delta = rng.randint(-3, 4)
        gaps.append(Gap(delta, max(delta, 0) + rng.randint(0, 3)))
    return ActivationCheckpointProfile(
        tuple(blocks), tuple(gaps), tuple(rng.randint(1, 3) for _ in range(transients))
    )


def _brute_force(profile: ActivationCheckpointProfile, budget: int) -> float:
    costs = [
        profile.recompute_seconds(flags)
        for flags in itertools.product([False, True], repeat=len(profile))
        if profile.peak_bytes(flags) <= budget
    ]
    return min(costs)


@pytest.mark.parametrize("seed", range(40))
def test_dp_matches_brute_force(seed):
    rng = random.Random(seed)
    profile = _random_profile(rng, rng.randint(1, 9), rng.randint(0, 3))
    lo, hi = profile.min_peak_bytes, profile.max_peak_bytes
    for budget in sorted({lo, (lo + hi) // 2, hi, rng.randint(lo, hi + 3)}):
        plan = plan_optimal(profile, budget)
        assert plan.peak_bytes <= budget
        assert plan.recompute_seconds == pytest.approx(_brute_force(profile, budget))
        # Forced into byte units (more states than allowed): still feasible, never better than exact.
        coarse = plan_optimal(profile, budget, resolution=4, max_states=1)
        assert coarse.peak_bytes <= budget and coarse.recompute_seconds >= plan.recompute_seconds - 1e-12
        greedy = plan_greedy(profile, budget)
        assert greedy.peak_bytes <= budget and greedy.recompute_seconds >= plan.recompute_seconds - 1e-12


def test_dp_beats_static_on_a_hand_made_instance():
    # Block 1 is cheap to recompute and big; static (0, 2) pays for two expensive blocks.
    blocks = (
        BlockCost(10, 1, 10, 2.0),
        BlockCost(30, 1, 30, 0.5),
        BlockCost(10, 1, 10, 2.0),
        BlockCost(10, 1, 10, 2.0),
    )
    profile = ActivationCheckpointProfile(blocks, (Gap(0, 0),) * 5)
    static = plan_static(profile)
    assert static.checkpointed == (True, False, True, False) and static.peak_bytes == 42
    best = plan_optimal(profile, static.peak_bytes)
    assert best.checkpointed == (False, True, False, False) and best.peak_bytes == 40  # block 1 runs on 10
    assert best.recompute_seconds == 0.5 < static.recompute_seconds == 4.0


def test_shared_transient_input_is_paid_once():
    blocks = (BlockCost(10, 1, 10, 1.0, (0,)),) * 3
    profile = ActivationCheckpointProfile(blocks, (Gap(0, 0),) * 4, transient_bytes=(5,))
    assert profile.peak_bytes([True, True, False]) == 1 + 1 + 5 + 10
    assert profile.peak_bytes([False, False, False]) == 30


# ------------------------------------------------------------------------------- errors
def test_budget_below_minimum_names_memory_budget_and_minimum():
    profile = ActivationCheckpointProfile((BlockCost(10, 2, 12, 1.0),) * 3, (Gap(0, 0),) * 4)
    with pytest.raises(
        ValueError, match=r"memory_budget=10 bytes is below the minimum possible peak 16 bytes"
    ):
        plan_optimal(profile, 10)
    with pytest.raises(ValueError, match="memory_budget"):
        plan_greedy(profile, 10)
    with pytest.raises(ValueError, match="memory_budget must be a positive int"):
        plan_optimal(profile, 0)
    with pytest.raises(
        ValueError, match=r"budget_fraction=0.1 gives memory_budget=3 bytes, below the minimum"
    ):
        DynamicActivationCheckpointing(budget_fraction=0.1).plan(profile)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one of memory_budget and budget_fraction"),
        ({"memory_budget": 10, "budget_fraction": 0.5}, "exactly one of memory_budget and budget_fraction"),
        ({"memory_budget": -1}, "memory_budget must be a positive int"),
        ({"memory_budget": 1.5}, "memory_budget must be a positive int"),
        ({"budget_fraction": 0.0}, r"budget_fraction must be a number in \(0, 1\]"),
        ({"budget_fraction": 1.5}, r"budget_fraction must be a number in \(0, 1\]"),
        ({"budget_fraction": 0.5, "resolution": 0}, "resolution must be an int >= 1"),
        ({"budget_fraction": 0.5, "repeats": 0}, "repeats must be an int >= 1"),
    ],
)
def test_dynamic_checkpointing_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicActivationCheckpointing(**kwargs)


def test_bad_arguments_name_the_argument():
    profile = ActivationCheckpointProfile((BlockCost(10, 2, 12, 1.0),) * 2, (Gap(0, 0),) * 3)
    with pytest.raises(ValueError, match="gaps must have len"):
        ActivationCheckpointProfile((BlockCost(1, 1, 1, 1.0),), (Gap(0, 0),))
    with pytest.raises(ValueError, match=r"blocks\[0\].transient must index transient_bytes"):
        ActivationCheckpointProfile((BlockCost(1, 1, 1, 1.0, (0,)),), (Gap(0, 0),) * 2)
    with pytest.raises(ValueError, match="checkpointed must have 2 entries"):
        profile.peak_bytes([True])
    with pytest.raises(ValueError, match="resolution must be an int >= 1"):
        plan_optimal(profile, 100, resolution=0)
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        plan_static(4, every=0)
    with pytest.raises(ValueError, match=r"offset must be an int in \[0, every=2\)"):
        plan_static(4, offset=2)


def test_profile_and_apply_reject_bad_blocks():
    lin = [nn.Linear(4, 4) for _ in range(3)]
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="blocks must hold at least one module"):
        profile_blocks([], lambda: x.sum())
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        profile_blocks(lin, lambda: x.sum(), repeats=0)
    with pytest.raises(ValueError, match="blocks must each run exactly once"):
        profile_blocks(lin, lambda: lin[0](lin[0](x)).sum())
    with pytest.raises(ValueError, match="blocks must be listed in execution order"):
        profile_blocks(lin, lambda: lin[0](lin[2](lin[1](x))).sum())
    outer = nn.Sequential(lin[0], lin[1])
    with pytest.raises(ValueError, match="blocks must not be nested"):
        profile_blocks([outer, lin[0]], lambda: outer(x).sum())
    with pytest.raises(ValueError, match="plan must have one entry per block"):
        apply_activation_checkpointing(lin, [True])
    with apply_activation_checkpointing(lin, [True, False, False]):
        with pytest.raises(ValueError, match="already checkpointed"):
            apply_activation_checkpointing(lin, [True, True, True])
        with pytest.raises(ValueError, match="patched forward"):
            profile_blocks(lin, lambda: lin[2](lin[1](lin[0](x))).sum())


def test_find_blocks():
    model = load_model("tiny-llama").model
    assert find_blocks(model) == list(model.model.layers)
    subs = find_blocks(model, SUBLAYERS)
    assert subs == [m for layer in model.model.layers for m in (layer.self_attn, layer.mlp)]
    with pytest.raises(ValueError, match=r"patterns \['model.nothing.\*'\] match no module"):
        find_blocks(model, ["model.layers.*", "model.nothing.*"])
    with pytest.raises(ValueError, match="patterns=None is ambiguous"):
        find_blocks(
            nn.ModuleDict(
                {"a": nn.ModuleList([nn.Linear(1, 1)] * 2), "b": nn.ModuleList([nn.Linear(1, 1)] * 2)}
            )
        )
    with pytest.raises(ValueError, match="patterns=None needs an nn.ModuleList"):
        find_blocks(nn.Linear(2, 2))
