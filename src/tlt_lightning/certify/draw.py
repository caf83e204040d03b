"""Drawing many short continuations of one prefix: through a decode step, or through any backend.

A certificate needs thousands of samples of the next few tokens after the *same* prefix. Through
:func:`draw_with_step` the prefix is prefilled once and its keys and values copied into every row, so
a sample costs only the decode steps under test (a speculative step: the drafts and one verify
forward), the way :class:`~tlt_lightning.rollout.RolloutEngine` runs them after its prefill. Through
:func:`draw_with_backend` any :class:`~tlt_lightning.rollout.RolloutBackend` (e.g. vLLM) generates the
replicated prefix as ordinary prompts: the first token then comes from the backend's prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tlt_lightning.models.target import TargetModel
from tlt_lightning.rollout.engine import ActiveBatch, DecodeStep, RolloutBackend, causal_decode_mask

__all__ = ["draw_with_backend", "draw_with_step", "shared_prefix_cache"]


def shared_prefix_cache(target: TargetModel, prefix: torch.Tensor, rows: int, room: int, feature_layers=()):
    """A cache of ``rows`` rows that all hold ``prefix`` (prefilled once), and the prefix's features.

    Args:
        target: the model.
        prefix: ``[S]`` int64 tokens to prefill.
        rows: rows of the cache.
        room: slots per row past the prefix.
        feature_layers: hidden-state indices to return for the prefix.

    Returns:
        The cache (``lengths = S``) and ``[S, C, H]`` features (``None`` without ``feature_layers``).
    """
    S = prefix.numel()
    cache = target.new_cache(rows, S + room)
    features = None
    if S:
        positions = torch.arange(S, device=prefix.device)[None]
        mask = causal_decode_mask(torch.zeros(1, dtype=torch.long, device=prefix.device), S, S)
        out = target.forward(prefix[None], positions, mask, cache.view(0, 1), tuple(feature_layers))
        cache.keys[:, 1:, :, :S] = cache.keys[:, :1, :, :S]
        cache.values[:, 1:, :, :S] = cache.values[:, :1, :, :S]
        features = out.features[0] if out.features is not None else None
    cache.lengths[:] = S
    return cache, features


@torch.inference_mode()
def draw_with_step(
    target: TargetModel,
    make_step: callable,
    prefix: Sequence[int],
    prompt_len: int,
    rows: int,
    depth: int,
    feature_layers: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
    chunk: int = 512,
    room: int = 40,
) -> torch.Tensor:
    """Sample ``rows`` continuations of ``depth`` tokens after ``prefix`` with decode steps only.

    The batch is the state a :class:`~tlt_lightning.rollout.RolloutEngine` is in after its prefill,
    with ``prefix[-1]`` as the token just sampled: each step emits one or more tokens per row
    (counting from ``prefix[-1]``'s successor) until a row has ``depth`` tokens or emits EOS.

    Args:
        target: the model the step decodes.
        make_step: ``() -> DecodeStep``, a fresh step per chunk of rows (e.g. a ``SpeculativeStep``).
        prefix: ``S >= 2`` token ids (prompt and the continuation so far).
        prompt_len: how many of them are the prompt (a drafter's context starts at its last token;
            a prompt that is the whole prefix counts as one token shorter).
        rows: samples to draw.
        depth: tokens per sample.
        feature_layers: target features the step needs (a drafter's ``feature_layers`` first).
        generator: the random source.
        chunk: rows per batch.
        room: cache slots past ``prefix + depth`` (a step's drafts; at least its deepest arm + 1).

    Returns:
        ``[rows, depth]`` int64 tokens, ``-1`` after an EOS.
    """
    ids = torch.as_tensor(list(prefix), dtype=torch.long, device=target.device)
    S = ids.numel()
    if S < 2 or not 1 <= prompt_len <= S:
        raise ValueError(
            f"prefix needs >= 2 tokens and 1 <= prompt_len <= len(prefix), got {S} and {prompt_len}"
        )
    prompt_len = min(prompt_len, S - 1)  # prefix[-1] plays the token just sampled
    eos = torch.tensor(target.info.eos_token_ids, dtype=torch.long, device=ids.device)
    out = torch.full((rows, depth), -1, dtype=torch.long)
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        batch = _batch(target, ids, prompt_len, n, depth, room, feature_layers)
        step: DecodeStep = make_step()
        step.start(batch)
        got = torch.zeros(n, dtype=torch.long, device=ids.device)  # tokens drawn, by request
        while batch.n:
            _record(batch, step(batch, generator), got, out[start : start + n], eos, depth, S)
    return out


def _batch(target, ids, prompt_len, n, depth, room, feature_layers) -> ActiveBatch:
    """The engine's state after prefilling ``ids[:-1]`` for ``n`` requests that sampled ``ids[-1]``."""
    S, device = ids.numel(), ids.device
    cache, feats = shared_prefix_cache(target, ids[:-1], n, depth + room, feature_layers)
    width = S + depth
    features = None
    if feature_layers:
        shape = (n, width, len(feature_layers), target.info.hidden_size)
        features = torch.zeros(shape, dtype=target.dtype, device=device)
        features[:, prompt_len - 1 : S - 1] = feats[prompt_len - 1 :]  # what a drafter reads
    seq = torch.zeros(n, width, dtype=torch.long, device=device)
    seq[:, :S] = ids

    def full(value: int) -> torch.Tensor:
        return torch.full((n,), value, dtype=torch.long, device=device)

    return ActiveBatch(
        cache=cache,
        request=torch.arange(n, device=device),
        last_token=full(int(ids[-1])),
        generated=full(S - prompt_len),
        limit=full(S - prompt_len + depth),
        n=n,
        seq=seq,
        prompt_len=full(prompt_len),
        features=features,
    )


def _record(batch: ActiveBatch, emission, got, out, eos, depth: int, S: int) -> None:
    """Write a step's emission into the transcripts and ``out``; drop the rows that are done."""
    n, req = batch.n, batch.request[: batch.n]
    counts = emission.counts.clamp(max=depth - got[req])
    offs = torch.arange(emission.tokens.shape[1], device=counts.device)
    is_eos = torch.isin(emission.tokens, eos) & (offs[None] < counts[:, None])
    hit_eos = is_eos.any(1)
    counts = torch.where(hit_eos, is_eos.int().argmax(1) + 1, counts)
    rows, cols = (offs[None] < counts[:, None]).nonzero(as_tuple=True)
    pos = batch.prompt_len[req[rows]] + batch.generated[rows] + cols
    batch.seq[req[rows], pos] = emission.tokens[rows, cols]
    out[req[rows].cpu(), (got[req[rows]] + cols).cpu()] = emission.tokens[rows, cols].cpu()
    if emission.features is not None and batch.features is not None:
        batch.features[req[rows], pos - 1] = emission.features[rows, cols].to(batch.features.dtype)
    batch.generated[:n] += counts
    got[req] += counts
    batch.last_token[:n] = emission.tokens.gather(1, (counts - 1)[:, None]).squeeze(1)
    batch.remove(hit_eos | (got[req] >= depth))


def draw_with_backend(
    backend: RolloutBackend,
    prefix: Sequence[int],
    rows: int,
    depth: int,
    eos_token_ids: Sequence[int],
    generator: torch.Generator | None = None,
    chunk: int = 512,
) -> torch.Tensor:
    """Sample ``rows`` continuations of ``prefix`` through any backend's ``generate``.

    The backend must be configured to generate ``depth`` tokens with the sampling settings under
    test (e.g. ``VLLMRolloutBackend`` with its ``RolloutConfig``); responses are cut at ``depth``.

    Returns:
        ``[rows, depth]`` int64 tokens, ``-1`` after an EOS or where a response ended.
    """
    out = torch.full((rows, depth), -1, dtype=torch.long)
    eos = set(int(e) for e in eos_token_ids)
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        result = backend.generate([list(prefix)] * n, generator=generator)
        for i, rollout in enumerate(result.rollouts):
            tokens = rollout.token_ids.tolist()[:depth]
            for j, t in enumerate(tokens):
                out[start + i, j] = t
                if t in eos:
                    break
    return out
