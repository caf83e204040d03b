"""Rollouts as training data: prompt + completion sequences padded for one policy forward.

:func:`policy_batch` pads a :class:`~tlt_lightning.rollout.RolloutResult` into a
:class:`PolicyBatch`; :func:`completion_logprobs` runs a causal LM over it and returns the
log-probabilities of the completion tokens only, computing logits just where they are needed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from tlt_lightning.rl.grpo import token_logprobs
from tlt_lightning.rollout import RolloutResult

__all__ = ["PolicyBatch", "completion_logprobs", "policy_batch"]


class PolicyBatch(NamedTuple):
    """Prompt + completion sequences ready for the policy forward (right-padded).

    Attributes:
        input_ids: ``[B, S]`` int64 prompt then completion, zero-padded.
        attention_mask: ``[B, S]`` int64, 1 on real tokens.
        prompt_lens: ``[B]`` int64 prompt lengths (completion ``t`` sits at ``prompt_len + t``).
        tokens: ``[B, T]`` int64 completion tokens, zero-padded.
        mask: ``[B, T]`` bool, true on completion tokens.
        advantages: ``[B]`` float32.
        rollout_logprobs: ``[B, T]`` float32 log-probabilities the rollout reported.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_lens: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor

    def select(self, rows: torch.Tensor) -> PolicyBatch:
        """The sequences ``rows`` (``[b]`` int64), padding trimmed to their own longest."""
        lens = self.attention_mask[rows].sum(1)
        S, T = int(lens.max()), int(self.mask[rows].sum(1).max())
        return PolicyBatch(
            self.input_ids[rows, :S],
            self.attention_mask[rows, :S],
            self.prompt_lens[rows],
            self.tokens[rows, :T],
            self.mask[rows, :T],
            self.advantages[rows],
            self.rollout_logprobs[rows, :T],
        )


def policy_batch(
    result: RolloutResult, advantages: torch.Tensor, device: torch.device | str = "cpu"
) -> PolicyBatch:
    """Pad the rollouts of ``result`` into a :class:`PolicyBatch` with ``advantages`` ``[N]``.

    The tensors are fresh copies (not inference tensors), so autograd can save them.
    """
    rolls = result.rollouts
    if advantages.shape != (len(rolls),):
        raise ValueError(f"advantages must be [{len(rolls)}] (one per rollout), got {list(advantages.shape)}")
    seqs = [torch.cat([r.prompt_ids, r.token_ids]).to(device) for r in rolls]
    input_ids = pad_sequence(seqs, batch_first=True)
    seq_lens = torch.tensor([s.numel() for s in seqs], device=device)
    attention_mask = (torch.arange(input_ids.shape[1], device=device) < seq_lens[:, None]).long()
    tokens = pad_sequence([r.token_ids.to(device) for r in rolls], batch_first=True).clone()
    lens = torch.tensor([r.length for r in rolls], device=device)
    mask = torch.arange(tokens.shape[1], device=device) < lens[:, None]
    logprobs = pad_sequence([r.logprobs.to(device) for r in rolls], batch_first=True).float().clone()
    prompt_lens = seq_lens - lens
    return PolicyBatch(
        input_ids.clone(),
        attention_mask,
        prompt_lens,
        tokens,
        mask,
        advantages.to(device=device, dtype=torch.float32).clone(),
        logprobs,
    )


def completion_logprobs(model: nn.Module, batch: PolicyBatch, temperature: float) -> torch.Tensor:
    """``[B, T]`` log-probabilities of the completion tokens under ``model`` at ``temperature``.

    Logits are computed only at the positions that predict completion tokens (position
    ``prompt_len + t - 1`` predicts token ``t``), never for the prompt: ``[B, T, V]``, not ``[B, S, V]``.
    """
    hidden = model.get_decoder()(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
    ).last_hidden_state  # [B, S, H]
    S, T = hidden.shape[1], batch.tokens.shape[1]
    idx = (batch.prompt_lens[:, None] - 1 + torch.arange(T, device=hidden.device)).clamp(max=S - 1)
    picked = hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, T, H]
    return token_logprobs(model.get_output_embeddings()(picked), batch.tokens, temperature)
