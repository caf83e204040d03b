"""Importance sampling: probabilities, without-replacement draws, scorers, the batch sampler."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tests.efficiency.lm_helpers import collate, tiny_lm, toy_dataset
from tlt_lightning.efficiency.sampler import (
    ImportanceSampler,
    ImportanceSamplerConfig,
    LossScorer,
    RhoLossScorer,
    per_example_loss,
    sample_without_replacement,
    selection_probabilities,
)


def test_selection_probabilities_are_the_tempered_softmax():
    scores = torch.tensor([0.0, math.log(2), math.log(3)])
    torch.testing.assert_close(selection_probabilities(scores), torch.tensor([1 / 6, 2 / 6, 3 / 6]))
    # T = 2 halves the log-odds: weights sqrt(1), sqrt(2), sqrt(3).
    w = torch.tensor([1.0, math.sqrt(2), math.sqrt(3)])
    torch.testing.assert_close(selection_probabilities(scores, 2.0), w / w.sum())


def test_draws_are_without_replacement_and_in_range():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(500, 20, generator=g)
    picks = sample_without_replacement(scores, 15, 0.5, g)
    assert picks.shape == (500, 15) and picks.min() >= 0 and picks.max() < 20
    sorted_picks = picks.sort(-1).values
    assert (sorted_picks[:, 1:] != sorted_picks[:, :-1]).all()  # distinct within every row
    assert sample_without_replacement(scores[0], 20, 1.0, g).sort().values.tolist() == list(range(20))


def test_first_draw_frequencies_match_the_softmax():
    scores = torch.tensor([0.0, 1.0, 2.0, -1.0])
    g = torch.Generator().manual_seed(1)
    picks = sample_without_replacement(scores.expand(40_000, 4), 1, 1.5, g)[:, 0]
    freq = torch.bincount(picks, minlength=4).double() / len(picks)
    torch.testing.assert_close(freq, selection_probabilities(scores, 1.5).double(), atol=0.01, rtol=0)


def test_inclusion_probabilities_match_sequential_sampling():
    """k = 2 of 4: P(i chosen) = p_i + sum_j p_j p_i / (1 - p_j), draw one, renormalise, draw again."""
    scores, temperature = torch.tensor([1.0, 0.0, 2.0, 0.5]), 0.8
    p = selection_probabilities(scores, temperature).double()
    exact = torch.tensor([p[i] + sum(p[j] * p[i] / (1 - p[j]) for j in range(4) if j != i) for i in range(4)])
    g = torch.Generator().manual_seed(2)
    picks = sample_without_replacement(scores.expand(40_000, 4), 2, temperature, g)
    freq = torch.bincount(picks.flatten(), minlength=4).double() / 40_000
    torch.testing.assert_close(freq, exact.double(), atol=0.012, rtol=0)
    assert abs(float(exact.sum()) - 2) < 1e-6  # k draws in all (fp32 softmax)


def test_temperature_moves_between_top_k_and_uniform():
    scores = torch.arange(10.0)
    g = torch.Generator().manual_seed(3)
    assert sample_without_replacement(scores, 3, 1e-3, g).sort().values.tolist() == [7, 8, 9]
    picks = sample_without_replacement(scores.expand(20_000, 10), 1, 1e4, g)
    freq = torch.bincount(picks.flatten(), minlength=10).double() / 20_000
    assert (freq - 0.1).abs().max() < 0.015


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan")])
def test_bad_temperature_raises_naming_it(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        ImportanceSamplerConfig(batch_size=4, temperature=temperature)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        sample_without_replacement(torch.zeros(4), 2, temperature)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        selection_probabilities(torch.zeros(4), temperature)


def test_bad_arguments_raise_naming_them():
    with pytest.raises(ValueError, match=r"candidate_factor must be a finite number >= 1, got 0.5"):
        ImportanceSamplerConfig(batch_size=4, candidate_factor=0.5)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        ImportanceSamplerConfig(batch_size=0)
    with pytest.raises(ValueError, match="num_batches must be an int >= 1 or None"):
        ImportanceSamplerConfig(batch_size=2, num_batches=0)
    with pytest.raises(ValueError, match=r"k must be an int in \[1, 4\]"):
        sample_without_replacement(torch.zeros(4), 5)
    with pytest.raises(ValueError, match="scores must be finite"):
        sample_without_replacement(torch.tensor([0.0, float("nan")]), 1)
    with pytest.raises(ValueError, match=r"dataset_size must be an int >= batch_size \(8\), got 4"):
        ImportanceSampler(4, lambda idx: torch.zeros(len(idx)), ImportanceSamplerConfig(batch_size=8))
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        LossScorer(tiny_lm(), [], collate, chunk_size=0)
    with pytest.raises(
        ValueError, match=r"rank must be an int >= 0 or None \(the torch.distributed rank\), got -1"
    ):
        ImportanceSampler(
            8, lambda idx: torch.zeros(len(idx)), ImportanceSamplerConfig(batch_size=2), rank=-1
        )


def test_per_example_loss_matches_cross_entropy_by_hand():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    labels[0, :3] = -100  # prompt
    labels[2, 1:] = -100  # nothing to predict: 0, not NaN
    out = per_example_loss(logits, labels)
    row0 = F.cross_entropy(logits[0, 2:4], labels[0, 3:5])  # positions 2, 3 predict tokens 3, 4
    row1 = F.cross_entropy(logits[1, :4], labels[1, 1:])
    torch.testing.assert_close(out, torch.stack([row0, row1, torch.tensor(0.0)]))


def test_loss_scorer_matches_the_model_and_chunking():
    model, data = tiny_lm(seed=1).train(), toy_dataset(12)
    scorer = LossScorer(model, data, collate)
    idx = [3, 0, 7, 11, 5]
    got = scorer(idx)
    with torch.no_grad():
        for i, value in zip(idx, got):
            ex = collate([data[i]])
            assert (
                abs(float(model.eval()(input_ids=ex["input_ids"], labels=ex["labels"]).loss) - float(value))
                < 1e-5
            )
    model.train()
    torch.testing.assert_close(LossScorer(model, data, collate, chunk_size=2)(idx), got, atol=1e-5, rtol=0)
    assert model.training  # restored after scoring in eval mode


def test_rho_loss_scorer_subtracts_cached_holdout_losses():
    learner, holdout, data = tiny_lm(seed=1), tiny_lm(seed=2), toy_dataset(12)
    calls = []
    scorer = RhoLossScorer(learner, holdout, data, collate)
    original = scorer.losses
    scorer.losses = lambda model, idx: calls.append((model is holdout, list(idx))) or original(model, idx)
    idx = [1, 4, 9]
    rho = scorer(idx)
    expected = LossScorer(learner, data, collate)(idx) - LossScorer(holdout, data, collate)(idx)
    torch.testing.assert_close(rho, expected)
    scorer([4, 9, 2])
    assert [c for c in calls if c[0]] == [(True, [1, 4, 9]), (True, [2])]  # holdout losses computed once


def test_sampler_prefers_high_scores_and_replays_from_its_state():
    config = ImportanceSamplerConfig(batch_size=4, candidate_factor=5, temperature=1e-3, seed=0)
    sampler = ImportanceSampler(100, lambda idx: torch.tensor(idx, dtype=torch.float32), config)
    assert len(sampler) == 25
    state = sampler.state_dict()
    batches = list(sampler)
    assert len(batches) == 25 and all(len(b) == 4 == len(set(b)) for b in batches)
    s = sampler.last_stats
    assert s.selected_score > s.candidate_score and s.max_probability > 0.99
    replay = ImportanceSampler(100, lambda idx: torch.tensor(idx, dtype=torch.float32), config)
    replay.load_state_dict(state)
    replay.load_state_dict({})  # missing keys are tolerated
    assert list(replay) == batches


def test_candidate_factor_one_is_uniform_and_never_scores():
    def scorer(idx):
        raise AssertionError("no choice to make: the scorer must not run")

    sampler = ImportanceSampler(
        10, scorer, ImportanceSamplerConfig(batch_size=5, candidate_factor=1, num_batches=3)
    )
    assert [len(b) for b in sampler] == [5, 5, 5]


def test_sampler_feeds_a_dataloader_with_a_real_proxy():
    data, proxy = toy_dataset(40), tiny_lm(seed=3)
    config = ImportanceSamplerConfig(batch_size=4, candidate_factor=10, temperature=0.5, num_batches=3)
    sampler = ImportanceSampler(len(data), LossScorer(proxy, data, collate, chunk_size=16), config)
    batches = list(DataLoader(data, batch_sampler=sampler, collate_fn=collate))
    assert len(batches) == 3 and all(b["input_ids"].shape[0] == 4 for b in batches)
    assert sampler.last_stats is not None and math.isfinite(sampler.last_stats.selected_score)


def _ddp_sampler(rank=None, seed=0):
    config = ImportanceSamplerConfig(
        batch_size=4, candidate_factor=3, temperature=1.0, num_batches=5, seed=seed
    )
    return ImportanceSampler(100, lambda idx: torch.tensor(idx, dtype=torch.float32) / 50, config, rank=rank)


def test_each_rank_draws_its_own_reproducible_batches():
    runs = {rank: list(_ddp_sampler(rank)) for rank in (0, 1, 2)}
    for a, b in ((0, 1), (0, 2), (1, 2)):  # every batch differs between ranks
        assert all(x != y for x, y in zip(runs[a], runs[b])), (a, b)
    assert list(_ddp_sampler(1)) == runs[1]  # each rank's stream is reproducible
    assert list(_ddp_sampler(1, seed=1)) != runs[1]  # and follows the seed
    # Lightning checkpoints keep rank 0's callback state: the batch count resumes every rank's own stream.
    rank0 = _ddp_sampler(0)
    it = iter(rank0)
    next(it), next(it)
    resumed = _ddp_sampler(1)
    resumed.load_state_dict(rank0.state_dict())
    assert list(resumed)[:3] == runs[1][2:5]
    resumed.load_state_dict({"generator": torch.Generator().get_state()})  # an old state: count kept
    assert resumed.batches_drawn == 7


def test_rank_defaults_to_the_process_group_rank(monkeypatch):
    import tlt_lightning.efficiency.sampler as sampler_module

    sampler = _ddp_sampler()  # built before the process group exists (as before a DDP launch)
    assert sampler.current_rank() == 0
    monkeypatch.setattr(sampler_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sampler_module.dist, "get_rank", lambda group=None: 2)
    assert sampler.current_rank() == 2
    assert list(sampler) == list(_ddp_sampler(2))  # iterating inside the process group: rank 2's batches
    assert _ddp_sampler(rank=1).current_rank() == 1  # an explicit rank wins
