"""The statistics of a certificate: binned goodness of fit, Holm's correction, detectable deviation.

Pure functions on tensors (no model). A test compares observed token counts with the counts a target
predicts. Vocabularies are large and most tokens are rare, so each law is *binned*: every outcome
with an expected count of at least ``min_expected`` is a bin of its own (the ``max_bins`` largest at
most), everything else is pooled into one "rest" bin, and Pearson's chi-square is taken over the bins
(its chi-square law holds once every expected count is about 5 or more). An outcome the target gives
probability zero that was observed anyway (a token outside the nucleus) fails the test outright.

Power. For a deviation ``delta`` of the binned law, Pearson's statistic is non-central chi-square with
``lambda = n * sum(delta**2 / p)``, and by Cauchy-Schwarz ``lambda >= 4 n TV**2`` for every deviation of
total variation ``TV`` (the worst case tilts mass proportionally between two halves of the law). So
the smallest ``TV`` a test detects with the requested power is ``sqrt(lambda* / (4 n))``, with
``lambda*`` the non-centrality at which a level-``alpha`` test of ``df`` degrees of freedom rejects with
that power (:func:`detectable_tv`): a guarantee for every direction, not an average.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["IMPOSSIBLE", "BinnedTest", "binned_chi_square", "chi2_sf", "detectable_tv", "holm"]

IMPOSSIBLE = 1e-12  # a target probability below this is zero (sampling_probs zeroes what top-p/top-k drop)


class BinnedTest(NamedTuple):
    """Pearson's chi-square over binned laws, pooled over ``G`` groups (histories).

    Attributes:
        statistic: the chi-square statistic, summed over groups.
        df: degrees of freedom, summed over groups (``bins - 1`` each).
        pvalue: ``P(chi2_df >= statistic)``; ``0`` if an impossible outcome was observed; ``1`` if
            ``df == 0``.
        n: observations in the groups that have at least two bins.
        impossible: observations of outcomes the target gives probability zero.
        observed: ``[G, V + 1]`` counts per bin (the last column is each group's rest bin).
        expected: ``[G, V + 1]`` expected counts per bin, ``0`` where an outcome is not a bin of its own.
    """

    statistic: float
    df: int
    pvalue: float
    n: int
    impossible: int
    observed: torch.Tensor
    expected: torch.Tensor


def binned_chi_square(
    counts: torch.Tensor,
    probs: torch.Tensor,
    min_expected: float = 5.0,
    max_bins: int = 32,
    pool_last: bool = False,
    impossible_below: float = IMPOSSIBLE,
) -> BinnedTest:
    """Test observed counts against a target's laws, one law per group, pooled into one statistic.

    Args:
        counts: ``[G, V]`` observed counts per group and outcome.
        probs: ``[G, V]`` the target's probabilities (rows sum to 1).
        min_expected: an outcome is a bin of its own when its expected count reaches this.
        max_bins: at most this many own bins per group (the most likely; more bins cost power
            against the worst-case deviation, see :func:`detectable_tv`).
        pool_last: the last outcome always joins the rest bin (an outcome defined by what was not
            observed, whose own count would be 0 by construction).
        impossible_below: an observed outcome of a smaller probability fails the test outright (for a
            joint law of ``D`` tokens ``IMPOSSIBLE ** D``: a product of possible tokens can be tiny).

    Returns:
        A :class:`BinnedTest`.

    Example:
        >>> t = binned_chi_square(torch.tensor([[52.0, 48.0]]), torch.tensor([[0.5, 0.5]]))
        >>> t.df, round(t.pvalue, 2)
        (1, 0.69)
    """
    counts, probs = counts.double(), probs.double()
    n = counts.sum(-1, keepdim=True)  # [G, 1]
    impossible = int(counts[probs < impossible_below].sum())
    expected = n * probs
    order = expected.argsort(-1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(probs.shape[-1]).expand_as(order))
    own = (expected >= min_expected) & (rank < max_bins)  # [G, V]
    if pool_last:
        own[:, -1] = False
    obs = torch.cat([counts * own, (counts * ~own).sum(-1, keepdim=True)], -1)  # [G, V + 1]
    exp = torch.cat([expected * own, (expected * ~own).sum(-1, keepdim=True)], -1)
    # A rest bin too small for the chi-square law joins the smallest own bin.
    small = exp[:, -1] < min_expected
    smallest = torch.where(own, expected, torch.full_like(expected, math.inf)).argmin(-1)  # [G]
    rows = small.nonzero().squeeze(1)
    obs[rows, smallest[rows]] += obs[rows, -1]
    exp[rows, smallest[rows]] += exp[rows, -1]
    obs[rows, -1] = 0
    exp[rows, -1] = 0
    bins = (exp > 0).sum(-1)  # [G]
    informative = bins >= 2
    terms = torch.where(exp > 0, (obs - exp) ** 2 / exp.clamp(min=1e-300), torch.zeros_like(exp))
    statistic = float(terms[informative].sum())
    df = int((bins[informative] - 1).sum())
    if impossible:
        pvalue = 0.0
    else:
        pvalue = chi2_sf(statistic, df) if df else 1.0
    n_used = int(n[informative].sum())
    return BinnedTest(statistic, df, pvalue, n_used, impossible, obs.float(), exp.float())


def chi2_sf(x: float, df: int) -> float:
    """``P(chi2_df >= x)``, the survival function of the chi-square law (no scipy needed)."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2.0)))


def _chi2_quantile(q: float, df: float) -> float:
    """``x`` with ``P(chi2_df >= x) = q``, by bisection (``df`` may be fractional)."""
    lo, hi = 0.0, max(10.0, df + 20 * math.sqrt(2 * df) + 40 * math.log(1 / q))
    a = torch.tensor(df / 2, dtype=torch.float64)
    for _ in range(200):
        mid = (lo + hi) / 2
        if float(torch.special.gammaincc(a, torch.tensor(mid / 2, dtype=torch.float64))) > q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _noncentral_power(crit: float, df: int, lam: float) -> float:
    """``P(chi2_df(lam) >= crit)``: the non-central law as a Poisson(``lam / 2``) mixture of central ones."""
    half = lam / 2
    j = torch.arange(int(half + 12 * math.sqrt(half) + 60), dtype=torch.float64)
    log_weights = (
        j * math.log(half) - half - torch.lgamma(j + 1) if half > 0 else torch.where(j == 0, 0.0, -math.inf)
    )
    tails = torch.special.gammaincc(df / 2 + j, torch.full_like(j, crit / 2))
    return float((log_weights.exp() * tails).sum())


def detectable_tv(n: int, df: int, alpha: float, power: float = 0.9) -> float:
    """The smallest total-variation deviation a binned test detects with ``power``, in every direction.

    Args:
        n: observations of the test.
        df: its degrees of freedom.
        alpha: the level it is run at (after any multiple-testing correction).
        power: the required probability of rejecting.

    Returns:
        ``sqrt(lambda* / (4 n))`` (see the module docstring); ``inf`` when ``n`` or ``df`` is 0.

    Example:
        >>> round(detectable_tv(10_000, df=1, alpha=0.05), 3)
        0.016
    """
    if n <= 0 or df <= 0:
        return math.inf
    crit = _chi2_quantile(alpha, df)
    lo, hi = 0.0, 1.0
    while _noncentral_power(crit, df, hi) < power:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _noncentral_power(crit, df, mid) < power else (lo, mid)
    return min(1.0, math.sqrt(hi / (4 * n)))


def holm(pvalues: list[float], alpha: float) -> list[bool]:
    """Holm's step-down correction: which of ``m`` tests reject at family-wise level ``alpha``.

    Example:
        >>> holm([0.001, 0.04, 0.5], alpha=0.05)
        [True, False, False]
    """
    rejected = [False] * len(pvalues)
    for step, i in enumerate(sorted(range(len(pvalues)), key=lambda j: pvalues[j])):
        if pvalues[i] > alpha / (len(pvalues) - step):
            break
        rejected[i] = True
    return rejected
