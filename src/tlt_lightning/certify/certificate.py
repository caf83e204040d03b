"""``certify``: a statistical certificate that a rollout stack samples from its target's own law.

For a few *sites* (a prompt plus a continuation sampled once, cut at chosen positions), ``rows``
continuations of ``depth`` tokens are drawn through the stack under test: our engine's decode step
(plain, or speculative with any chain or tree arm and any drafter) or any rollout backend. They are
compared with the target's exact laws (:mod:`~tlt_lightning.certify.exact`) by binned chi-square
tests (:mod:`~tlt_lightning.certify.stats`): per site and depth the next token given the tokens
before it, and the joint law of the whole continuation (what a speculative step that emits several
tokens at once must get right). Holm's correction keeps the family-wise false alarm rate at ``alpha``;
each test reports the smallest total-variation deviation it detects with ``power``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tlt_lightning.certify.draw import draw_with_backend, draw_with_step
from tlt_lightning.certify.exact import DepthLaws, exact_laws
from tlt_lightning.certify.stats import IMPOSSIBLE, BinnedTest, binned_chi_square, detectable_tv, holm
from tlt_lightning.models.target import TargetModel
from tlt_lightning.rollout.drafting import DraftModel
from tlt_lightning.rollout.engine import PlainStep, RolloutBackend, RolloutEngine
from tlt_lightning.rollout.speculative_step import SpeculativeStep
from tlt_lightning.rollout.types import RolloutConfig
from tlt_lightning.speculative import DraftSpec, SamplingParams
from tlt_lightning.validation import check, is_int, is_number, positive_int

__all__ = ["Certificate", "CertifyConfig", "certify"]


@dataclass(frozen=True)
class CertifyConfig:
    """What a certificate samples and tests.

    Args:
        temperature, top_p, top_k: the sampling settings under test.
        rows: samples per site.
        depth: tokens per sample (``>= 2`` also tests the joint law).
        positions: where each prompt's continuation is cut to make a site (``0``: the prompt alone).
        alpha: family-wise false alarm rate over all tests.
        power: the power each test's detectable deviation is computed for.
        min_expected: an outcome is a bin of its own from this expected count.
        max_bins: own bins per law at most (fewer bins: more power against the worst case).
        chunk: rows per batch.
        seed: the random seed of the continuations and the samples.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    rows: int = 4000
    depth: int = 3
    positions: tuple[int, ...] = (0, 16)
    alpha: float = 0.01
    power: float = 0.9
    min_expected: float = 5.0
    max_bins: int = 32
    chunk: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        _ = self.sampling  # validates temperature / top_p / top_k
        check(
            self.temperature > 0, "temperature", self.temperature, "> 0 (greedy output needs no certificate)"
        )
        for name in ("rows", "depth", "max_bins", "chunk"):
            positive_int(name, getattr(self, name))
        object.__setattr__(self, "positions", tuple(self.positions))
        check(
            len(self.positions) > 0 and all(is_int(p) and p >= 0 for p in self.positions),
            "positions",
            self.positions,
            "a non-empty list of ints >= 0",
        )
        check(is_number(self.alpha) and 0 < self.alpha < 1, "alpha", self.alpha, "in (0, 1)")
        check(is_number(self.power) and 0 < self.power < 1, "power", self.power, "in (0, 1)")
        check(
            is_number(self.min_expected) and self.min_expected > 0, "min_expected", self.min_expected, "> 0"
        )

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)


@dataclass
class Certificate:
    """The outcome: a verdict, every test, and what the tests could detect.

    Attributes:
        lossless: no test rejected at family-wise level ``alpha``.
        detectable_tv: the largest, over sites, of the smallest per-position (depth-1) total-variation
            deviation detected with the configured power: a pass rules out deviations this large.
        tests: one dict per test (site, depth or ``"joint"``, n, df, statistic, p-value, rejected,
            detectable TV, impossible tokens, worst cells).
        info: the settings, the stack under test, timings.
        bins: per test, ``(observed, expected)`` counts of its bins (for the plot; not in the JSON).
    """

    lossless: bool
    detectable_tv: float
    tests: list[dict[str, Any]]
    info: dict[str, Any]
    bins: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list, repr=False)

    @property
    def verdict(self) -> str:
        power, alpha = self.info["config"]["power"], self.info["config"]["alpha"]
        if self.lossless and math.isinf(self.detectable_tv):
            return (
                f"NO POWER: no deviation found (family-wise alpha {alpha}), but at some site the next token "
                "has a single possible outcome under these settings, so nothing there could be detected: "
                "choose other positions"
            )
        if self.lossless:
            return (
                f"LOSSLESS at this power: no deviation found (family-wise alpha {alpha}); a per-position "
                f"total-variation deviation >= {self.detectable_tv:.4f} would have been found with "
                f"probability >= {power}"
            )
        failed = sum(t["rejected"] for t in self.tests)
        return f"NOT LOSSLESS: {failed} of {len(self.tests)} tests reject (family-wise alpha {alpha})"

    def summary(self, decode: Callable[[list[int]], str] | None = None, top: int = 5) -> str:
        """The verdict and the worst tests, with their worst cells (token ids, or text via ``decode``)."""
        lines = [self.verdict]

        def show(ids: list[int]) -> str:
            return repr(decode(ids)) if decode else str(ids)

        for t in sorted(self.tests, key=lambda t: t["pvalue"])[:top]:
            lines.append(
                f"  site {t['site']} depth {t['depth']}: p={t['pvalue']:.3g} n={t['n']} df={t['df']} "
                f"detectable TV {t['detectable_tv']:.4f}" + (" REJECTED" if t["rejected"] else "")
            )
            for cell in t["worst"][:3]:
                what = "rest" if cell["tokens"] is None else show(cell["tokens"])
                lines.append(f"    {what}: observed {cell['observed']:.0f}, expected {cell['expected']:.1f}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "lossless": self.lossless,
            "verdict": self.verdict,
            "detectable_tv": self.detectable_tv,
            "tests": self.tests,
            **self.info,
        }


