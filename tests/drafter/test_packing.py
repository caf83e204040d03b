from __future__ import annotations

import pytest
import torch

from tlt_lightning.drafter import DrafterConfig, DrafterLoss, make_batches, pack_batches
from tlt_lightning.drafter.batches import unroll_mask
from tlt_lightning.drafter.packing import fill_ratio, pack_bins
from tlt_lightning.drafter.train import drafter_losses

from .conftest import make_drafter
from .test_train import fake_rollout


def rollouts_for(cfg: DrafterConfig, lengths, seed: int = 0):
    C = len(cfg.rollout_feature_layers)
    return [fake_rollout(T, 2 + i % 3, C, seed + i) for i, T in enumerate(lengths)]


def test_pack_bins_best_fit_decreasing():
    assert pack_bins([5, 3, 4, 2], budget=7) == [[0, 3], [2, 1]]
    bins = pack_bins([1] * 10 + [9, 8], budget=10)
    assert sorted(i for b in bins for i in b) == list(range(12))
    assert len(bins) == 3  # 9+1, 8+1+1, 7 x 1 (the optimum)
    assert pack_bins([], 4) == []


def test_pack_bins_errors():
    with pytest.raises(ValueError, match="budget must be a positive int, got -4"):
        pack_bins([1], -4)
    with pytest.raises(ValueError, match=r"lengths must lie in 1..budget=4, got \[5, 0\]"):
        pack_bins([1, 5, 0], 4)


def test_pack_batches_layout(llama):
    cfg = DrafterConfig.from_target(llama, "eagle1")
    rs = rollouts_for(cfg, [6, 4, 3])  # 5, 3, 2 samples
    (batch,) = pack_batches(rs, cfg, budget=8, rows=2, shuffle=False)
    assert batch.tokens.shape == (2, 8)
    assert batch.doc_ids.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1], [2, 2, -1, -1, -1, -1, -1, -1]]
    assert batch.mask.sum() == 10 and fill_ratio([batch]) == 10 / 16
    # Positions restart per document at its true target position (prompt_len - 1 + i).
    assert batch.positions[0, :8].tolist() == [1, 2, 3, 4, 5, 2, 3, 4]
    assert batch.tokens[0, 5:8].equal(rs[1].token_ids[:3])
    assert batch.target_hidden[1, :2].equal(rs[2].features[1:, -1])
    assert batch.sample_index()[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    mask = batch.attention_mask
    assert mask.shape == (2, 1, 8, 8)
    assert not mask[0, 0, 5:, :5].any() and mask[0, 0, 7, 5:].all()  # block-diagonal, causal
    (wide,) = pack_batches(rs, cfg, budget=8, rows=2, shuffle=False, pad_to_budget=True)
    assert wide.tokens.shape == (2, 8)
    # A rollout longer than the budget is split into budget-sized documents.
    long = pack_batches(rollouts_for(cfg, [12]), cfg, budget=4, shuffle=False)
    assert [b.num_samples for b in long] == [4, 4, 3]


def test_pack_batches_errors(llama):
    cfg = DrafterConfig.from_target(llama, "eagle1")
    with pytest.raises(ValueError, match="budget must be a positive int, got 0"):
        pack_batches([], cfg, budget=0)
    with pytest.raises(ValueError, match="rows must be a positive int, got -1"):
        pack_batches([], cfg, budget=8, rows=-1)
    r = rollouts_for(cfg, [5])[0]
    r.features = None
    with pytest.raises(ValueError, match=r"rollouts\[0\] has no features"):
        pack_batches([r], cfg, budget=8)


@pytest.mark.parametrize(("kind", "unroll"), [("eagle1", 1), ("eagle1", 3), ("eagle3", 2)])
def test_packed_loss_equals_padded_loss(llama, kind, unroll):
    d = make_drafter(llama, kind)
    rs = rollouts_for(d.config, [9, 3, 6, 2, 5, 4])
    loss_cfg = DrafterLoss.for_kind(kind, unroll_steps=unroll)
    (padded,) = make_batches(rs, d.config, batch_size=len(rs), shuffle=False)
    packed = pack_batches(rs, d.config, budget=10, rows=8, shuffle=False)
    assert len(packed) == 1 and packed[0].tokens.shape[0] < len(rs)
    with torch.no_grad():
        loss_pad, m_pad = drafter_losses(d, llama, padded, loss_cfg)
        loss_pack, m_pack = drafter_losses(d, llama, packed[0], loss_cfg)
    torch.testing.assert_close(loss_pack, loss_pad, rtol=1e-5, atol=1e-6)
    for key in m_pad:
        torch.testing.assert_close(m_pack[key], m_pad[key], rtol=1e-5, atol=1e-6)


def test_packed_per_sample_losses_match_alone(llama):
    """Packed CE over several documents = the sample-weighted mean of each document trained alone."""
    d = make_drafter(llama)
    rs = rollouts_for(d.config, [7, 4, 5])
    with torch.no_grad():
        alone = [drafter_losses(d, llama, make_batches([r], d.config, 1, False)[0])[1] for r in rs]
        (packed,) = pack_batches(rs, d.config, budget=13, shuffle=False)
        _, m = drafter_losses(d, llama, packed)
    n = [r.length - 1 for r in rs]
    expected = sum(a["ce_loss"] * k for a, k in zip(alone, n)) / sum(n)
    torch.testing.assert_close(m["ce_loss"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("unroll", [1, 2])
def test_no_attention_across_documents(llama, unroll):
    d = make_drafter(llama, "eagle3").eval()
    rs = rollouts_for(d.config, [6, 5, 4])
    (batch,) = pack_batches(rs, d.config, budget=16, shuffle=False)
    assert batch.doc_ids[0, :12].tolist() == [0] * 5 + [1] * 4 + [2] * 3

    def outputs(b):
        with torch.no_grad():
            h = d(b.tokens, d.lift(b.features), b.positions, unroll_mask(b.mask, 1, b.doc_ids))
            if unroll == 1:
                return h
            shifted = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)
            from tlt_lightning.drafter.train import ConcatCache

            cache = ConcatCache()
            d(b.tokens, d.lift(b.features), b.positions, unroll_mask(b.mask, 1, b.doc_ids), cache)
            return d(b.tokens, shifted, b.positions, unroll_mask(b.mask, 2, b.doc_ids), cache)

    base = outputs(batch)
    perturbed = pack_batches(rs, d.config, budget=16, shuffle=False)[0]
    perturbed.features[0, 5:9] += 5.0  # document 1 only
    perturbed.tokens[0, 5:9] = (perturbed.tokens[0, 5:9] + 1) % 128
    out = outputs(perturbed)
    in_step = batch.sample_index()[0] >= unroll - 1
    for lo, hi in ((0, 5), (9, 12)):  # documents 0 and 2 are unchanged
        keep = in_step[lo:hi]
        torch.testing.assert_close(out[0, lo:hi][keep], base[0, lo:hi][keep], rtol=0, atol=1e-6)
    assert not torch.allclose(out[0, 5:9], base[0, 5:9])


def test_padded_batches_keep_their_behaviour(llama):
    """make_batches rows carry no doc_ids: the mask is the plain causal unroll mask."""
    cfg = DrafterConfig.from_target(llama, "eagle1")
    (b,) = make_batches(rollouts_for(cfg, [5, 3]), cfg, 2, shuffle=False)
    assert b.doc_ids is None
    assert b.attention_mask.equal(unroll_mask(b.mask, 1))
    assert b.sample_index().tolist() == [[0, 1, 2, 3]] * 2
    assert b.to("cpu").doc_ids is None
