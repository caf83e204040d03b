from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tlt_lightning.drafter import (
    DrafterConfig,
    DrafterLoss,
    drafter_train_step,
    evaluate_drafter,
    make_batches,
    warmup_drafter,
)
from tlt_lightning.drafter.batches import unroll_mask
from tlt_lightning.drafter.train import ConcatCache, drafter_losses
from tlt_lightning.rollout.engine import causal_decode_mask
from tlt_lightning.rollout.types import Rollout

from .conftest import generate_rollouts, make_drafter

H = 64


def fake_rollout(T: int, prompt_len: int, channels: int, seed: int = 0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    return Rollout(
        prompt_ids=torch.arange(prompt_len),
        token_ids=torch.randint(0, 128, (T,), generator=g),
        logprobs=torch.zeros(T),
        finish_reason="length",
        first_token_time=0.0,
        finish_time=0.0,
        features=torch.randn(T, channels, H, generator=g),
    )


def test_make_batches_aligns_inputs_and_targets(qwen2):
    cfg = DrafterConfig.from_target(qwen2, "eagle3")
    a, b, short = fake_rollout(5, 3, 4, 0), fake_rollout(3, 2, 4, 1), fake_rollout(1, 2, 4, 2)
    (batch,) = make_batches([a, b, short], cfg, batch_size=4, shuffle=False)
    assert batch.tokens.shape == (2, 4) and batch.features.shape == (2, 4, 3, H)
    assert batch.mask.tolist() == [[True] * 4, [True, True, False, False]]
    assert batch.tokens[0].equal(a.token_ids[:4]) and batch.tokens[1, :2].equal(b.token_ids[:2])
    assert batch.features[0].equal(a.features[:4, :3])  # the drafter's three input layers
    assert batch.target_hidden[0].equal(a.features[1:, 3])  # the final state one position later
    assert batch.target_hidden[1, :2].equal(b.features[1:, 3])
    assert batch.positions.tolist() == [[2, 3, 4, 5], [1, 2, 3, 4]]  # prompt_len - 1 + i
    assert batch.num_samples == 6


def test_make_batches_eagle1_reads_single_final_channel_and_splits(llama):
    cfg = DrafterConfig.from_target(llama, "eagle1")
    assert cfg.rollout_feature_layers == (4,)
    r = fake_rollout(7, 2, 1)
    batches = make_batches([r], cfg, batch_size=1, shuffle=False, max_len=4)
    assert [b.tokens.shape[1] for b in batches] == [4, 2]
    assert batches[1].features[0, :, 0].equal(r.features[4:6, 0])
    assert batches[1].target_hidden[0].equal(r.features[5:7, 0]) and batches[1].positions.tolist() == [[5, 6]]
    # The brief's layout (inputs + final again) works too.
    r2 = fake_rollout(4, 2, 2)
    (b2,) = make_batches([r2], cfg, 1, shuffle=False)
    assert b2.features[0, :, 0].equal(r2.features[:3, 0]) and b2.target_hidden[0].equal(r2.features[1:, 1])


def test_batches_are_built_on_access_in_the_stored_dtype(llama):
    """Batches are collated when read (an epoch of padded copies never sits in memory) from the
    rollouts' own tensors, bf16 features included; the loss casts them to the drafter's dtype."""
    d = make_drafter(llama)
    rs = [fake_rollout(T, 2, 1, i) for i, T in enumerate([6, 4, 5, 3])]
    half = [replace(r, features=r.features.bfloat16()) for r in rs]
    batches = make_batches(half, d.config, 2, shuffle=False)
    assert len(batches) == 2 and batches[0] is not batches[0] and len(batches[:1]) == 1
    assert batches[0].features.dtype == torch.bfloat16 and batches[0].tokens.equal(batches[0].tokens)
    assert batches[-1].tokens.equal(batches[1].tokens)
    widened = make_batches([replace(r, features=r.features.float()) for r in half], d.config, 2, False)
    moved = batches[0].to("cpu", torch.float32)
    assert moved.features.equal(widened[0].features) and moved.mask.dtype == torch.bool
    with torch.no_grad():
        assert drafter_losses(d, llama, batches[0])[0] == drafter_losses(d, llama, widened[0])[0]


def test_make_batches_errors(llama):
    cfg = DrafterConfig.from_target(llama, "eagle3")
    r = fake_rollout(4, 2, 4)
    r.features = None
    with pytest.raises(
        ValueError,
        match=r"rollouts\[0\] has no features: generate with RolloutConfig.feature_layers=\(1, 2, 3, 4\)",
    ):
        make_batches([r], cfg, 2)
    with pytest.raises(ValueError, match=r"rollouts\[0\].features must be \[T, 4, 64\].*got \[4, 2, 64\]"):
        make_batches([fake_rollout(4, 2, 2)], cfg, 2)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        make_batches([], cfg, 0)


def test_unroll_mask_matches_decode_time_visibility():
    valid = torch.tensor([[True, True, True, True]])
    m1 = unroll_mask(valid, 1)[0, 0]
    assert m1.equal(torch.ones(4, 4, dtype=torch.bool).tril())
    m2 = unroll_mask(valid, 2)[0, 0].int()
    # Query i of step 2 sees true keys j <= i - 1 and its own step-2 key.
    assert m2.tolist() == [
        [0, 0, 0, 0, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 0, 0, 1],
    ]
    m3 = unroll_mask(torch.tensor([[True, True, True, False]]), 3)[0, 0].int()
    assert m3[3].tolist() == [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]  # a padded query still sees itself
    assert m3[2].tolist() == [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0]


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_unrolled_training_equals_cached_decoding(llama, kind):
    """Step 2 of the unroll is exactly what the drafter computes for its 2nd draft token with a KV cache."""
    d = make_drafter(llama, kind).eval()
    S = 6
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (1, S), generator=g)
    g_in = d.lift(torch.randn(1, S, d.config.num_features, H, generator=g)).detach()
    positions = torch.arange(S)[None] + 2
    valid = torch.ones(1, S, dtype=torch.bool)
    with torch.no_grad():
        cache = ConcatCache()
        h1 = d(tokens, g_in, positions, unroll_mask(valid, 1), cache)
        shifted = torch.cat([torch.zeros_like(h1[:, :1]), h1[:, :-1]], 1)
        h2 = d(tokens, shifted, positions, unroll_mask(valid, 2), cache)
        for i in range(1, S):
            kv = d.new_cache(1, 16)
            # Committed context: samples 0..i-1 with their true features (slots 2..i+1).
            mask = causal_decode_mask(torch.tensor([2]), i, i + 2) & (torch.arange(i + 2) >= 2)
            kv.lengths[0] = 2
            first = d(tokens[:, :i], g_in[:, :i], positions[:, :i], mask, kv)
            kv.lengths[0] = i + 2
            mask = causal_decode_mask(kv.lengths[:1], 1, i + 3) & (torch.arange(i + 3) >= 2)
            second = d(tokens[:, i : i + 1], first[:, -1:], positions[:, i : i + 1], mask, kv)
            torch.testing.assert_close(second[0, 0], h2[0, i], rtol=1e-5, atol=1e-5)