def sites(
    target: TargetModel, prompts: Sequence[Sequence[int]], config: CertifyConfig
) -> list[tuple[list[int], int]]:
    """``(prefix, prompt length)`` per prompt and position: each prompt's continuation sampled once."""
    engine = RolloutEngine(
        target, RolloutConfig(max_new_tokens=max(config.positions) or 1, **_sampling_kwargs(config))
    )
    result = engine.generate(prompts, generator=torch.Generator(target.device).manual_seed(config.seed))
    eos = set(target.info.eos_token_ids)
    out = []
    for prompt, rollout in zip(prompts, result.rollouts):
        cont = rollout.token_ids.tolist()
        for pos in config.positions:
            if pos <= len(cont) and not eos & set(cont[:pos]) and len(prompt) + pos >= 2:
                out.append((list(prompt) + cont[:pos], len(prompt)))
    if not out:
        raise ValueError("no site: every prompt needs >= 2 tokens and a continuation that reaches a position")
    return out


def _sampling_kwargs(config: CertifyConfig) -> dict[str, Any]:
    return {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k}


def step_factory(
    target: TargetModel, config: CertifyConfig, drafter: DraftModel | None, arm: DraftSpec | None, room: int
) -> tuple[Callable[[], Any], tuple[int, ...]]:
    """``() -> DecodeStep`` for plain decoding (``arm=None``) or speculation, and its feature layers."""
    if arm is None:
        rollout = RolloutConfig(max_new_tokens=config.depth, **_sampling_kwargs(config))
        return (lambda: PlainStep(target, rollout)), ()
    if drafter is None:
        raise ValueError(f"arm {arm} needs a drafter: pass drafter=")
    layers = tuple(drafter.config.feature_layers)
    rollout = RolloutConfig(max_new_tokens=config.depth, feature_layers=layers, **_sampling_kwargs(config))

    def make() -> SpeculativeStep:
        return SpeculativeStep(target, drafter, rollout, arm, threshold=2**62, max_depth=room - 1)

    return make, layers


def certify(
    target: TargetModel,
    prompts: Sequence[Sequence[int]],
    config: CertifyConfig | None = None,
    drafter: DraftModel | None = None,
    arm: DraftSpec | None = None,
    backend: RolloutBackend | None = None,
) -> Certificate:
    """Certify that a rollout stack samples exactly from ``target`` under ``config``'s sampling settings.

    Args:
        target: the policy the samples must come from.
        prompts: the user's prompts (token ids, ``>= 1`` each; the prompt alone must have 2 for position 0).
        config: what to sample and test.
        drafter: the drafter of a speculative ``arm``.
        arm: the arm under test on our engine (``None``: plain decoding), e.g. ``parse_arm("chain4")``.
        backend: instead of our engine, any backend set to sample ``config.depth`` tokens with the
            same settings (its first token comes from its prefill).

    Returns:
        The :class:`Certificate`.

    Example:
        >>> from tlt_lightning.models import HFTarget, load_model
        >>> target = HFTarget(load_model("tiny-llama").model)
        >>> cert = certify(target, [[5, 6, 7]], CertifyConfig(rows=400, depth=2, positions=(0,)))
        >>> cert.lossless
        True
    """
    config = config or CertifyConfig()
    start, cpu = time.perf_counter(), time.process_time()
    room = (max(arm.num_steps, arm.num_draft_tokens) if arm is not None else 0) + 2
    make_step, layers = step_factory(target, config, drafter, arm, room)
    generator = torch.Generator(target.device).manual_seed(config.seed + 1)
    eos = target.info.eos_token_ids
    per_site, draw_s, exact_s = [], 0.0, 0.0
    for prefix, prompt_len in sites(target, prompts, config):
        t0 = time.perf_counter()
        if backend is not None:
            samples = draw_with_backend(
                backend, prefix, config.rows, config.depth, eos, generator, config.chunk
            )
        else:
            samples = draw_with_step(
                target, make_step, prefix, prompt_len, config.rows, config.depth, layers, generator,
                config.chunk, room,
            )  # fmt: skip
        t1 = time.perf_counter()
        per_site.append(exact_laws(target, prefix, samples, config.sampling, eos, config.chunk))
        draw_s, exact_s = draw_s + t1 - t0, exact_s + time.perf_counter() - t1
    tests, bins = _run_tests(per_site, config, eos)
    first = [t["detectable_tv"] for t in tests if t["depth"] == 1]
    stack = "backend " + type(backend).__name__ if backend is not None else f"engine, arm {arm or 'off'}"
    info = {
        "config": asdict(config),
        "stack": stack,
        "sites": len(per_site),
        # wall seconds by phase, and the process's CPU seconds (all threads): a shared machine inflates wall
        "seconds": {
            "draw": draw_s,
            "exact": exact_s,
            "total": time.perf_counter() - start,
            "cpu": time.process_time() - cpu,
        },
    }
    return Certificate(not any(t["rejected"] for t in tests), max(first), tests, info, bins)


