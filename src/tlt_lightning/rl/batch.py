"""Rollouts as training data: prompt + completion sequences padded for one policy forward.

:func:`policy_batch` pads a :class:`~tlt_lightning.rollout.RolloutResult` into a
:class:`PolicyBatch`; :func:`completion_logprobs` runs a causal LM over it and returns the
log-probabilities of the completion tokens only, computing logits just where they are needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from tlt_lightning.rl.grpo import token_logprobs
from tlt_lightning.rollout import RolloutResult

__all__ = ["PolicyBatch", "completion_logprobs", "head_logprobs", "micro_batches", "policy_batch", "round_up"]


def round_up(n: int | torch.Tensor, multiple: int) -> int | torch.Tensor:
    """``n`` (an int or an int64 tensor) rounded up to a multiple of ``multiple``.

    Example:
        >>> round_up(33, 32), round_up(torch.tensor([1, 64]), 32).tolist()
        (64, [32, 64])
    """
    return -(-n // multiple) * multiple


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

    def select(self, rows: torch.Tensor, multiple: int = 1) -> PolicyBatch:
        """The sequences ``rows`` (``[b]`` int64), padding trimmed to their own longest, rounded up to a
        ``multiple`` of tokens (fewer distinct shapes for the kernels, which are built per shape)."""
        lens = self.attention_mask[rows].sum(1)
        S, T = round_up(int(lens.max()), multiple), int(self.mask[rows].sum(1).max())
        extra = (0, max(0, S - self.input_ids.shape[1]))  # right padding past the batch's own width
        return PolicyBatch(
            F.pad(self.input_ids[rows, :S], extra),
            F.pad(self.attention_mask[rows, :S], extra),
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


def micro_batches(
    seq_lens: torch.Tensor, max_rows: int | None = None, max_tokens: int | None = None
) -> list[torch.Tensor]:
    """The rows of each forward/backward of an optimizer step (gradient accumulation).

    Without ``max_tokens``: runs of ``max_rows`` consecutive rows (``None``: all in one). With it
    (verl's dynamic batch size): the rows longest first, each micro-batch filled while its rows
    times its longest stay within ``max_tokens`` padded tokens (and within ``max_rows`` rows); a
    row longer than the budget goes alone. Rows of like length train together, so little of a
    forward is padding, and one forward's activations are bounded whatever the lengths.

    Args:
        seq_lens: ``[N]`` int64 sequence lengths (prompt + completion).
        max_rows: at most this many rows per micro-batch; ``None``: no bound.
        max_tokens: at most this many padded tokens (rows x longest) per micro-batch.

    Returns:
        ``[b]`` int64 indices into ``seq_lens`` per micro-batch, every row in exactly one.

    Example:
        >>> [m.tolist() for m in micro_batches(torch.tensor([10, 50, 20, 40]), max_rows=2)]
        [[0, 1], [2, 3]]
        >>> [m.tolist() for m in micro_batches(torch.tensor([10, 50, 20, 40]), max_tokens=80)]
        [[1], [3, 2], [0]]
    """
    N = seq_lens.shape[0]
    if max_tokens is None:
        return list(torch.arange(N, device=seq_lens.device).split(max_rows or max(N, 1)))
    order = torch.sort(seq_lens, descending=True, stable=True).indices
    lens, chunks, start = seq_lens[order].tolist(), [], 0
    while start < N:
        rows = max(1, min(max_tokens // max(lens[start], 1), max_rows or N, N - start))
        chunks.append(order[start : start + rows])
        start += rows
    return chunks


def completion_logprobs(model: nn.Module, batch: PolicyBatch, temperature: float) -> torch.Tensor:
    """``[B, T]`` log-probabilities of the completion tokens under ``model`` at ``temperature``.

    The LM head runs only where a completion token is predicted (:func:`head_logprobs`).
    """
    hidden = model.get_decoder()(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
    ).last_hidden_state  # [B, S, H]
    return head_logprobs(hidden, batch, model.get_output_embeddings(), temperature)


def head_logprobs(
    hidden: torch.Tensor, batch: PolicyBatch, head: Callable[[torch.Tensor], torch.Tensor], temperature: float
) -> torch.Tensor:
    """``[B, T]`` log-probabilities of the completion tokens from a causal LM's last hidden states.

    Position ``prompt_len + t - 1`` predicts completion token ``t``: ``head`` runs on the ``N`` positions
    that predict a real completion token only, ``[N, V]`` logits, never ``[B, S, V]`` over the prompts
    nor ``[B, T, V]`` over the padding (in a long-tail batch most of it).

    Args:
        hidden: ``[B, S, H]`` hidden states over ``batch.input_ids``, the head's input.
        batch: the padded sequences.
        head: ``[N, H] -> [N, V]`` logits (the LM head; with a final norm where the model has it there).
        temperature: the sampling temperature (logits are divided by it).

    Returns:
        ``[B, T]`` float32, 0 at padding.
    """
    rows, t = batch.mask.nonzero(as_tuple=True)  # [N] each
    picked = hidden[rows, batch.prompt_lens[rows] - 1 + t]  # [N, H]
    logprobs = token_logprobs(head(picked)[None], batch.tokens[rows, t][None], temperature)[0]  # [N]
    zeros = torch.zeros(batch.mask.shape, dtype=logprobs.dtype, device=logprobs.device)
    return zeros.index_put((rows, t), logprobs)
