"""certify: our engine passes (plain, chain, tree; T=0.3, 1 and top-p 0.9), biased verifiers are caught."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chi2, ncx2

import tlt_lightning.rollout.speculative_step as speculative_step
from tlt_lightning.certify import (
    CertifyConfig,
    binned_chi_square,
    certify,
    detectable_tv,
    holm,
    plot_certificate,
    write_certificate,
)
from tlt_lightning.drafter import Drafter, DrafterConfig
from tlt_lightning.speculative import SamplingParams, parse_arm, sampling_probs, verify_chain

PROMPTS = [[5, 6, 7, 8]]
SETTINGS = {"T=1": {"temperature": 1.0}, "T=0.3": {"temperature": 0.3}, "top-p 0.9": {"top_p": 0.9}}


@pytest.fixture(scope="module")
def drafter(tiny_llama):
    torch.manual_seed(0)
    return Drafter(DrafterConfig.from_target(tiny_llama), tiny_llama).eval()


def small(**kw) -> CertifyConfig:
    return CertifyConfig(**{"rows": 1200, "depth": 3, "positions": (0,), "seed": 3, **kw})


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("arm", ["off", "chain4", "tree3x2/4", "chain3x2"])
def test_our_engine_is_certified_lossless(tiny_llama, drafter, arm, setting):
    cert = certify(tiny_llama, PROMPTS, small(**SETTINGS[setting]), drafter=drafter, arm=parse_arm(arm))
    assert cert.lossless, cert.summary()
    assert {t["depth"] for t in cert.tests} == {1, 2, 3, "joint"}
    assert 0 < cert.detectable_tv < 0.2


def accept_everything(target_probs, draft_probs, draft_tokens, generator=None):
    """A verifier without the rejection step: every draft is accepted, the bonus token sampled."""
    B, K = draft_tokens.shape
    result = verify_chain(target_probs, draft_probs, draft_tokens, generator)
    accepted = torch.arange(K).expand(B, K)
    return result._replace(num_accepted=torch.full((B,), K), accepted_nodes=accepted)


def hot_probs(logits, params: SamplingParams):
    """The verify path at a wrong temperature (1.3 times the configured one)."""
    return sampling_probs(logits, SamplingParams(params.temperature * 1.3, params.top_p, params.top_k))


@pytest.mark.parametrize("bias", [accept_everything, hot_probs], ids=["no-rejection", "wrong-temperature"])
@pytest.mark.parametrize("setting", ["T=1", "top-p 0.9"])
def test_a_biased_verifier_is_caught(tiny_llama, drafter, monkeypatch, bias, setting):
    name = "verify_chain" if bias is accept_everything else "sampling_probs"
    monkeypatch.setattr(speculative_step, name, bias)
    cert = certify(tiny_llama, PROMPTS, small(**SETTINGS[setting]), drafter=drafter, arm=parse_arm("chain4"))
    assert not cert.lossless
    assert "NOT LOSSLESS" in cert.summary()


def test_an_impossible_token_fails_outright():
    test = binned_chi_square(torch.tensor([[50.0, 49.0, 1.0]]), torch.tensor([[0.5, 0.5, 0.0]]))
    assert test.impossible == 1 and test.pvalue == 0.0


def test_the_chi_square_matches_scipy_and_pools_rare_outcomes():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.05, 0.03, 0.02]])
    counts = torch.tensor([[70.0, 65.0, 42.0, 12.0, 7.0, 4.0]])
    test = binned_chi_square(counts, probs, min_expected=5.0)
    # own bins: 80, 60, 40, 10, 6 expected; the rest (4) is too small and joins the smallest (6)
    assert test.df == 4
    obs, exp = [70, 65, 42, 12, 11], [80, 60, 40, 10, 10]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    assert test.statistic == pytest.approx(stat)
    assert test.pvalue == pytest.approx(chi2.sf(stat, 4), rel=1e-6)


@pytest.mark.parametrize("df", [1, 10, 60])
def test_the_detectable_deviation_has_the_power_it_claims(df):
    n, alpha = 5000, 0.001
    tv = detectable_tv(n, df, alpha, power=0.9)
    lam = 4 * n * tv**2  # the worst case direction's non-centrality
    assert ncx2.sf(chi2.isf(alpha, df), df, lam) == pytest.approx(0.9, abs=0.01)
    assert detectable_tv(4 * n, df, alpha) == pytest.approx(tv / 2, rel=1e-3)
    assert math.isinf(detectable_tv(0, df, alpha))


def test_holm_steps_down():
    assert holm([0.001, 0.02, 0.04], alpha=0.05) == [True, True, True]
    assert holm([0.001, 0.03, 0.04], alpha=0.05) == [True, False, False]


def test_the_certificate_writes_json_and_a_plot(tiny_llama, tmp_path):
    cert = certify(tiny_llama, PROMPTS, small(rows=300, depth=2))
    path = write_certificate(cert, tmp_path)
    assert path.name == "certificate.json" and '"lossless": true' in path.read_text()
    assert (tmp_path / "certificate.png").read_bytes()[:4] == b"\x89PNG"
    assert plot_certificate(cert, tmp_path / "again.png").exists()


def test_a_tiny_joint_probability_of_possible_tokens_is_not_impossible():
    # Three tokens of probability 1e-5 each: the sequence has 1e-15, below the per-token bound.
    counts, probs = torch.tensor([[1.0, 99.0]]), torch.tensor([[1e-15, 1 - 1e-15]], dtype=torch.float64)
    assert binned_chi_square(counts, probs).impossible == 1  # as one token: impossible
    assert binned_chi_square(counts, probs, impossible_below=1e-12**3).impossible == 0
    assert (
        binned_chi_square(
            counts, probs.clone().fill_(0).index_fill_(1, torch.tensor([1]), 1.0), impossible_below=1e-12**3
        ).impossible
        == 1
    )  # an exact 0 still is


def test_a_certain_next_token_gives_no_power_and_says_so(tiny_llama):
    cert = certify(tiny_llama, PROMPTS, small(rows=50, depth=1, top_k=1))  # one possible token
    assert cert.lossless and math.isinf(cert.detectable_tv)
    assert cert.verdict.startswith("NO POWER: no deviation found")
    assert "choose other positions" in cert.verdict


def test_bad_settings_are_rejected(tiny_llama):
    with pytest.raises(ValueError, match="temperature must be > 0"):
        CertifyConfig(temperature=0)
    with pytest.raises(ValueError, match="positions must be a non-empty list"):
        CertifyConfig(positions=())
    with pytest.raises(ValueError, match="needs a drafter"):
        certify(tiny_llama, PROMPTS, small(), arm=parse_arm("chain2"))
