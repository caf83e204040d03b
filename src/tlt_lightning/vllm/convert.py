"""Pure conversion between our rollout types and vLLM's requests and outputs (never imports vLLM).

Requests go out as :class:`VLLMRequest`: the prompt's token ids (``vllm.TokensPrompt``) and the
keyword arguments of ``vllm.SamplingParams``. Outputs come back as ``vllm.RequestOutput`` objects,
read here by attribute only (``outputs[0].token_ids``, ``.logprobs``, ``.finish_reason``,
``.metrics``), so small fakes stand in for them in tests.

Choices that keep vLLM's rollouts the same distribution as :class:`~tlt_lightning.rollout.RolloutEngine`:

* stopping: ``ignore_eos=True`` plus ``stop_token_ids`` = the target's EOS ids, so a request stops at
  exactly the tokens our engine stops at (not at a tokenizer EOS vLLM may add on its own), and
  the EOS token stays in the response, as in ours;
* length: ``max_tokens = min(max_new_tokens, max_model_len - prompt length)``, our engine's limit;
* log-probabilities: ``logprobs=0`` (the sampled token only) from an engine built with
  ``logprobs_mode="processed_logprobs"``: the distribution after temperature / top-k / top-p, which
  is what :attr:`Rollout.logprobs` holds; none are requested under greedy, where ours are ``0``;
* randomness: one seed per request drawn from the caller's ``torch.Generator``, so the same
  generator state gives the same rollouts (vLLM's random streams differ from ours: same
  distribution, not the same samples).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tlt_lightning.rollout.types import Rollout, RolloutConfig, validate_prompts
from tlt_lightning.validation import positive_int

__all__ = [
    "SAMPLING_EPS",
    "SpecCounters",
    "TargetLimits",
    "VLLMRequest",
    "accept_length_histogram",
    "build_requests",
    "check_supported",
    "request_seeds",
    "rollouts_from_outputs",
    "sampling_kwargs",
    "spec_counters",
]

SAMPLING_EPS = 1e-5  # vLLM samples greedily below this temperature
_FINISH = {"stop": "eos", "length": "length"}


@dataclass(frozen=True)
class TargetLimits:
    """What requests are checked against: the served model's vocabulary, context and EOS ids."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_model_len"):
            positive_int(name, getattr(self, name))
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))

    @classmethod
    def from_model_dir(cls, path: str | Path, max_model_len: int | None = None) -> TargetLimits:
        """Read the limits of a transformers checkpoint directory (``config.json``,
        ``generation_config.json``).

        EOS ids come from ``generation_config.json`` when it names any, else ``config.json``, the
        order :class:`~tlt_lightning.models.HFTarget` uses.
        """
        path = Path(path)
        config = _read_json(path / "config.json")
        generation = (
            _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
        )
        eos = generation.get("eos_token_id")
        if eos is None:
            eos = config.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        context = int(config.get("max_position_embeddings", 0)) or None
        if max_model_len is not None:
            context = min(context, max_model_len) if context else max_model_len
        if context is None:
            raise ValueError(f"{path / 'config.json'} has no max_position_embeddings: pass max_model_len")
        return cls(int(config["vocab_size"]), context, eos_ids)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path} not found: {path.parent} is not a transformers checkpoint directory")
    return json.loads(path.read_text())


@dataclass(frozen=True)
class VLLMRequest:
    """One request in vLLM's terms: ``TokensPrompt(prompt_token_ids=...)`` and
    ``SamplingParams(**sampling)``."""

    prompt_token_ids: list[int]
    sampling: dict[str, Any]


def check_supported(config: RolloutConfig, limits: TargetLimits) -> None:
    """Raise ``ValueError`` naming the field of ``config`` vLLM cannot honour exactly.

    Raises:
        ValueError: ``feature_layers`` is set (vLLM returns no hidden states), ``temperature`` is
            positive but below vLLM's greedy threshold (it would silently sample greedily), or
            ``top_k`` exceeds the vocabulary.
    """
    if config.feature_layers:
        raise ValueError(
            f"feature_layers must be empty for the vLLM backend (it returns no hidden states), got "
            f"{config.feature_layers}; compute drafter features with a target forward over the rollouts "
            "instead"
        )
    if 0 < config.temperature < SAMPLING_EPS:
        raise ValueError(
            f"temperature must be 0 (greedy) or >= {SAMPLING_EPS} for the vLLM backend "
            f"(vLLM samples greedily below that), got {config.temperature!r}"
        )
    if config.top_k > limits.vocab_size:
        raise ValueError(
            f"top_k must be <= the vocabulary size {limits.vocab_size} (0 = off), got {config.top_k}"
        )


