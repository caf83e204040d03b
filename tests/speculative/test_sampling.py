import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tlt_lightning.speculative import SamplingParams, sample, sampling_probs


def _logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_one_hot_on_argmax() -> None:
    logits = _logits(4, 3, 11)
    probs = sampling_probs(logits, SamplingParams(temperature=0.0, top_p=0.5, top_k=2))
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 11).float())


def test_greedy_breaks_ties_towards_lowest_id() -> None:
    probs = sampling_probs(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), SamplingParams(temperature=0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_temperature_only_is_softmax() -> None:
    logits = _logits(5, 9)
    probs = sampling_probs(logits.bfloat16(), SamplingParams(temperature=0.7))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, (logits.bfloat16().float() / 0.7).softmax(-1))


@pytest.mark.parametrize("k", [1, 3, 8])
def test_top_k_keeps_exactly_k(k: int) -> None:
    logits = _logits(64, 20, seed=k)
    probs = sampling_probs(logits, SamplingParams(top_k=k))
    kept = probs > 0
    assert torch.equal(kept.sum(-1), torch.full((64,), k))
    top = torch.zeros_like(kept).scatter_(-1, logits.topk(k, -1).indices, True)
    assert torch.equal(kept, top)
    # Kept tokens keep their relative weights.
    expected = logits.masked_fill(~top, float("-inf")).softmax(-1)
    torch.testing.assert_close(probs, expected)


def test_top_k_at_least_vocab_is_a_no_op() -> None:
    logits = _logits(3, 6)
    torch.testing.assert_close(sampling_probs(logits, SamplingParams(top_k=6)), logits.softmax(-1))
    torch.testing.assert_close(sampling_probs(logits, SamplingParams(top_k=50)), logits.softmax(-1))


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_keeps_smallest_set_reaching_p(top_p: float) -> None:
    logits = _logits(200, 12, seed=3)
    full = logits.softmax(-1)
    probs = sampling_probs(logits, SamplingParams(top_p=top_p))
    for row_full, row in zip(full.double(), probs):
        order = row_full.argsort(descending=True)
        cum = row_full[order].cumsum(0)
        size = int((cum < top_p - 1e-6).sum()) + 1  # the first prefix whose mass reaches top_p
        kept = set(order[:size].tolist())
        assert set(row.nonzero().flatten().tolist()) == kept
        assert row_full[order[:size]].sum() >= top_p - 1e-6
        assert size == 1 or row_full[order[: size - 1]].sum() < top_p
        torch.testing.assert_close(row[order[:size]].double(), row_full[order[:size]] / cum[size - 1])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.3, top_k=4),
        SamplingParams(temperature=1.7, top_p=0.8),
        SamplingParams(temperature=1.0, top_p=0.6, top_k=5),
        SamplingParams(temperature=0.0),
    ],
)
def test_rows_sum_to_one(params: SamplingParams) -> None:
    probs = sampling_probs(_logits(2, 7, 33), params)
    assert probs.shape == (2, 7, 33)
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 7))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
    ],
)
def test_invalid_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} must"):
        SamplingParams(**kwargs)


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.5).greedy


def test_sample_is_reproducible_and_shaped() -> None:
    probs = sampling_probs(_logits(3, 4, 10), SamplingParams())
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs, torch.Generator().manual_seed(7))
    assert a.shape == (3, 4) and a.dtype == torch.int64
    assert torch.equal(a, b)


def test_sample_follows_probs() -> None:
    probs = sampling_probs(_logits(10), SamplingParams(top_p=0.95))
    draws = sample(probs.expand(40_000, -1), torch.Generator().manual_seed(1))
    counts = np.bincount(draws.numpy(), minlength=10)
    support = probs.numpy() > 0
    assert counts[~support].sum() == 0
    expected = probs.double().numpy()[support] * len(draws)
    assert chisquare(counts[support], expected * counts.sum() / expected.sum()).pvalue > 1e-3
