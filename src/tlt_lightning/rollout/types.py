"""Rollout configuration and results: plain data, returned by the engine, logged by callbacks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tlt_lightning.speculative.sampling import SamplingParams

__all__ = ["Rollout", "RolloutConfig", "RolloutResult", "RolloutStats", "validate_prompts"]


@dataclass(frozen=True)
class RolloutConfig:
    """How a batch of requests is generated.

    Args:
        max_new_tokens: tokens generated per request at most (a request also stops at EOS and at
            the model's context length).
        temperature: sampling temperature; ``0`` is greedy.
        top_p: nucleus mass in ``(0, 1]``.
        top_k: keep the ``k`` most likely tokens (``0`` = off).
        feature_layers: target hidden-state indices to return per generated token (drafter
            training data); empty for none. ``0`` = embeddings, ``L`` = final normalised state.
        prefill_chunk: prompts prefilled per forward pass (bounds prefill memory).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    feature_layers: tuple[int, ...] = ()
    prefill_chunk: int = 32

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if self.prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk must be > 0, got {self.prefill_chunk!r}")
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        SamplingParams(self.temperature, self.top_p, self.top_k)  # raises on a bad temperature/top_p/top_k

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)


@dataclass
class Rollout:
    """One generated response.

    Attributes:
        prompt_ids: ``[P]`` int64 prompt tokens.
        token_ids: ``[T]`` int64 generated tokens (EOS included when it ended the response).
        logprobs: ``[T]`` float32 log-probability of each token under the distribution it was
            sampled from (after temperature / top-k / top-p; ``0`` under greedy).
        finish_reason: ``"eos"`` or ``"length"``.
        first_token_time: seconds from the start of the rollout to this request's first token.
        finish_time: seconds from the start of the rollout to its last token.
        features: ``[T, C, H]`` target hidden states at the position that predicted each token
            (the drafter's input), or ``None`` when not requested.
    """

    prompt_ids: torch.Tensor
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    finish_reason: str
    first_token_time: float
    finish_time: float
    features: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())


@dataclass
class RolloutStats:
    """What happened during one rollout, step by step.

    Attributes:
        step_batch_sizes: active requests at each decode step.
        step_times: seconds each decode step took.
        step_cpu_times: CPU seconds of the calling thread in each decode step (with one torch
            thread, all of the step's work; unlike ``step_times``, not inflated by a busy machine).
        step_tokens: tokens emitted by each step (all requests together).
        step_speculative: whether each step used speculative decoding.
        step_arms: the arm of each step (a ``DraftSpec``; ``None`` = plain decoding).
        step_draft_depths: draft levels each step verified (0 = plain; a chain with
            ``min_confidence`` may stop short of its ``num_steps``).
        accept_lengths: per request and speculative step, the tokens it emitted (``[N]`` int64).
        prefill_tokens: tokens sampled from the prefill (one per request).
        prefill_time: seconds spent prefilling prompts.
        total_time: wall-clock seconds of the whole rollout.
    """

    step_batch_sizes: list[int] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    step_cpu_times: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    step_speculative: list[bool] = field(default_factory=list)
    step_arms: list[object] = field(default_factory=list)
    step_draft_depths: list[int] = field(default_factory=list)
    accept_lengths: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    prefill_tokens: int = 0
    prefill_time: float = 0.0
    total_time: float = 0.0

    @property
    def num_steps(self) -> int:
        return len(self.step_times)

    @property
    def generated_tokens(self) -> int:
        return self.prefill_tokens + int(sum(self.step_tokens))

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_time if self.total_time > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens of the decode steps per second of them: the prefill left out (speculation does not
        change it, and for short responses it weighs on the whole-rollout rate)."""
        seconds = sum(self.step_times)
        return sum(self.step_tokens) / seconds if seconds > 0 else 0.0

    @property
    def mean_accept_length(self) -> float:
        """Mean tokens emitted per request per speculative step (``0`` if none ran)."""
        return float(self.accept_lengths.float().mean()) if self.accept_lengths.numel() else 0.0


@dataclass
class RolloutResult:
    """The rollouts of a batch of prompts, in prompt order, and the stats of the run."""

    rollouts: list[Rollout]
    stats: RolloutStats

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` int64 response lengths."""
        return torch.tensor([r.length for r in self.rollouts], dtype=torch.long)


def validate_prompts(prompts: Sequence[Sequence[int]], context: int, vocab_size: int) -> list[torch.Tensor]:
    """Check ``B`` token-id prompts against a model's context and vocabulary; return them as ``[P_i]`` int64.

    Raises:
        ValueError / TypeError: an empty batch or prompt, a non-integer prompt, a prompt that fills
            the context, token ids outside ``[0, vocab_size)``; the message names the prompt index.
    """
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt (a list of token ids)")
    out = []
    for i, prompt in enumerate(prompts):
        try:
            ids = torch.as_tensor(prompt, dtype=torch.long).flatten()
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"prompts[{i}] must be a sequence of int token ids, got {type(prompt).__name__}"
            ) from err
        if ids.numel() == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
        if ids.numel() >= context:
            raise ValueError(
                f"prompts[{i}] has {ids.numel()} tokens, which leaves no room to generate in the "
                f"model's context of {context} tokens"
            )
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size})")
        out.append(ids)
    return out
