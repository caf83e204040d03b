"""RolloutEngine: batched sampling of many requests with a preallocated KV cache.

Requests leave the batch as soon as they finish (EOS, ``max_new_tokens`` or the context length):
the last active row moves into the finished row's slot, so every decode step runs on the active
requests only: the long tail is cheap in wall-clock terms, and speculative decoding pays there (few
rows, each step bound by reading the weights: verifying several drafts costs little more than one).
Identical prompts (a GRPO group's copies) are prefilled once and their cache rows copied.

A decode step is pluggable (:class:`DecodeStep`): :class:`PlainStep` samples one token per request;
the speculative loop supplies steps that emit several.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

import torch
from tqdm.auto import tqdm

from tlt_lightning.models.kv_cache import KVCache
from tlt_lightning.models.target import TargetModel
from tlt_lightning.rollout.types import Rollout, RolloutConfig, RolloutResult, RolloutStats, validate_prompts
from tlt_lightning.speculative.sampling import sample, sampling_probs

__all__ = ["ActiveBatch", "DecodeStep", "Emission", "PlainStep", "RolloutBackend", "RolloutEngine"]


class RolloutBackend(Protocol):
    """Anything that turns prompts into rollouts (this engine, the speculative loop, vLLM).

    ``generate(prompts, generator=None, progress=False)``: ``prompts`` are ``B`` sequences of token
    ids; ``generator`` is the random source (same state, same rollouts; ``None``: the backend's
    own); ``progress`` shows a progress bar of finished requests. Returns one rollout per prompt,
    in order, with the backend's :class:`~tlt_lightning.rollout.RolloutStats`.
    """

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        generator: torch.Generator | None = None,
        progress: bool = False,
    ) -> RolloutResult: ...


class Emission(NamedTuple):
    """Tokens a decode step emitted for the ``n`` active rows.

    Attributes:
        tokens: ``[n, m]`` int64; row ``i`` emitted ``tokens[i, :counts[i]]``.
        counts: ``[n]`` int64 in ``1..m``.
        logprobs: ``[n, m]`` float32 log-probabilities under the sampling distribution.
        features: ``[n, m, C, H]`` target features at the positions that predicted them, or None.
        arm: the step's :class:`~tlt_lightning.speculative.DraftSpec`, ``None`` for plain decoding.
        draft_depth: draft levels the step verified (a chain's drafts, a tree's depth); 0 if plain.
    """

    tokens: torch.Tensor
    counts: torch.Tensor
    logprobs: torch.Tensor
    features: torch.Tensor | None
    arm: object | None = None
    draft_depth: int = 0


@dataclass
class ActiveBatch:
    """The state of a rollout: active rows ``[0, n)`` and per-request transcripts.

    Row ``i`` serves request ``request[i]``. Between steps the cache holds each row's tokens up
    to, not including, ``last_token[i]``, which the next step feeds. Transcripts are indexed by
    request and absolute position: ``seq[r, p]`` is token ``p`` (prompt, then response) and
    ``features[r, p]`` the target's features at position ``p`` (they predicted ``seq[r, p + 1]``).
    """

    cache: KVCache
    request: torch.Tensor  # [B] int64 request index per row
    last_token: torch.Tensor  # [B] int64
    generated: torch.Tensor  # [B] int64 tokens emitted so far per row
    limit: torch.Tensor  # [B] int64 max tokens this row may emit (max_new and context bound)
    n: int
    seq: torch.Tensor  # [B, S] int64, by request
    prompt_len: torch.Tensor  # [B] int64, by request
    features: torch.Tensor | None = None  # [B, S, C, H], by request
    aux_caches: list[KVCache] = field(default_factory=list)  # e.g. a drafter's: moved with the rows

    @property
    def lengths(self) -> torch.Tensor:
        """``[n]`` committed cache length of the active rows (a view)."""
        return self.cache.lengths[: self.n]

    def remove(self, finished: torch.Tensor) -> None:
        """Drop the rows flagged in ``finished`` (``[n]`` bool), moving the last rows into their slots."""
        keep = int((~finished).sum())
        holes = finished[:keep].nonzero().squeeze(1)
        movers = (~finished[keep:]).nonzero().squeeze(1) + keep
        if holes.numel():
            for cache in (self.cache, *self.aux_caches):
                cache.move_rows(movers, holes)
            for t in (self.request, self.last_token, self.generated, self.limit):
                t[holes] = t[movers]
        self.n = keep


class DecodeStep(Protocol):
    """One decode step over the active rows; it also advances ``batch.cache.lengths``.

    ``start`` is called once per rollout, after prefill, before the first step.
    """

    def start(self, batch: ActiveBatch) -> None: ...

    def __call__(self, batch: ActiveBatch, generator: torch.Generator | None) -> Emission: ...


@dataclass
class _Ledger:
    """What :meth:`RolloutEngine.generate` records per request beyond the batch's transcripts.

    Attributes:
        eos: ``[E]`` int64, the target's end-of-sequence ids.
        logprobs: ``[B, max_new_tokens]`` float32 log-probability of each generated token, by request.
        finish_time: seconds from the start of the rollout to each request's last token.
        finish_eos: ``[B]`` bool, the request ended on an EOS token (else on its length limit).
        lengths: ``[B]`` int64, tokens each finished request generated.
    """

    eos: torch.Tensor
    logprobs: torch.Tensor
    finish_time: list[float]
    finish_eos: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def empty(cls, B: int, max_new_tokens: int, eos_ids: Sequence[int], device: torch.device) -> _Ledger:
        return cls(
            eos=torch.tensor(eos_ids, dtype=torch.long, device=device),
            logprobs=torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device),
            finish_time=[0.0] * B,
            finish_eos=torch.zeros(B, dtype=torch.bool, device=device),
            lengths=torch.zeros(B, dtype=torch.long, device=device),
        )

    def record(self, batch: ActiveBatch, emission: Emission) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the emission of the last forward for rows ``[0, n)`` into the transcripts.

        A row keeps its tokens up to its length limit and its first EOS. Returns ``[n]`` the tokens
        kept per row and ``[n]`` bool, the rows that hit an EOS.
        """
        n, req, device = batch.n, batch.request[: batch.n], self.eos.device
        counts = emission.counts.clamp(max=batch.limit[:n] - batch.generated[:n])
        offs = torch.arange(emission.tokens.shape[1], device=device)
        is_eos = torch.isin(emission.tokens, self.eos) & (offs[None] < counts[:, None])
        hit_eos = is_eos.any(1)
        counts = torch.where(hit_eos, is_eos.int().argmax(1) + 1, counts)
        rows, cols = (offs[None] < counts[:, None]).nonzero(as_tuple=True)
        pos = batch.prompt_len[req[rows]] + batch.generated[rows] + cols  # absolute positions
        batch.seq[req[rows], pos] = emission.tokens[rows, cols]
        self.logprobs[req[rows], batch.generated[rows] + cols] = emission.logprobs[rows, cols]
        if emission.features is not None and batch.features is not None:
            batch.features[req[rows], pos - 1] = emission.features[rows, cols].to(batch.features.dtype)
        batch.generated[:n] += counts
        batch.last_token[:n] = emission.tokens.gather(1, (counts - 1)[:, None]).squeeze(1)
        return counts, hit_eos

    def retire(self, batch: ActiveBatch, hit_eos: torch.Tensor, start: float) -> int:
        """Remove the rows that finished (EOS or length limit) from the batch; returns how many."""
        n, req = batch.n, batch.request[: batch.n]
        finished = hit_eos | (batch.generated[:n] >= batch.limit[:n])
        if not bool(finished.any()):
            return 0
        now = time.perf_counter() - start
        done = req[finished].tolist()
        for r in done:
            self.finish_time[r] = now
        self.finish_eos[req[finished]] = hit_eos[finished]
        self.lengths[req[finished]] = batch.generated[:n][finished]
        batch.remove(finished)
        return len(done)

    def rollouts(self, ids: list[torch.Tensor], batch: ActiveBatch, first_time: float) -> list[Rollout]:
        """One :class:`Rollout` per request, in order, cut from the transcripts."""
        rollouts = []
        for i in range(len(ids)):
            p, t = int(batch.prompt_len[i]), int(self.lengths[i])
            rollouts.append(
                Rollout(
                    prompt_ids=ids[i],
                    token_ids=batch.seq[i, p : p + t].clone(),
                    logprobs=self.logprobs[i, :t].clone(),
                    finish_reason="eos" if bool(self.finish_eos[i]) else "length",
                    first_token_time=first_time,
                    finish_time=self.finish_time[i],
                    features=batch.features[i, p - 1 : p - 1 + t].clone()
                    if batch.features is not None
                    else None,
                )
            )
        return rollouts


