"""The target's exact laws of the samples a certificate drew: next-token laws after every history.

For a prefix and ``[R, D]`` drawn continuations, the histories at depth ``d`` are the distinct first
``d`` tokens of the rows that reached depth ``d`` (no EOS before). Their next-token laws come from the
target's logits through :func:`~tlt_lightning.speculative.sampling_probs` (the one place temperature,
top-k and top-p are applied), one batched forward per depth over a prefix prefilled once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tlt_lightning.certify.draw import shared_prefix_cache
from tlt_lightning.models.target import TargetModel
from tlt_lightning.rollout.engine import causal_decode_mask
from tlt_lightning.speculative.sampling import SamplingParams, sampling_probs

__all__ = ["DepthLaws", "exact_laws", "next_token_probs"]


@dataclass
class DepthLaws:
    """The samples at one depth ``d`` (1-based) and the target's laws there.

    Attributes:
        rows: ``[N]`` indices of the samples that reached depth ``d``.
        history: ``[N]`` index of each such sample's history (its first ``d - 1`` tokens).
        histories: ``[G, d - 1]`` the distinct histories.
        probs: ``[G, V]`` the target's next-token law after each history.
        history_prob: ``[G]`` the target's probability of each history (1 at depth 1).
        tokens: ``[N]`` the token each sample drew at depth ``d``.
    """

    rows: torch.Tensor
    history: torch.Tensor
    histories: torch.Tensor
    probs: torch.Tensor
    history_prob: torch.Tensor
    tokens: torch.Tensor

    def counts(self) -> torch.Tensor:
        """``[G, V]`` how often each token followed each history."""
        G, V = self.probs.shape
        flat = torch.zeros(G * V, dtype=torch.float64)
        flat.index_add_(
            0, self.history * V + self.tokens, torch.ones(self.tokens.numel(), dtype=torch.float64)
        )
        return flat.view(G, V)


@torch.inference_mode()
def next_token_probs(
    target: TargetModel,
    prefix: Sequence[int],
    histories: torch.Tensor,
    sampling: SamplingParams,
    chunk: int = 256,
) -> torch.Tensor:
    """The target's sampling law of the next token after ``prefix + history``, for every history.

    Args:
        target: the model.
        prefix: ``S >= 1`` token ids.
        histories: ``[G, d]`` int64 tokens that follow the prefix (``d`` may be 0).
        sampling: temperature, top-k and top-p.
        chunk: histories per forward.

    Returns:
        ``[G, V]`` float32 probabilities (on the CPU).
    """
    ids = torch.as_tensor(list(prefix), dtype=torch.long, device=target.device)
    G, d = histories.shape
    out = []
    for start in range(0, G, chunk):
        h = histories[start : start + chunk].to(target.device)
        n = h.shape[0]
        cache, _ = shared_prefix_cache(target, ids[:-1], n, d + 1)
        tokens = torch.cat([ids[-1:].expand(n, 1), h], 1)  # [n, d + 1]
        L = cache.lengths[:n]
        positions = L[:, None] + torch.arange(d + 1, device=L.device)
        mask = causal_decode_mask(L, d + 1, int(positions.max()) + 1)
        hidden = target.forward(tokens, positions, mask, cache).hidden[:, -1]
        out.append(sampling_probs(target.lm_head(hidden), sampling).cpu())
    return torch.cat(out)


def exact_laws(
    target: TargetModel,
    prefix: Sequence[int],
    samples: torch.Tensor,
    sampling: SamplingParams,
    eos_token_ids: Sequence[int],
    chunk: int = 256,
) -> list[DepthLaws]:
    """The laws at every depth of ``[R, D]`` samples (``-1`` after an EOS), depth 1 first."""
    R, D = samples.shape
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long)
    ended = torch.isin(samples, eos) | (samples < 0)
    alive = torch.ones(R, dtype=torch.bool)
    laws: list[DepthLaws] = []
    for d in range(1, D + 1):
        rows = (alive & (samples[:, d - 1] >= 0)).nonzero().squeeze(1)
        if d == 1:
            histories, history = samples[:1, :0], torch.zeros(rows.numel(), dtype=torch.long)
        else:
            histories, history = samples[rows, : d - 1].unique(dim=0, return_inverse=True)
        probs = next_token_probs(target, prefix, histories, sampling, chunk)
        if d == 1:
            history_prob = torch.ones(1, dtype=torch.float64)
        else:  # a history's parent is a history of the previous depth: P(h) = P(parent) * p(h_last | parent)
            prev = laws[-1]
            parent_of = torch.zeros(prev.rows.max() + 1 if prev.rows.numel() else 1, dtype=torch.long)
            parent_of[prev.rows] = prev.history
            first = torch.zeros(histories.shape[0], dtype=torch.long).scatter_(0, history, rows)
            parent = parent_of[first]
            history_prob = prev.history_prob[parent] * prev.probs[parent, histories[:, -1]].double()
        laws.append(DepthLaws(rows, history, histories, probs, history_prob, samples[rows, d - 1]))
        alive &= ~ended[:, d - 1]
    return laws
