"""Lossless speculative decoding of rollouts: a drafter proposes, the target verifies in one forward.

:class:`SpeculativeStep` is a decode step for :class:`~tlt_lightning.rollout.engine.RolloutEngine`.
At every step it asks a :class:`~tlt_lightning.speculative.DraftStrategy` what to do for the
current number of active requests: plain decoding, or draft ``K`` tokens with the drafter and
verify them with :func:`~tlt_lightning.speculative.verify_chain` (or a tree of drafts, EAGLE-2's
deterministic one or sampled chains forking at the root, with
:func:`~tlt_lightning.speculative.verify_tree`). Speculation only runs below
``threshold`` active requests: at large batch the target is compute-bound and verifying extra
tokens costs nearly their full price, in the tail it is weight-bound and they are almost free.

Drafter bookkeeping. The drafter reads pairs ``(f_p, x_{p+1})``: the target's features at position
``p`` and the token that followed, from the last prompt position on (the context it is trained
with). Its own cache holds one entry per position; its committed length ``dl`` trails the target's
``L`` and catches up at the start of every speculative step, from the features the engine keeps in
the batch transcripts (so switching speculation on mid-rollout, or after plain steps, needs no extra
target forward). Draft positions beyond ``L`` are scratch and are simply overwritten next time.
"""

from __future__ import annotations

import time

import torch

from tlt_lightning.models.kv_cache import KVCache
from tlt_lightning.models.target import TargetModel
from tlt_lightning.rollout.drafting import DraftModel, draft_probs
from tlt_lightning.rollout.engine import ActiveBatch, Emission, PlainStep, causal_decode_mask
from tlt_lightning.rollout.tree_drafts import draft_best_tree, draft_sampled_tree, verify_draft_tree
from tlt_lightning.rollout.types import RolloutConfig
from tlt_lightning.speculative import (
    DraftSpec,
    DraftStrategy,
    as_strategy,
    sample,
    sampling_probs,
    verify_chain,
)

__all__ = ["SpeculativeStep"]


def _mask_from_positions(positions: torch.Tensor, kv_len: int, first: torch.Tensor) -> torch.Tensor:
    """``[n, 1, q, kv_len]``: query at position ``p`` of row ``i`` sees slots ``first[i] .. p``."""
    slots = torch.arange(kv_len, device=positions.device)
    return ((slots[None, None, :] <= positions[:, :, None]) & (slots[None, None, :] >= first[:, None, None]))[
        :, None
    ]


