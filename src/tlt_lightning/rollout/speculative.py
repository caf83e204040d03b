"""Lossless speculative decoding of rollouts: a drafter proposes, the target verifies in one forward.

:class:`SpeculativeStep` is a decode step for :class:`~tlt_lightning.rollout.engine.RolloutEngine`.
At every step it asks a :class:`~tlt_lightning.speculative.StrategyChooser` what to do for the
current number of active requests: plain decoding, or draft ``K`` tokens with the drafter and
verify them with :func:`~tlt_lightning.speculative.verify_chain`. Speculation only runs below
``threshold`` active requests: at large batch the target is compute-bound and verifying extra
tokens costs nearly their full price, in the tail it is weight-bound and they are almost free.

Drafter bookkeeping. The drafter reads pairs ``(f_p, x_{p+1})``: the target's features at position
``p`` and the token that followed. Its own cache holds one entry per position; its committed
length ``dl`` trails the target's ``L`` and catches up at the start of every speculative step, from
the features the engine keeps in the batch transcripts (so switching speculation on mid-rollout,
or after plain steps, needs no extra target forward). Draft positions beyond ``L`` are scratch and
are simply overwritten next time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from tlt_lightning.models.kv_cache import KVCache
from tlt_lightning.models.target import TargetModel
from tlt_lightning.rollout.engine import ActiveBatch, Emission, PlainStep, RolloutEngine, causal_decode_mask
from tlt_lightning.rollout.types import RolloutConfig, RolloutResult
from tlt_lightning.speculative import SDStrategy, StrategyChooser, sample, sampling_probs, verify_chain

__all__ = ["FixedChooser", "SpeculativeRolloutLoop", "SpeculativeStep"]


class FixedChooser:
    """Always the same strategy (``None`` = never speculate); learns nothing."""

    def __init__(self, arm: SDStrategy | None) -> None:
        self.arm = arm

    def select(self, batch_size: int) -> SDStrategy | None:
        return self.arm

    def update(self, batch_size: int, arm: SDStrategy | None, accepted_tokens: float, step_time: float) -> None:
        pass


def _mask_from_positions(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """``[n, 1, q, kv_len]``: query at position ``p`` sees cache slots ``<= p``."""
    slots = torch.arange(kv_len, device=positions.device)
    return (slots[None, None, :] <= positions[:, :, None])[:, None]


class SpeculativeStep:
    """Decode step that speculates with ``drafter`` when the chooser says so.

    Args:
        target: the model being sampled.
        drafter: an EAGLE-style drafter for ``target`` (see :class:`~tlt_lightning.drafter.Drafter`).
        config: the rollout's sampling settings; ``config.feature_layers`` must start with the
            drafter's ``feature_layers``.
        chooser: picks the strategy per step (e.g. :class:`FixedChooser`, ``BEGMABStrategy``).
        threshold: speculate only while fewer than this many requests are active.
        max_depth: deepest draft a strategy may ask for (the target cache keeps that much room).
    """

    def __init__(
        self,
        target: TargetModel,
        drafter,
        config: RolloutConfig,
        chooser: StrategyChooser,
        threshold: int = 32,
        max_depth: int = 16,
    ) -> None:
        layers = tuple(drafter.config.feature_layers)
        if tuple(config.feature_layers[: len(layers)]) != layers:
            raise ValueError(
                f"config.feature_layers {config.feature_layers} must start with the drafter's feature_layers {layers}"
            )
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {threshold}")
        self.target, self.drafter, self.config = target, drafter, config
        self.chooser, self.threshold, self.max_depth = chooser, threshold, max_depth
        self.num_features = len(layers)
        self.plain = PlainStep(target, config)
        self.dcache: KVCache | None = None

    def start(self, batch: ActiveBatch) -> None:
        # One slot more than the target: padded catch-up queries write there (see _catch_up).
        self.dcache = self.drafter.new_cache(batch.cache.max_batch, batch.cache.max_len + 1)
        batch.aux_caches.append(self.dcache)

    def __call__(self, batch: ActiveBatch, generator: torch.Generator | None) -> Emission:
        n = batch.n
        arm = self.chooser.select(n) if n < self.threshold else None
        start = time.perf_counter()
        if arm is not None and arm.num_steps > self.max_depth:
            raise ValueError(f"strategy {arm} drafts deeper than max_depth={self.max_depth}")
        if arm is None:
            emission = self.plain(batch, generator)
        else:
            emission = self._chain(batch, arm, generator)
        if n < self.threshold:
            elapsed = time.perf_counter() - start
            self.chooser.update(n, arm, float(emission.counts.float().mean()), elapsed)
        return emission

    # ------------------------------------------------------------------------------------------
    def _draft_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, H]`` drafter output -> ``[n, V]`` the distribution drafts are sampled from."""
        logits = self.drafter.to_target_vocab(self.drafter.logits(hidden).float(), fill=float("-inf"))
        return sampling_probs(logits, self.config.sampling)

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
        out = self.drafter(tokens, self.drafter.lift(feats), positions, _mask_from_positions(positions, kv_len), dc)
        dc.lengths[:n] = L
        return out[torch.arange(n, device=L.device), count - 1]

    def _chain(self, batch: ActiveBatch, arm: SDStrategy, generator: torch.Generator | None) -> Emission:
        """Draft ``arm.num_steps`` tokens one after another, verify them in one target forward."""
        n, K = batch.n, arm.num_steps
        L = batch.lengths.clone()
        hidden = self._catch_up(batch)
        drafts, draft_probs = [], []
        for k in range(K):
            q = self._draft_probs(hidden)
            token = sample(q, generator)
            drafts.append(token)
            draft_probs.append(q)
            if k + 1 < K:  # pair (h_k, d_k) sits at drafter position L + k
                pos = (L + k)[:, None]
                mask = _mask_from_positions(pos, int(pos.max()) + 1)
                hidden = self.drafter(token[:, None], hidden[:, None], pos, mask, self.dcache)[:, 0]
        self.dcache.lengths[:n] = L  # draft entries are scratch
        draft_tokens = torch.stack(drafts, 1)  # [n, K]

        ids = torch.cat([batch.last_token[:n, None], draft_tokens], 1)
        positions = L[:, None] + torch.arange(K + 1, device=L.device)
        mask = causal_decode_mask(L, K + 1, int(positions.max()) + 1)
        out = self.target.forward(ids, positions, mask, batch.cache, self.config.feature_layers)
        target_probs = sampling_probs(self.target.lm_head(out.hidden), self.config.sampling)  # [n, K+1, V]
        result = verify_chain(target_probs, torch.stack(draft_probs, 1), draft_tokens, generator)
        emitted = result.emitted(draft_tokens).clamp(min=0)  # [n, K+1]
        counts = result.num_accepted + 1
        batch.cache.lengths[:n] += counts  # last_token and the accepted drafts are now committed
        logprobs = target_probs.gather(-1, emitted[..., None]).squeeze(-1).log()
        if self.config.sampling.greedy:
            logprobs = torch.zeros_like(logprobs)
        return Emission(emitted, counts, logprobs, out.features, strategy=arm)