def _joint(laws: list[DepthLaws], eos: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """The whole continuation as one law: ``[1, K]`` counts and probabilities of the sequences with an
    observed history (those that end in EOS early, then every full-depth one), the rest of the mass last."""
    eos_ids = torch.tensor(list(eos), dtype=torch.long)
    counts, probs, seqs = [], [], []
    for d, law in enumerate(laws, start=1):
        cols = eos_ids if d < len(laws) else torch.arange(law.probs.shape[1])
        counts.append(law.counts()[:, cols].flatten())
        probs.append((law.history_prob[:, None] * law.probs[:, cols].double()).flatten())
        seqs += [h + [int(c)] for h in law.histories.tolist() for c in cols]
    counts, probs = torch.cat(counts), torch.cat(probs)
    unlisted = (1 - probs.sum()).clamp(min=0)  # histories never observed: observed 0 times, by construction
    return torch.cat([counts, counts.new_zeros(1)])[None], torch.cat([probs, unlisted[None]])[None], seqs


def _run_tests(
    per_site: list[list[DepthLaws]], config: CertifyConfig, eos: Sequence[int]
) -> tuple[list[dict[str, Any]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every test of every site, Holm-corrected, with its detectable deviation and worst cells."""
    raw = []  # (site, depth, test, label of each bin)
    for i, laws in enumerate(per_site):
        for d, law in enumerate(laws, start=1):
            test = binned_chi_square(law.counts(), law.probs, config.min_expected, config.max_bins)
            raw.append((i, d, test, lambda g, v, law=law: law.histories[g].tolist() + [v]))
        if len(laws) >= 2:
            counts, probs, seqs = _joint(laws, eos)
            # the unlisted mass is never a bin of its own: it joins the rest bin
            test = binned_chi_square(
                counts, probs, config.min_expected, config.max_bins, True, IMPOSSIBLE ** len(laws)
            )
            raw.append((i, "joint", test, lambda g, v, seqs=seqs: seqs[v] if v < len(seqs) else None))
    rejected = holm([t.pvalue for _, _, t, _ in raw], config.alpha)
    level = config.alpha / len(raw)  # Holm's first step: the power holds for every test
    tests, bins = [], []
    for (site, depth, test, label), rej in zip(raw, rejected):
        tests.append(
            {
                "site": site,
                "depth": depth,
                "n": test.n,
                "df": test.df,
                "statistic": test.statistic,
                "pvalue": test.pvalue,
                "rejected": rej,
                "impossible": test.impossible,
                "detectable_tv": detectable_tv(test.n, test.df, level, config.power),
                "worst": _worst(test, label),
            }
        )
        keep = test.expected > 0
        bins.append((test.observed[keep], test.expected[keep]))
    return tests, bins


def _worst(test: BinnedTest, label: Callable[[int, int], list[int] | None], k: int = 5) -> list[dict]:
    """The ``k`` bins with the largest standardised residuals ``|o - e| / sqrt(e)``."""
    obs, exp = test.observed, test.expected
    z = torch.where(exp > 0, (obs - exp).abs() / exp.clamp(min=1e-12).sqrt(), torch.zeros_like(exp))
    V = obs.shape[1] - 1
    out = []
    for flat in z.flatten().topk(min(k, z.numel())).indices.tolist():
        g, v = divmod(flat, V + 1)
        if exp[g, v] <= 0:
            break
        tokens = None if v == V else label(g, v)
        out.append({"tokens": tokens, "observed": float(obs[g, v]), "expected": float(exp[g, v])})
    return out