def _timed_step(
    step: DecodeStep, batch: ActiveBatch, generator: torch.Generator | None, stats: RolloutStats
) -> Emission:
    """Run one decode step and append its time, batch size and arm to ``stats``."""
    t0, cpu0 = time.perf_counter(), time.thread_time()
    n = batch.n
    emission = step(batch, generator)
    stats.step_times.append(time.perf_counter() - t0)
    stats.step_cpu_times.append(time.thread_time() - cpu0)
    stats.step_batch_sizes.append(n)
    stats.step_speculative.append(emission.arm is not None)
    stats.step_arms.append(emission.arm)
    stats.step_draft_depths.append(emission.draft_depth)
    return emission


def causal_decode_mask(lengths: torch.Tensor, q: int, kv_len: int) -> torch.Tensor:
    """``[n, 1, q, kv_len]`` bool: query ``j`` of row ``i`` sees slots ``<= lengths[i] + j``."""
    slots = torch.arange(kv_len, device=lengths.device)
    query_pos = lengths[:, None] + torch.arange(q, device=lengths.device)  # [n, q]
    return (slots[None, None, :] <= query_pos[:, :, None])[:, None]


class PlainStep:
    """Autoregressive decoding: feed each row's last token, sample one new token per row."""

    def __init__(self, target: TargetModel, config: RolloutConfig) -> None:
        self.target, self.config = target, config

    def start(self, batch: ActiveBatch) -> None:
        pass

    def __call__(self, batch: ActiveBatch, generator: torch.Generator | None) -> Emission:
        n, lengths = batch.n, batch.lengths
        positions = lengths[:, None]
        mask = causal_decode_mask(lengths, 1, int(lengths.max()) + 1)
        out = self.target.forward(
            batch.last_token[:n, None], positions, mask, batch.cache, self.config.feature_layers
        )
        tokens, logprobs = sample_tokens(self.target.lm_head(out.hidden[:, -1]), self.config, generator)
        lengths += 1
        ones = torch.ones(n, dtype=torch.long, device=tokens.device)
        features = out.features[:, -1:] if out.features is not None else None
        return Emission(tokens[:, None], ones, logprobs[:, None], features)


