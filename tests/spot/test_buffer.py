from __future__ import annotations

import math

import pytest
import torch

from tests.drafter.conftest import make_drafter
from tests.drafter.test_train import H, fake_rollout
from tlt_lightning.drafter import DrafterConfig, make_batches, pack_batches
from tlt_lightning.drafter.train import drafter_losses
from tlt_lightning.spot import BufferConfig, DrafterSample, RolloutBuffer

MB = 1024 * 1024


def rollout_bytes(T: int, prompt_len: int, channels: int, dtype=torch.bfloat16) -> int:
    return (T + prompt_len) * 8 + T * channels * H * torch.finfo(dtype).bits // 8


def test_add_stores_a_compact_copy():
    buf = RolloutBuffer(BufferConfig(max_mb=1))
    r = fake_rollout(6, 3, 2)
    assert buf.add([r, fake_rollout(1, 3, 2)], step=4) == 1  # a 1-token rollout has no sample
    (item,) = buf.sample(5)
    assert item.step == 4 and buf.current_step == 4 and len(buf) == 1
    assert item.features.dtype == torch.float32  # returned in the compute dtype...
    stored = buf._items[0]
    assert stored.features.dtype == torch.bfloat16  # ...stored compactly
    torch.testing.assert_close(item.features, r.features.to(torch.bfloat16).float())
    assert item.token_ids.equal(r.token_ids) and item.prompt_ids.equal(r.prompt_ids)
    with torch.no_grad():
        r.features.add_(1.0)  # the rollout's tensors are not aliased
    assert stored.features.float().sub(r.features).abs().min() > 0.5
    assert buf.size_mb == pytest.approx(rollout_bytes(6, 3, 2) / MB)
    assert buf.num_tokens == 6


def test_memory_bound_evicts_oldest_first():
    per = rollout_bytes(20, 4, 2)
    budget_mb = 3.5 * per / MB  # room for three
    buf = RolloutBuffer(BufferConfig(max_mb=budget_mb, decay=1.0))
    for step in range(6):
        buf.add([fake_rollout(20, 4, 2, seed=step)], step=step)
        assert buf.size_mb <= budget_mb
    assert len(buf) == 3 and [s.step for s in buf._items] == [3, 4, 5]
    stats = buf.stats()
    assert stats["evicted"] == 3 and stats["added"] == 6 and stats["oldest_step"] == 3
    assert stats["size_mb"] == pytest.approx(3 * per / MB) and stats["max_mb"] == pytest.approx(budget_mb)
    # A rollout larger than the whole budget is dropped, the others stay.
    assert buf.add([fake_rollout(200, 4, 2)], step=6) == 0
    assert buf.stats()["dropped"] == 1 and len(buf) == 3


def test_sampling_prefers_recent_steps():
    buf = RolloutBuffer(BufferConfig(max_mb=64, decay=0.5))
    for step in range(4):
        buf.add([fake_rollout(4, 2, 1, seed=10 * step + i) for i in range(5)], step=step)
    w = buf.weights()
    assert w.shape == (20,) and w.sum().item() == pytest.approx(1.0)
    # decay 0.5: each step back halves the weight.
    assert w[0].item() == pytest.approx(w[-1].item() / 8)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(400):
        for s in buf.sample(1, g):
            counts[s.step] += 1
    expected = torch.tensor([1, 2, 4, 8.0]) / 15 * 400
    assert ((counts - expected).abs() < 0.3 * expected + 10).all(), counts
    picks = buf.sample(30, g)
    assert len(picks) == 20 and len({id(p.token_ids) for p in picks}) == 20  # distinct, capped


def test_decay_one_is_uniform_and_old_entries_never_underflow():
    buf = RolloutBuffer(BufferConfig(decay=1.0))
    buf.add([fake_rollout(4, 2, 1, seed=i) for i in range(3)], step=0)
    buf.add([fake_rollout(4, 2, 1, seed=9)], step=50)
    torch.testing.assert_close(buf.weights(), torch.full((4,), 0.25, dtype=torch.float64))
    tiny = RolloutBuffer(BufferConfig(decay=1e-3))
    tiny.add([fake_rollout(4, 2, 1)], step=0)
    tiny.add([fake_rollout(4, 2, 1, seed=1)], step=10_000)
    assert len(tiny.sample(2)) == 2  # weight 1e-30000 underflows to 0, the Gumbel trick does not care