class SpeculativeStep:
    """Decode step that speculates with ``drafter`` when its strategy says so.

    Args:
        target: the model being sampled.
        drafter: an EAGLE-style drafter for ``target`` (a :class:`~tlt_lightning.rollout.drafting.DraftModel`,
            e.g. :class:`~tlt_lightning.drafter.Drafter`); it takes the ``"packed"`` weight layout of a
            packed target (values unchanged).
        config: the rollout's sampling settings; ``config.feature_layers`` must start with the
            drafter's ``feature_layers``.
        strategy: picks the arm per step: a :class:`~tlt_lightning.speculative.DraftStrategy` (e.g.
            ``BEGMABStrategy``), or a :class:`~tlt_lightning.speculative.DraftSpec` to always use,
            or ``None`` to never speculate.
        threshold: speculate only while fewer than this many requests are active.
        max_depth: deepest draft a strategy may ask for (the target cache keeps that much room).
        drafter_context: where the drafter's context starts: ``"response"`` (the last prompt
            position, as drafters are trained here) or ``"prompt"`` (position 0).
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: DraftModel,
        config: RolloutConfig,
        strategy: DraftStrategy | DraftSpec | None,
        threshold: int = 32,
        max_depth: int = 32,
        drafter_context: str = "response",
    ) -> None:
        layers = tuple(drafter.config.feature_layers)
        if drafter_context not in ("response", "prompt"):
            raise ValueError(f"drafter_context must be 'response' or 'prompt', got {drafter_context!r}")
        if tuple(config.feature_layers[: len(layers)]) != layers:
            raise ValueError(
                f"config.feature_layers {config.feature_layers} must start with the drafter's "
                f"feature_layers {layers}"
            )
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {threshold}")
        if getattr(target, "weight_layout", None) == "packed" and drafter.weight_layout == "out_in":
            drafter.set_weight_layout("packed")  # same values; its drafts on a CPU get cheaper too
        self.target, self.drafter, self.config = target, drafter, config
        self.strategy, self.threshold, self.max_depth = as_strategy(strategy), threshold, max_depth
        self.drafter_context = drafter_context
        self.num_features = len(layers)
        self.plain = PlainStep(target, config)
        self.dcache: KVCache | None = None

    def start(self, batch: ActiveBatch) -> None:
        # One slot more than the target: padded catch-up queries write there (see _catch_up).
        self.dcache = self.drafter.new_cache(batch.cache.max_batch, batch.cache.max_len + 1)
        batch.aux_caches.append(self.dcache)
        self.dcache.lengths[: batch.n] = self._first(batch)

    def _first(self, batch: ActiveBatch) -> torch.Tensor:
        """``[n]`` first drafter slot of each active row.

        ``"response"``: the last prompt position, so the first pair is ``(f_{P-1}, first response
        token)``: the context drafters are trained with (see ``drafter.train``). ``"prompt"``: 0.
        """
        if self.drafter_context == "prompt":
            return torch.zeros(batch.n, dtype=torch.long, device=batch.prompt_len.device)
        return batch.prompt_len[batch.request[: batch.n]] - 1

    def __call__(self, batch: ActiveBatch, generator: torch.Generator | None) -> Emission:
        n = batch.n
        arm = self.strategy.select(n) if n < self.threshold else None
        start = time.perf_counter()
        if arm is not None and max(arm.num_steps, arm.num_draft_tokens) > self.max_depth:
            raise ValueError(
                f"strategy {arm} drafts deeper or verifies more tokens than max_depth={self.max_depth} "
                "(the room the caches keep past each row's length)"
            )
        if arm is None:
            emission = self.plain(batch, generator)
        elif arm.is_chain and not arm.sampled:
            emission = self._chain(batch, arm, generator)
        else:
            emission = self._tree(batch, arm, generator)
        if n < self.threshold:
            elapsed = time.perf_counter() - start
            self.strategy.update(n, arm, float(emission.counts.float().mean()), elapsed)
        return emission

    # ------------------------------------------------------------------------------------------
    def _catch_up(self, batch: ActiveBatch) -> torch.Tensor:
        """Feed the drafter every pair it has not seen; return ``[n, H]`` its output at the last one.

        Row ``i`` has pairs at positions ``dl_i .. L_i - 1`` (``L_i >= dl_i + 1`` always: at least
        the pair ending in ``last_token`` is new). Rows with fewer pairs are padded; the padding
        writes to the scratch slot past the target's cache length and its outputs are ignored.
        """
        n, dc = batch.n, self.dcache
        L, dl = batch.lengths, dc.lengths[:n]
        count = L - dl
        q = int(count.max())
        offs = torch.arange(q, device=L.device)
        valid = offs[None] < count[:, None]
        positions = torch.where(valid, dl[:, None] + offs[None], dc.max_len - 1)
        src = torch.minimum(dl[:, None] + offs[None], (L - 1)[:, None])  # clamp padding to a real pair
        req = batch.request[:n, None]
        feats = batch.features[req, src, : self.num_features]  # [n, q, C, H]
        tokens = batch.seq[req, src + 1]
        kv_len = int(positions.max()) + 1
        mask = _mask_from_positions(positions, kv_len, self._first(batch))
        out = self.drafter(tokens, self.drafter.lift(feats), positions, mask, dc)
        dc.lengths[:n] = L
        return out[torch.arange(n, device=L.device), count - 1]

    def _chain(self, batch: ActiveBatch, arm: DraftSpec, generator: torch.Generator | None) -> Emission:
        """Draft up to ``arm.num_steps`` tokens one after another, verify them in one target forward.

        With ``arm.min_confidence`` the chain stops once no row's confidence (the product of its
        drafts' probabilities) reaches it: a draft the drafter itself doubts is likely rejected,
        and on a CPU each drafter pass costs a noticeable share of a step.
        """
        n, K = batch.n, arm.num_steps
        L = batch.lengths.clone()
        hidden = self._catch_up(batch)
        first = self._first(batch)
        drafts, laws = [], []  # per draft: [n] target ids; [n, V_draft] the law it was drawn from
        confidence = torch.ones(n, device=L.device)
        for k in range(K):
            logits = self.drafter.logits(hidden).float()
            q = draft_probs(logits, self.config.sampling)
            d = sample(q, generator)
            token = self.drafter.draft_to_target(d)
            drafts.append(token)
            laws.append(q)
            if arm.min_confidence:
                if self.config.sampling.greedy:  # q is one-hot: rate the argmax by the raw distribution
                    confidence *= logits.softmax(-1).amax(-1)
                else:
                    confidence *= q.gather(-1, d[:, None])[:, 0]
                if not bool((confidence >= arm.min_confidence).any()):  # one sync per draft, only here
                    break
            if k + 1 < K:  # pair (h_k, d_k) sits at drafter position L + k
                pos = (L + k)[:, None]
                mask = _mask_from_positions(pos, int(pos.max()) + 1, first)
                hidden = self.drafter(token[:, None], hidden[:, None], pos, mask, self.dcache)[:, 0]
        self.dcache.lengths[:n] = L  # draft entries are scratch
        draft_tokens = torch.stack(drafts, 1)  # [n, K], K = the drafts made
        K = draft_tokens.shape[1]

        ids = torch.cat([batch.last_token[:n, None], draft_tokens], 1)
        positions = L[:, None] + torch.arange(K + 1, device=L.device)
        mask = causal_decode_mask(L, K + 1, int(positions.max()) + 1)
        out = self.target.forward(ids, positions, mask, batch.cache, self.config.feature_layers)
        target_probs = sampling_probs(self.target.lm_head(out.hidden), self.config.sampling)  # [n, K+1, V]
        q = self.drafter.to_target_vocab(torch.stack(laws, 1))  # [n, K, V]
        result = verify_chain(target_probs, q, draft_tokens, generator)
        emitted = result.emitted(draft_tokens).clamp(min=0)  # [n, K+1]
        counts = result.num_accepted + 1
        batch.cache.lengths[:n] += counts  # last_token and the accepted drafts are now committed
        logprobs = target_probs.gather(-1, emitted[..., None]).squeeze(-1).log()
        if self.config.sampling.greedy:
            logprobs = torch.zeros_like(logprobs)
        return Emission(emitted, counts, logprobs, out.features, arm=arm, draft_depth=K)

    def _tree(self, batch: ActiveBatch, arm: DraftSpec, generator: torch.Generator | None) -> Emission:
        """Draft a tree (EAGLE-2's best nodes, or sampled chains forking at the root:
        :mod:`~tlt_lightning.rollout.tree_drafts`) and verify it in one target forward."""
        lengths = batch.lengths.clone()
        drafter, cache = self.drafter, self.dcache
        hidden, first = self._catch_up(batch), self._first(batch)
        if arm.sampled:
            sampling = self.config.sampling
            tree = draft_sampled_tree(drafter, cache, hidden, lengths, first, arm, sampling, generator)
        else:
            tree = draft_best_tree(drafter, cache, hidden, lengths, first, arm)
        return verify_draft_tree(self.target, batch, lengths, tree, self.config, arm, generator)