class SpeculativeRolloutLoop:
    """Runs rollouts of prompt batches with lossless speculative decoding in the tail.

    Args:
        target: the policy being sampled.
        drafter: an EAGLE-style drafter for it.
        config: sampling and length settings (``feature_layers`` are extended with the drafter's).
        chooser: the strategy per step; default: a 4-token chain whenever speculation is on.
        threshold: speculate only while fewer than this many requests are active.
        max_depth: deepest draft a strategy may ask for.

    Example:
        >>> from tlt_lightning.models import HFTarget, load_model
        >>> from tlt_lightning.drafter import Drafter, DrafterConfig
        >>> target = HFTarget(load_model("tiny-llama").model)
        >>> loop = SpeculativeRolloutLoop(target, Drafter(DrafterConfig.from_target(target), target),
        ...                               RolloutConfig(max_new_tokens=8, temperature=0))
        >>> loop.generate([[5, 6, 7]]).rollouts[0].length
        8
    """

    def __init__(
        self,
        target: TargetModel,
        drafter,
        config: RolloutConfig | None = None,
        chooser: StrategyChooser | None = None,
        threshold: int = 32,
        max_depth: int = 16,
    ) -> None:
        config = config or RolloutConfig()
        layers = tuple(drafter.config.feature_layers)
        extra = tuple(i for i in config.feature_layers if i not in layers)
        self.config = replace(config, feature_layers=layers + extra)
        self.drafter = drafter
        self.chooser = chooser or FixedChooser(SDStrategy(4))
        self.threshold, self.max_depth = threshold, max_depth
        self.engine = RolloutEngine(target, self.config, cache_margin=max_depth + 1)

    def generate(
        self, prompts: Sequence[Sequence[int]], generator: torch.Generator | None = None, progress: bool = False
    ) -> RolloutResult:
        """Sample one response per prompt; same distribution as plain decoding, fewer target passes."""
        step = SpeculativeStep(
            self.engine.target, self.drafter, self.config, self.chooser, self.threshold, self.max_depth
        )
        return self.engine.generate(prompts, generator=generator, step=step, progress=progress)