def sample_tokens(
    logits: torch.Tensor, config: RolloutConfig, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``[n]`` tokens from ``[n, V]`` logits; returns the tokens and their log-probabilities."""
    if config.sampling.greedy:  # the distribution is one-hot: skip the random draw
        # max's indices are argmax's (the first of tied maxima), but argmax over bf16 is 5x slower on a
        # CPU: 5.2 against 0.94 ms for [32, 49152] logits (one AMD Zen 5 core), a twelfth of a decode step
        tokens = logits.max(-1).indices
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    probs = sampling_probs(logits, config.sampling)
    tokens = sample(probs, generator)
    return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log()


def _distinct(ids: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The distinct prompts of ``ids`` in order of first occurrence, and ``[B]`` int64 each prompt's index
    among them.

    Example:
        >>> _distinct([torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([5, 6])])[1].tolist()
        [0, 1, 0]
    """
    index: dict[tuple[int, ...], int] = {}
    distinct, source = [], []
    for p in ids:
        key = tuple(p.tolist())
        if key not in index:
            index[key] = len(distinct)
            distinct.append(p)
        source.append(index[key])
    return distinct, torch.tensor(source, dtype=torch.long)


class RolloutEngine:
    """Generates responses for many prompts at once on a local target model.

    Args:
        target: the model to sample from (e.g. :class:`~tlt_lightning.models.HFTarget`).
        config: sampling and length settings.
        cache_margin: extra KV slots per row beyond prompt + ``max_new_tokens`` (room for
            speculative tokens that may later be rolled back).

    Example:
        >>> from tlt_lightning.models import HFTarget, load_model
        >>> engine = RolloutEngine(HFTarget(load_model("tiny-llama").model), RolloutConfig(max_new_tokens=8))
        >>> result = engine.generate([[5, 6, 7], [8, 9]], generator=torch.Generator().manual_seed(0))
        >>> [r.length <= 8 for r in result.rollouts]
        [True, True]
    """

    def __init__(
        self, target: TargetModel, config: RolloutConfig | None = None, cache_margin: int = 0
    ) -> None:
        self.target = target
        self.config = config or RolloutConfig()
        self.cache_margin = cache_margin

    def with_config(self, **changes: object) -> RolloutEngine:
        """A copy of this engine with some config fields changed (shares the target)."""
        return RolloutEngine(self.target, replace(self.config, **changes), self.cache_margin)

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        generator: torch.Generator | None = None,
        step: DecodeStep | None = None,
        progress: bool = False,
    ) -> RolloutResult:
        """Sample a response for every prompt.

        Args:
            prompts: ``B`` prompts, each a sequence of token ids.
            generator: random source (on the model's device) for reproducible sampling.
            step: the decode step to run (default: :class:`PlainStep`).
            progress: show a progress bar of finished requests.

        Returns:
            One :class:`Rollout` per prompt, in order, and the run's :class:`RolloutStats`.
        """
        cfg, info = self.config, self.target.info
        ids = validate_prompts(prompts, info.max_positions, info.vocab_size)
        step = step or PlainStep(self.target, cfg)
        batch = self._new_batch(ids)
        ledger = _Ledger.empty(len(ids), int(batch.limit.max()), info.eos_token_ids, self.target.device)
        stats = RolloutStats()
        start = time.perf_counter()
        emission = self._prefill(ids, batch, generator)
        stats.prefill_time, stats.prefill_tokens = time.perf_counter() - start, len(ids)
        step.start(batch)
        bar = tqdm(total=len(ids), desc="rollout", unit="req", disable=not progress, leave=False)
        from_step = False
        while True:
            counts, hit_eos = ledger.record(batch, emission)
            if from_step:
                stats.step_tokens.append(int(counts.sum()))
                if emission.arm is not None:
                    stats.accept_lengths = torch.cat([stats.accept_lengths, counts.cpu()])
            bar.update(ledger.retire(batch, hit_eos, start))
            if batch.n == 0:
                break
            emission = _timed_step(step, batch, generator, stats)
            from_step = True
        bar.close()
        stats.total_time = time.perf_counter() - start
        return RolloutResult(ledger.rollouts(ids, batch, stats.prefill_time), stats)

    def _new_batch(self, ids: list[torch.Tensor]) -> ActiveBatch:
        """Empty state for ``B`` prompts: cache, row bookkeeping and transcripts."""
        cfg, info, device, B = self.config, self.target.info, self.target.device, len(ids)
        prompt_len = torch.tensor([p.numel() for p in ids], device=device)
        limit = (info.max_positions - prompt_len).clamp(max=cfg.max_new_tokens)
        if bool((limit < cfg.max_new_tokens).any()):  # the same text each time: Python shows it once
            past = f"max_new_tokens={cfg.max_new_tokens} reaches past the model's context"
            warnings.warn(f"{past} ({info.max_positions}): responses stop where it ends", stacklevel=4)
        width = int((prompt_len + limit).max())  # no buffer beyond what a row can generate
        features = None
        if cfg.feature_layers:
            shape = (B, width, len(cfg.feature_layers), info.hidden_size)
            features = torch.zeros(shape, dtype=self.target.dtype, device=device)

        def zeros() -> torch.Tensor:  # [B] long
            return torch.zeros(B, dtype=torch.long, device=device)

        return ActiveBatch(
            cache=self.target.new_cache(B, width + self.cache_margin),
            request=torch.arange(B, device=device),
            last_token=zeros(),
            generated=zeros(),
            limit=limit,
            n=B,
            seq=torch.zeros(B, width, dtype=torch.long, device=device),
            prompt_len=prompt_len,
            features=features,
        )

    def _prefill(
        self, ids: list[torch.Tensor], batch: ActiveBatch, generator: torch.Generator | None
    ) -> Emission:
        """Run each distinct prompt through the target once, in chunks, and sample every request's first
        token.

        Identical prompts (a GRPO group's ``group_size`` copies) share one prefill: the ``U`` distinct ones
        fill cache rows ``[0, U)``, which are then copied to every request's own row
        (:meth:`~tlt_lightning.models.KVCache.gather_rows`). Each request samples its own first token from
        its prompt's logits, with the random draws a prefill of its own would make. Prompt tokens (and
        their features, when requested) go into the batch transcripts.
        """
        cfg, device = self.config, batch.seq.device
        for i, p in enumerate(ids):
            batch.seq[i, : p.numel()] = p
        distinct, source = _distinct(ids)
        source = source.to(device)
        hidden = []
        for start in range(0, len(distinct), cfg.prefill_chunk):
            chunk = distinct[start : start + cfg.prefill_chunk]
            lens = torch.tensor([p.numel() for p in chunk], device=device)
            width = int(lens.max())
            input_ids = torch.zeros(len(chunk), width, dtype=torch.long, device=device)
            for i, p in enumerate(chunk):
                input_ids[i, : p.numel()] = p
            positions = torch.arange(width, device=device).expand(len(chunk), width)
            slots = torch.arange(width, device=device)
            # Causal, and no row attends its own right padding.
            mask = (slots[None, None, :] <= slots[None, :, None]) & (
                slots[None, None, :] < lens[:, None, None]
            )
            rows = batch.cache.view(start, start + len(chunk))
            out = self.target.forward(input_ids, positions, mask[:, None], rows, cfg.feature_layers)
            if out.features is not None:
                batch.features[start : start + len(chunk), :width] = out.features
            hidden.append(out.hidden[torch.arange(len(chunk), device=device), lens - 1])
            rows.lengths[:] = lens
        if len(distinct) < len(ids):
            batch.cache.gather_rows(source)
            if batch.features is not None:
                width = int(batch.prompt_len.max())
                batch.features[:, :width] = batch.features[source, :width]
        hidden_by_request = torch.cat(hidden)[source]
        tokens, logprobs = [], []
        for start in range(0, len(ids), cfg.prefill_chunk):
            logits = self.target.lm_head(hidden_by_request[start : start + cfg.prefill_chunk])
            t, lp = sample_tokens(logits, cfg, generator)
            tokens.append(t)
            logprobs.append(lp)
        t, lp = torch.cat(tokens), torch.cat(logprobs)
        return Emission(t[:, None], torch.ones_like(t), lp[:, None], None)
