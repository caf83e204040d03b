"""RolloutEngine: batched sampling of many requests with a preallocated KV cache.

Requests leave the batch as soon as they finish (EOS, ``max_new_tokens`` or the context length):
the last active row moves into the finished row's slot, so every decode step runs on the active
requests only. That is what makes the long tail cheap in wall-clock terms, and it is the setting
in which speculative decoding pays: in the tail, few rows remain and each step is bound by
reading the weights, so verifying several drafted tokens costs little more than one.

A decode step is pluggable (:class:`DecodeStep`): :class:`PlainStep` samples one token per request;
the speculative loop supplies steps that emit several.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

import torch
from tqdm.auto import tqdm

from tlt_lightning.models.kv_cache import KVCache
from tlt_lightning.models.target import TargetModel
from tlt_lightning.rollout.types import Rollout, RolloutConfig, RolloutResult, RolloutStats
from tlt_lightning.speculative.sampling import sample, sampling_probs

__all__ = ["ActiveBatch", "DecodeStep", "Emission", "PlainStep", "RolloutBackend", "RolloutEngine"]


class RolloutBackend(Protocol):
    """Anything that turns prompts into rollouts (this engine, the speculative loop, vLLM)."""

    def generate(
        self, prompts: Sequence[Sequence[int]], generator: torch.Generator | None = None
    ) -> RolloutResult: ...


class Emission(NamedTuple):
    """Tokens a decode step emitted for the ``n`` active rows.

    Attributes:
        tokens: ``[n, m]`` int64; row ``i`` emitted ``tokens[i, :counts[i]]``.
        counts: ``[n]`` int64 in ``1..m``.
        logprobs: ``[n, m]`` float32 log-probabilities under the sampling distribution.
        features: ``[n, m, C, H]`` target features at the positions that predicted them, or None.
    """

    tokens: torch.Tensor
    counts: torch.Tensor
    logprobs: torch.Tensor
    features: torch.Tensor | None


@dataclass
class ActiveBatch:
    """The state of the active rows ``[0, n)`` of a rollout (row ``i`` serves request ``request[i]``).

    Invariant between steps: the cache holds each row's tokens up to, not including,
    ``last_token[i]``, which the next step feeds.
    """

    cache: KVCache
    request: torch.Tensor  # [B] int64 request index per row
    last_token: torch.Tensor  # [B] int64
    generated: torch.Tensor  # [B] int64 tokens emitted so far per row
    limit: torch.Tensor  # [B] int64 max tokens this row may emit (max_new and context bound)
    n: int

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
            self.cache.move_rows(movers, holes)
            for t in (self.request, self.last_token, self.generated, self.limit):
                t[holes] = t[movers]
        self.n = keep


class DecodeStep(Protocol):
    """One decode step over the active rows; it also advances ``batch.cache.lengths``."""

    def __call__(self, batch: ActiveBatch, generator: torch.Generator | None) -> Emission: ...


def causal_decode_mask(lengths: torch.Tensor, q: int, kv_len: int) -> torch.Tensor:
    """``[n, 1, q, kv_len]`` bool: query ``j`` of row ``i`` sees slots ``<= lengths[i] + j``."""
    slots = torch.arange(kv_len, device=lengths.device)
    query_pos = lengths[:, None] + torch.arange(q, device=lengths.device)  # [n, q]
    return (slots[None, None, :] <= query_pos[:, :, None])[:, None]


class PlainStep:
    """Autoregressive decoding: feed each row's last token, sample one new token per row."""

    def __init__(self, target: TargetModel, config: RolloutConfig) -> None:
        self.target, self.config = target, config

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
        tokens = logits.argmax(-1)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    probs = sampling_probs(logits, config.sampling)
    tokens = sample(probs, generator)
    return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log()


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

    def __init__(self, target: TargetModel, config: RolloutConfig | None = None, cache_margin: int = 0) -> None:
        self.target = target
        self.config = config or RolloutConfig()
        self.cache_margin = cache_margin

    def with_config(self, **changes: object) -> RolloutEngine:
        """A copy of this engine with some config fields changed (shares the target)."""
        return RolloutEngine(self.target, replace(self.config, **changes), self.cache_margin)

    def _validate(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        if len(prompts) == 0:
            raise ValueError("prompts is empty: pass at least one prompt (a list of token ids)")
        info, out = self.target.info, []
        for i, prompt in enumerate(prompts):
            try:
                ids = torch.as_tensor(prompt, dtype=torch.long).flatten()
            except (TypeError, ValueError) as err:
                raise TypeError(
                    f"prompts[{i}] must be a sequence of int token ids, got {type(prompt).__name__}"
                ) from err
            if ids.numel() == 0:
                raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
            if ids.numel() >= info.max_positions:
                raise ValueError(
                    f"prompts[{i}] has {ids.numel()} tokens, which leaves no room to generate in the "
                    f"model's context of {info.max_positions} tokens"
                )
            if int(ids.min()) < 0 or int(ids.max()) >= info.vocab_size:
                raise ValueError(f"prompts[{i}] has token ids outside [0, {info.vocab_size})")
            out.append(ids)
        return out

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
        ids = self._validate(prompts)
        step = step or PlainStep(self.target, cfg)
        device, B = self.target.device, len(ids)
        prompt_len = torch.tensor([p.numel() for p in ids], device=device)
        limit = (info.max_positions - prompt_len).clamp(max=cfg.max_new_tokens)
        cache = self.target.new_cache(B, int(prompt_len.max()) + cfg.max_new_tokens + self.cache_margin)

        # Per-request outputs, written in place as rows emit tokens.
        tokens = torch.zeros(B, cfg.max_new_tokens, dtype=torch.long, device=device)
        logprobs = torch.zeros(B, cfg.max_new_tokens, dtype=torch.float32, device=device)
        features = None
        if cfg.feature_layers:
            shape = (B, cfg.max_new_tokens, len(cfg.feature_layers), info.hidden_size)
            features = torch.zeros(shape, dtype=self.target.dtype, device=device)
        first_time, finish_time = [0.0] * B, [0.0] * B
        finish_eos = torch.zeros(B, dtype=torch.bool, device=device)
        lengths = torch.zeros(B, dtype=torch.long, device=device)
        eos = torch.tensor(info.eos_token_ids, dtype=torch.long, device=device)

        stats = RolloutStats()
        start = time.perf_counter()
        batch = ActiveBatch(
            cache, torch.arange(B, device=device), torch.zeros(B, dtype=torch.long, device=device),
            torch.zeros(B, dtype=torch.long, device=device), limit, B,
        )
        emission = self._prefill(ids, prompt_len, cache, generator)
        stats.prefill_time, stats.prefill_tokens = time.perf_counter() - start, B
        first_time[:] = [stats.prefill_time] * B
        bar = tqdm(total=B, desc="rollout", unit="req", disable=not progress, leave=False)
        from_step = False
        while True:
            # Record the emission of the previous forward for rows [0, n).
            n, req = batch.n, batch.request[: batch.n]
            counts = emission.counts.clamp(max=batch.limit[:n] - batch.generated[:n])
            offs = torch.arange(emission.tokens.shape[1], device=device)
            is_eos = torch.isin(emission.tokens, eos) & (offs[None] < counts[:, None])
            hit_eos = is_eos.any(1)
            counts = torch.where(hit_eos, is_eos.int().argmax(1) + 1, counts)
            valid = offs[None] < counts[:, None]
            rows, cols = valid.nonzero(as_tuple=True)
            dest = (req[rows], batch.generated[rows] + cols)
            tokens[dest] = emission.tokens[rows, cols]
            logprobs[dest] = emission.logprobs[rows, cols]
            if features is not None:
                features[dest] = emission.features[rows, cols].to(features.dtype)
            batch.generated[:n] += counts
            if from_step:
                stats.step_tokens.append(int(counts.sum()))
            batch.last_token[:n] = emission.tokens.gather(1, (counts - 1)[:, None]).squeeze(1)
            finished = hit_eos | (batch.generated[:n] >= batch.limit[:n])
            if bool(finished.any()):
                now = time.perf_counter() - start
                done = req[finished].tolist()
                for r in done:
                    finish_time[r] = now
                finish_eos[req[finished]] = hit_eos[finished]
                lengths[req[finished]] = batch.generated[:n][finished]
                batch.remove(finished)
                bar.update(len(done))
            if batch.n == 0:
                break
            t0 = time.perf_counter()
            n = batch.n
            emission = step(batch, generator)
            stats.step_times.append(time.perf_counter() - t0)
            stats.step_batch_sizes.append(n)
            from_step = True
        bar.close()
        stats.total_time = time.perf_counter() - start
        rollouts = [
            Rollout(
                prompt_ids=ids[i],
                token_ids=tokens[i, : lengths[i]].clone(),
                logprobs=logprobs[i, : lengths[i]].clone(),
                finish_reason="eos" if bool(finish_eos[i]) else "length",
                first_token_time=first_time[i],
                finish_time=finish_time[i],
                features=features[i, : lengths[i]].clone() if features is not None else None,
            )
            for i in range(B)
        ]
        return RolloutResult(rollouts, stats)

    def _prefill(
        self, ids: list[torch.Tensor], prompt_len: torch.Tensor, cache: KVCache, generator: torch.Generator | None
    ) -> Emission:
        """Run the prompts through the target in chunks; sample each request's first token."""
        cfg, device = self.config, prompt_len.device
        emitted: list[Emission] = []
        for start in range(0, len(ids), cfg.prefill_chunk):
            chunk = ids[start : start + cfg.prefill_chunk]
            lens = prompt_len[start : start + len(chunk)]
            width = int(lens.max())
            input_ids = torch.zeros(len(chunk), width, dtype=torch.long, device=device)
            for i, p in enumerate(chunk):
                input_ids[i, : p.numel()] = p
            positions = torch.arange(width, device=device).expand(len(chunk), width)
            slots = torch.arange(width, device=device)
            # Causal, and no row attends its own right padding.
            mask = (slots[None, None, :] <= slots[None, :, None]) & (slots[None, None, :] < lens[:, None, None])
            rows = cache.view(start, start + len(chunk))
            out = self.target.forward(input_ids, positions, mask[:, None], rows, cfg.feature_layers)
            last = lens - 1
            hidden = out.hidden[torch.arange(len(chunk), device=device), last]
            tokens, logprobs = sample_tokens(self.target.lm_head(hidden), cfg, generator)
            rows.lengths[:] = lens
            feats = None
            if out.features is not None:
                feats = out.features[torch.arange(len(chunk), device=device), last][:, None]
            ones = torch.ones_like(tokens)
            emitted.append(Emission(tokens[:, None], ones, logprobs[:, None], feats))
        return Emission(
            torch.cat([e.tokens for e in emitted]),
            torch.cat([e.counts for e in emitted]),
            torch.cat([e.logprobs for e in emitted]),
            torch.cat([e.features for e in emitted]) if cfg.feature_layers else None,
        )