def test_train_step_returns_floats_and_leaves_target_alone(qwen2):
    d = make_drafter(qwen2, "eagle3", draft_vocab_size=64)
    rollouts = generate_rollouts(qwen2, d.config, prompts=4, tokens=8)
    counts = torch.bincount(torch.cat([r.token_ids for r in rollouts]), minlength=128)
    d.set_draft_vocab(counts)
    (batch,) = make_batches(rollouts, d.config, 4)
    before = {k: v.clone() for k, v in qwen2.state_dict().items()}
    opt = torch.optim.AdamW(d.parameters(), lr=1e-3)
    metrics = drafter_train_step(d, qwen2, batch, opt, DrafterLoss.for_kind("eagle3", unroll_steps=3))
    assert set(metrics) == {
        "loss",
        "feature_loss",
        "ce_loss",
        "top1",
        "accept",
        "top1_step2",
        "top1_step3",
        "accept_step2",
        "accept_step3",
        "grad_norm",
    }
    assert all(isinstance(v, float) for v in metrics.values()) and metrics["loss"] > 0
    assert all(v.equal(qwen2.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in qwen2.parameters())


@pytest.mark.parametrize(
    ("name", "kind", "unroll", "pack"),
    [("tiny-llama", "eagle1", 1, None), ("tiny-qwen2", "eagle3", 2, None), ("tiny-llama", "eagle1", 2, 64)],
)
def test_warmup_learns_the_target(llama, qwen2, name, kind, unroll, pack):
    target = llama if name == "tiny-llama" else qwen2
    d = make_drafter(target, kind)
    rollouts = generate_rollouts(target, d.config, prompts=16, tokens=32)
    loss_cfg = DrafterLoss.for_kind(kind, unroll_steps=unroll)
    batches = make_batches(rollouts, d.config, 8, shuffle=False)
    initial = evaluate_drafter(d, target, batches, loss_cfg)
    history = warmup_drafter(
        d,
        target,
        rollouts,
        steps=100,
        lr=3e-3,
        batch_size=8 if pack is None else 4,
        progress=False,
        loss_cfg=loss_cfg,
        pack_budget=pack,
    )
    final = evaluate_drafter(d, target, batches, loss_cfg)
    assert len(history) == 100 and history[-1]["loss"] < history[0]["loss"]
    assert final["loss"] < 0.8 * initial["loss"]
    assert initial["top1"] < 0.1 and final["top1"] > initial["top1"] + 0.3
    assert final["accept"] > initial["accept"] + 0.2
    if unroll > 1:
        assert final["top1_step2"] > initial["top1_step2"] + 0.3


def test_on_step_sees_every_step_and_the_drafter_as_trained_so_far(llama):
    d = make_drafter(llama)
    rollouts = generate_rollouts(llama, d.config, prompts=4, tokens=8)
    seen = []
    history = warmup_drafter(
        d,
        llama,
        rollouts,
        steps=4,
        progress=False,
        on_step=lambda step, metrics: seen.append((step, metrics, d.fc.weight.clone())),
    )
    assert [step for step, _, _ in seen] == [1, 2, 3, 4] and [m for _, m, _ in seen] == history
    assert not torch.equal(seen[0][2], seen[1][2]) and torch.equal(seen[-1][2], d.fc.weight)


def test_bf16_autocast_trains_the_fp32_drafter(llama, monkeypatch):
    import tlt_lightning.drafter.train as train_module

    d = make_drafter(llama)
    rollouts = generate_rollouts(llama, d.config, prompts=16, tokens=32)
    batches = make_batches(rollouts, d.config, 8, shuffle=False)
    initial = evaluate_drafter(d, llama, batches)
    real_step, autocast = train_module.drafter_train_step, []

    def step(*args, **kwargs):
        autocast.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train_module, "drafter_train_step", step)
    history = warmup_drafter(
        d, llama, rollouts, steps=100, lr=3e-3, progress=False, autocast_dtype=torch.bfloat16
    )
    final = evaluate_drafter(d, llama, batches)
    assert autocast == [torch.bfloat16] * 100 and not torch.is_autocast_enabled("cpu")
    assert all(p.dtype == torch.float32 for p in d.parameters())
    assert history[-1]["loss"] < history[0]["loss"] and final["top1"] > initial["top1"] + 0.3