def test_samples_feed_make_batches_and_packing(llama):
    d = make_drafter(llama)
    buf = RolloutBuffer()
    buf.add([fake_rollout(T, 2, 1, seed=T) for T in (5, 9, 3)], step=1)
    samples = buf.sample(3, torch.Generator().manual_seed(0))
    assert all(isinstance(s, DrafterSample) for s in samples)
    (padded,) = make_batches(samples, d.config, 3, shuffle=False)
    (packed,) = pack_batches(samples, d.config, budget=16, shuffle=False)
    with torch.no_grad():
        loss_pad, _ = drafter_losses(d, llama, padded)
        loss_pack, _ = drafter_losses(d, llama, packed)
    torch.testing.assert_close(loss_pack, loss_pad, rtol=1e-5, atol=1e-6)


def test_state_dict_roundtrip():
    buf = RolloutBuffer(BufferConfig(max_mb=8))
    buf.add([fake_rollout(5, 2, 1, seed=i) for i in range(3)], step=7)
    small = buf.state_dict()
    assert small == {"current_step": 7, "added": 3, "evicted": 0, "dropped": 0}
    fresh = RolloutBuffer(BufferConfig(max_mb=8))
    fresh.load_state_dict(small)
    assert fresh.current_step == 7 and len(fresh) == 0
    full = buf.state_dict(include_data=True)
    restored = RolloutBuffer(BufferConfig(max_mb=8))
    restored.load_state_dict(full)
    assert len(restored) == 3 and restored.size_mb == pytest.approx(buf.size_mb)
    assert restored._items[1].features.equal(buf._items[1].features)
    restored.load_state_dict({})  # missing keys are tolerated
    assert restored.current_step == 7


def test_errors():
    with pytest.raises(ValueError, match="max_mb must be a number > 0, got -5"):
        BufferConfig(max_mb=-5)
    with pytest.raises(ValueError, match="max_mb must be a number > 0, got 0"):
        BufferConfig(max_mb=0)
    with pytest.raises(ValueError, match="max_mb must be finite, got inf"):
        BufferConfig(max_mb=math.inf)
    with pytest.raises(ValueError, match=r"decay must be in \(0, 1\], got 0"):
        BufferConfig(decay=0)
    with pytest.raises(ValueError, match=r"decay must be in \(0, 1\], got 1.5"):
        BufferConfig(decay=1.5)
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype, got torch.int64"):
        BufferConfig(dtype=torch.long)
    with pytest.raises(ValueError, match="device must be a torch device string such as 'cpu', got 'gpu0'"):
        BufferConfig(device="gpu0")
    buf = RolloutBuffer()
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        buf.add([], step=-1)
    with pytest.raises(ValueError, match="step must be an int >= 0, got -3"):
        buf.set_step(-3)
    r = fake_rollout(4, 2, 1)
    r.features = None
    with pytest.raises(ValueError, match=r"rollouts\[0\] has no features"):
        buf.add([r], step=0)
    with pytest.raises(ValueError, match=r"rollouts\[0\].features must be \[T=4, C, H\], got \[3, 1, 64\]"):
        bad = fake_rollout(4, 2, 1)
        bad.features = bad.features[:3]
        buf.add([bad], step=0)
    buf.add([fake_rollout(4, 2, 1)], step=0)
    with pytest.raises(ValueError, match=r"have \[C, H\] = \[2, 64\], the buffer holds \[1, 64\]"):
        buf.add([fake_rollout(4, 2, 2)], step=0)
    with pytest.raises(ValueError, match="n must be an int >= 0, got -2"):
        buf.sample(-2)
    assert buf.sample(0) == [] and RolloutBuffer().sample(3) == []


def test_eagle3_rollout_features_roundtrip(qwen2):
    cfg = DrafterConfig.from_target(qwen2, "eagle3")
    buf = RolloutBuffer()
    buf.add([fake_rollout(6, 3, 4)], step=0)
    (batch,) = make_batches(buf.sample(1), cfg, 1)
    assert batch.features.shape == (1, 5, 3, H) and batch.target_hidden.dtype == torch.float32