def sampling_kwargs(
    config: RolloutConfig, max_tokens: int, eos_token_ids: Sequence[int], seed: int | None = None
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one request (see the module docstring).

    Args:
        config: our sampling settings (validate them with :func:`check_supported` first).
        max_tokens: tokens this request may generate (already bounded by the context).
        eos_token_ids: the tokens that end a response.
        seed: the request's random seed, ``None`` for the engine's own stream.
    """
    greedy = config.sampling.greedy
    kwargs: dict[str, Any] = {
        "n": 1,
        "temperature": 0.0 if greedy else float(config.temperature),
        "top_p": 1.0 if greedy else float(config.top_p),
        "top_k": 0 if greedy else int(config.top_k),
        "max_tokens": int(max_tokens),
        "min_tokens": 0,
        "logprobs": None if greedy else 0,  # greedy responses carry log-probability 0 (see Rollout)
        "ignore_eos": True,
        "stop_token_ids": [int(i) for i in eos_token_ids],
        "detokenize": False,
        "skip_special_tokens": False,
    }
    if seed is not None and not greedy:
        kwargs["seed"] = int(seed)
    return kwargs


def request_seeds(n: int, generator: torch.Generator | None) -> list[int | None]:
    """``n`` per-request seeds drawn from ``generator`` (``None`` each without one)."""
    if generator is None:
        return [None] * n
    draws = torch.randint(0, 2**62, (n,), generator=generator, device=generator.device)
    return [int(s) for s in draws.tolist()]


def build_requests(
    prompts: Sequence[Sequence[int]],
    config: RolloutConfig,
    limits: TargetLimits,
    seeds: Sequence[int | None] | None = None,
) -> list[VLLMRequest]:
    """Validate ``B`` token-id prompts and turn them into vLLM requests.

    Args:
        prompts: ``B`` prompts, each a sequence of token ids.
        config: sampling and length settings.
        limits: the served model's vocabulary, context length and EOS ids.
        seeds: ``B`` per-request seeds (see :func:`request_seeds`), or ``None``.

    Raises:
        ValueError / TypeError: an empty batch or prompt, a non-integer prompt, token ids outside the
            vocabulary, a prompt that fills the context, or a setting :func:`check_supported` rejects.
    """
    check_supported(config, limits)
    ids = validate_prompts(prompts, limits.max_model_len, limits.vocab_size)
    seeds = list(seeds) if seeds is not None else [None] * len(prompts)
    if len(seeds) != len(prompts):
        raise ValueError(f"seeds must have one entry per prompt ({len(prompts)}), got {len(seeds)}")
    return [
        VLLMRequest(
            p.tolist(),
            sampling_kwargs(
                config,
                min(config.max_new_tokens, limits.max_model_len - p.numel()),
                limits.eos_token_ids,
                seed,
            ),
        )
        for p, seed in zip(ids, seeds)
    ]


# ------------------------------------------------------------------------------------------ outputs
def _token_logprob(entry: Any, token: int, where: str) -> float:
    """The sampled token's log-probability from one position of vLLM's ``logprobs`` (a mapping
    token id -> ``Logprob`` with a ``.logprob`` float)."""
    if entry is None or token not in entry:
        raise ValueError(f"{where}: vLLM returned no log-probability for the sampled token {token}")
    value = entry[token]
    return float(getattr(value, "logprob", value))


def _request_times(metrics: Any, total: float) -> tuple[float, float]:
    """``(first_token_time, finish_time)`` in seconds from the start, from vLLM's per-request stats
    (``first_token_latency`` and engine-core timestamps) when present, else ``(total, total)``."""
    first = float(getattr(metrics, "first_token_latency", 0.0) or 0.0)
    first_ts = float(getattr(metrics, "first_token_ts", 0.0) or 0.0)
    last_ts = float(getattr(metrics, "last_token_ts", 0.0) or 0.0)
    if first <= 0 or first_ts <= 0 or last_ts < first_ts:
        return total, total
    return min(first, total), min(first + last_ts - first_ts, total)


def rollouts_from_outputs(
    outputs: Sequence[Any],
    requests: Sequence[VLLMRequest],
    config: RolloutConfig,
    eos_token_ids: Sequence[int],
    total_time: float,
) -> list[Rollout]:
    """Turn vLLM ``RequestOutput`` s (in request order) into our :class:`Rollout` s.

    Args:
        outputs: one ``RequestOutput`` per request, as ``LLM.generate`` returns them.
        requests: the requests they answer (prompts and limits are checked against them).
        config: the sampling settings (greedy responses get log-probabilities ``0``, as ours do).
        eos_token_ids: the tokens that end a response.
        total_time: seconds the whole batch took (bounds the per-request times).

    Returns:
        One rollout per request: ``token_ids`` ``[T]`` int64 (EOS included when it ended the
        response), ``logprobs`` ``[T]`` float32, ``finish_reason`` ``"eos"`` or ``"length"``.

    Raises:
        ValueError: a count or prompt mismatch, a request that stopped for another reason (vLLM's
            ``"abort"``, a stop string, a token that is not an EOS), or missing log-probabilities.
    """
    if len(outputs) != len(requests):
        raise ValueError(f"vLLM returned {len(outputs)} outputs for {len(requests)} requests")
    eos = {int(i) for i in eos_token_ids}
    greedy = config.sampling.greedy
    rollouts = []
    for i, (out, req) in enumerate(zip(outputs, requests)):
        where = f"request {i}"
        prompt = list(getattr(out, "prompt_token_ids", None) or req.prompt_token_ids)
        if prompt != req.prompt_token_ids:
            raise ValueError(f"{where}: vLLM answered another prompt (outputs must come in request order)")
        completion = out.outputs[0]
        tokens = [int(t) for t in completion.token_ids]
        reason = _FINISH.get(completion.finish_reason)
        if reason is None:
            raise ValueError(
                f"{where}: vLLM finished it with reason {completion.finish_reason!r}; "
                f"expected one of {sorted(_FINISH)}"
            )
        if reason == "eos" and (not tokens or tokens[-1] not in eos):
            raise ValueError(
                f"{where}: vLLM stopped it (stop_reason {getattr(completion, 'stop_reason', None)!r}) "
                f"but its last token is not an EOS id {sorted(eos)}"
            )
        if len(tokens) > req.sampling["max_tokens"]:
            raise ValueError(f"{where}: {len(tokens)} tokens exceed max_tokens={req.sampling['max_tokens']}")
        if greedy:
            logprobs = [0.0] * len(tokens)
        else:
            entries = completion.logprobs
            if entries is None or len(entries) != len(tokens):
                raise ValueError(
                    f"{where}: vLLM returned no per-token log-probabilities (requested logprobs=0)"
                )
            logprobs = [_token_logprob(entries[t], tok, f"{where} token {t}") for t, tok in enumerate(tokens)]
        first, finish = _request_times(getattr(out, "metrics", None), total_time)
        rollouts.append(
            Rollout(
                prompt_ids=torch.tensor(req.prompt_token_ids, dtype=torch.long),
                token_ids=torch.tensor(tokens, dtype=torch.long),
                logprobs=torch.tensor(logprobs, dtype=torch.float32),
                finish_reason=reason,
                first_token_time=first,
                finish_time=finish,
            )
        )
    return rollouts


# ------------------------------------------------------------------------------ speculative metrics
@dataclass(frozen=True)
class SpecCounters:
    """vLLM's cumulative speculative-decoding counters (or a difference of two readings).

    Attributes:
        drafts: speculative steps, counted per request.
        draft_tokens: tokens drafted.
        accepted_tokens: drafted tokens the target accepted.
        accepted_per_position: ``[K]`` accepted drafts at draft position ``k`` (chains accept a
            prefix, so it never increases with ``k``).
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        K = max(len(self.accepted_per_position), len(other.accepted_per_position))

        def pad(v: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(v) + (0,) * (K - len(v))

        return SpecCounters(
            self.drafts - other.drafts,
            self.draft_tokens - other.draft_tokens,
            self.accepted_tokens - other.accepted_tokens,
            tuple(a - b for a, b in zip(pad(self.accepted_per_position), pad(other.accepted_per_position))),
        )

    @property
    def mean_accept_length(self) -> float:
        """Tokens emitted per request per speculative step (accepted drafts + the target's own)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0


_SPEC = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(metrics: Iterable[Any]) -> SpecCounters:
    """Sum vLLM's speculative counters over engines from ``LLM.get_metrics()``.

    Each metric has ``.name``; counters ``.value``, vectors ``.values``. A ``_total`` suffix
    (Prometheus spelling) is accepted; unrelated metrics are ignored.
    """
    totals = dict.fromkeys(_SPEC.values(), 0)
    per_pos: list[int] = []
    for metric in metrics:
        name = str(metric.name).removesuffix("_total")
        if name in _SPEC:
            totals[_SPEC[name]] += int(metric.value)
        elif name == _PER_POS:
            values = [int(v) for v in metric.values]
            per_pos += [0] * max(0, len(values) - len(per_pos))
            for k, v in enumerate(values):
                per_pos[k] += v
    return SpecCounters(totals["drafts"], totals["draft_tokens"], totals["accepted_tokens"], tuple(per_pos))


def accept_length_histogram(counters: SpecCounters) -> torch.Tensor:
    """``[drafts]`` int64 accept lengths (tokens emitted per request per speculative step), in no order.

    Chain drafting accepts a prefix, so the number of steps that accepted exactly ``j`` drafts is
    ``a[j-1] - a[j]`` (``a[-1]`` = all steps, ``a[K]`` = 0) and each emitted ``j + 1`` tokens. This is
    the multiset :attr:`RolloutStats.accept_lengths` holds for our own engine. Empty when the
    counters are not a chain's (per-position counts increase, or do not add up).
    """
    a = [counters.drafts, *counters.accepted_per_position, 0]
    exact = [a[j] - a[j + 1] for j in range(len(a) - 1)]
    if (
        counters.drafts <= 0
        or any(c < 0 for c in exact)
        or sum(counters.accepted_per_position) != counters.accepted_tokens
    ):
        return torch.zeros(0, dtype=torch.long)
    lengths = torch.arange(1, len(exact) + 1, dtype=torch.long)
    return torch.repeat_interleave(lengths, torch.tensor(exact, dtype=torch.long))