def test_warmup_validation(llama):
    d = make_drafter(llama)
    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        warmup_drafter(d, llama, [], steps=0)
    with pytest.raises(ValueError, match="no training samples"):
        warmup_drafter(d, llama, [fake_rollout(1, 2, 1)], steps=1, progress=False)
    with pytest.raises(ValueError, match="batches is empty"):
        evaluate_drafter(d, llama, [])
    with pytest.raises(ValueError, match="lr_warmup must be >= 0, got -1"):
        warmup_drafter(d, llama, [fake_rollout(6, 2, 1)], steps=1, lr_warmup=-1)


def test_lr_warmup_scales_the_first_steps(llama):
    """AdamW's first step moves every weight by about the learning rate: with a 9-step linear
    warm-up the first step runs at a tenth of it, so the weights move about ten times less."""
    rollouts = [fake_rollout(6, 2, 1, i) for i in range(4)]

    def first_step_change(lr_warmup: int) -> float:
        torch.manual_seed(0)
        d = make_drafter(llama)
        before = [p.detach().clone() for p in d.parameters() if p.requires_grad]
        warmup_drafter(
            d, llama, rollouts, steps=1, lr=1e-3, progress=False, lr_warmup=lr_warmup, max_grad_norm=None
        )
        after = [p for p in d.parameters() if p.requires_grad]
        return max(float((a - b).abs().max()) for a, b in zip(after, before))

    assert first_step_change(9) == pytest.approx(first_step_change(0) / 10, rel=0.05)


def test_losses_ignore_padding(llama):
    d = make_drafter(llama)
    a, b = fake_rollout(6, 2, 1, 0), fake_rollout(3, 2, 1, 1)
    (both,) = make_batches([a, b], d.config, 2, shuffle=False)
    (alone,) = make_batches([b], d.config, 1, shuffle=False)
    (only_a,) = make_batches([a], d.config, 1, shuffle=False)
    with torch.no_grad():
        _, m_both = drafter_losses(d, llama, both)
        _, m_b = drafter_losses(d, llama, alone)
        _, m_a = drafter_losses(d, llama, only_a)
    expected = (m_a["ce_loss"] * 5 + m_b["ce_loss"] * 2) / 7
    torch.testing.assert_close(m_both["ce_loss"], expected)


def test_warmup_stops_early_on_keyboard_interrupt(monkeypatch, llama):
    """Ctrl-C after some steps returns the history so far instead of losing the drafter."""
    import tlt_lightning.drafter.train as train_module
    from tlt_lightning.drafter import Drafter, DrafterConfig, warmup_drafter
    from tlt_lightning.rollout import RolloutConfig, RolloutEngine

    drafter = Drafter(DrafterConfig.from_target(llama), llama)
    config = RolloutConfig(max_new_tokens=8, feature_layers=drafter.config.rollout_feature_layers)
    rollouts = (
        RolloutEngine(llama, config)
        .generate([[5, 6, 7]] * 4, generator=torch.Generator().manual_seed(0))
        .rollouts
    )
    real_step, calls = train_module.drafter_train_step, []

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train_module, "drafter_train_step", step)
    history = warmup_drafter(drafter, llama, rollouts, steps=10, progress=False)
    assert len(history) == 2
