"""GRPO math: group-normalised advantages, per-token log-probabilities, the clipped surrogate loss.

Pure and batched: tensors in, tensors / NamedTuples out, no state. The RL module
(:class:`~tlt_lightning.rl.module.GRPOModule`) strings them together; anyone writing their own RL
module can reuse them as they are.

Shapes: ``P`` prompts, ``G`` rollouts per prompt (a *group*), ``B`` sequences (``P * G``, or a
micro-batch of them), ``T`` completion tokens (right-padded), ``V`` vocabulary.

Example:
    >>> rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    >>> group_advantages(rewards, group_size=2, scale=False)
    tensor([ 0.5000, -0.5000, -0.5000,  0.5000])
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from tlt_lightning.validation import check, is_int

__all__ = ["AGGREGATIONS", "Aggregation", "GRPOLossOutput", "group_advantages", "grpo_loss", "token_logprobs"]

Aggregation = Literal["token", "sequence"]
AGGREGATIONS: tuple[str, ...] = ("token", "sequence")


def group_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, scale: bool = True
) -> torch.Tensor:
    """Each reward minus its group's mean, divided by the group's standard deviation when ``scale``.

    The rollouts of one prompt are contiguous: ``rewards[i * G : (i + 1) * G]`` is prompt ``i``'s
    group. The standard deviation is the unbiased one (``torch.std``, as in TRL and VeRL).
    ``scale=False`` is Dr. GRPO's variant (no division: it does not up-weight nearly-solved or
    nearly-failed prompts). A group whose rewards are all equal carries no signal and gets exactly
    ``0`` (not rounding noise divided by ``eps``); so does a group of one.

    Args:
        rewards: ``[P * G]`` rewards, finite.
        group_size: ``G``, rollouts per prompt.
        eps: added to the standard deviation before dividing.
        scale: divide by the group standard deviation.

    Returns:
        ``[P * G]`` float32 advantages.

    Example:
        >>> group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), group_size=2)
        tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
    """
    check(is_int(group_size) and group_size >= 1, "group_size", group_size, "an int >= 1")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [P * G], got shape {list(rewards.shape)}")
    if rewards.numel() % group_size:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite, got NaN or inf")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    r = rewards.float().view(-1, group_size)  # [P, G]
    constant = (r == r[:, :1]).all(1, keepdim=True)  # [P, 1]
    adv = r - r.mean(1, keepdim=True)
    if scale and group_size > 1:
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.masked_fill(constant, 0.0).view(-1)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, chunk_elements: int = 2**24
) -> torch.Tensor:
    """Log-probability of each token under ``softmax(logits / temperature)``.

    Computed as ``logit[token] - logsumexp(logits)`` over chunks of rows, in float32: a full
    float32 ``log_softmax`` of ``[B, T, V]`` is never built (for bf16 logits that would be a second,
    twice-as-large copy), and autograd keeps only what ``logsumexp`` needs.

    Args:
        logits: ``[B, T, V]`` logits (any float dtype), with grad or not.
        tokens: ``[B, T]`` int64 token ids (padding positions may hold any valid id).
        temperature: the sampling temperature the tokens were drawn at (``> 0``).
        chunk_elements: about how many logits are processed at once (bounds the float32 upcast).

    Returns:
        ``[B, T]`` float32 log-probabilities.

    Example:
        >>> logits = torch.log(torch.tensor([[[1.0, 3.0]]]))
        >>> token_logprobs(logits, torch.tensor([[1]])).exp()
        tensor([[0.7500]])
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] and tokens [B, T], got {list(logits.shape)} and {list(tokens.shape)}"
        )
    if not 0 < temperature < float("inf"):
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
    V = logits.shape[-1]
    flat, ids = logits.reshape(-1, V), tokens.reshape(-1, 1)
    rows = max(1, chunk_elements // V)
    out = []
    for start in range(0, flat.shape[0], rows):  # per chunk of rows, not per token
        chunk = flat[start : start + rows].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        out.append(chunk.gather(-1, ids[start : start + rows]).squeeze(-1) - chunk.logsumexp(-1))
    if not out:
        return logits.new_zeros(tokens.shape, dtype=torch.float32)
    return torch.cat(out).view(tokens.shape)


class GRPOLossOutput(NamedTuple):
    """The GRPO loss and its parts.

    Attributes:
        loss: scalar to minimise, ``pg_loss + kl_coef * kl`` (with grad).
        pg_loss: scalar clipped policy-gradient part (with grad).
        kl: scalar k3 estimate of ``KL(policy || reference)``, aggregated like the loss (``0``
            without a reference).
        clip_fraction: scalar, share of this batch's tokens where the clip was active (detached).
        ratio_mean: scalar, mean importance ratio over this batch's tokens (detached).
    """

    loss: torch.Tensor
    pg_loss: torch.Tensor
    kl: torch.Tensor
    clip_fraction: torch.Tensor
    ratio_mean: torch.Tensor


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    aggregation: Aggregation = "token",
    num_items: float | torch.Tensor | None = None,
) -> GRPOLossOutput:
    """The clipped GRPO surrogate, with an optional k3 KL penalty to a frozen reference.

    Per token, with ratio ``r = exp(logp - old_logp)`` and the sequence's advantage ``A``::

        pg = -min(r * A, clip(r, 1 - clip_eps, 1 + clip_eps_high) * A)
        kl = exp(ref - logp) - (ref - logp) - 1            # k3: unbiased, always >= 0

    Aggregation:
        ``"token"`` (DAPO): the sum over every completion token / ``num_items`` (default: the
        number of tokens), so long responses weigh in proportion to their length.
        ``"sequence"`` (original GRPO): each sequence's mean over its tokens, summed / ``num_items``
        (default: the number of sequences).

    Pass ``num_items`` when this batch is a micro-batch of a larger one: with the whole batch's
    token (or sequence) count, the micro-batch losses add up exactly to the whole batch's loss,
    so accumulating their gradients gives the big batch's gradient.

    Args:
        logprobs: ``[B, T]`` log-probabilities of the completion tokens under the policy (with grad).
        old_logprobs: ``[B, T]`` the same under the policy that sampled them (no grad).
        advantages: ``[B]`` one advantage per sequence.
        mask: ``[B, T]`` bool or 0/1, true on completion tokens (false on padding).
        clip_eps: lower clip range, ``ratio >= 1 - clip_eps``.
        clip_eps_high: upper clip range (DAPO's clip-higher); default ``clip_eps``.
        kl_coef: weight of the KL penalty; ``> 0`` needs ``ref_logprobs``.
        ref_logprobs: ``[B, T]`` log-probabilities under the frozen reference policy.
        aggregation: ``"token"`` or ``"sequence"``.
        num_items: the denominator (see above); default: this batch's own count.

    Returns:
        :class:`GRPOLossOutput`.

    Example:
        >>> lp = torch.log(torch.tensor([[1.5, 0.5]]))
        >>> out = grpo_loss(lp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2))
        >>> round(float(out.loss), 4), float(out.clip_fraction)
        (-0.85, 0.5)
    """
    _check_loss_inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs, aggregation)
    eps_high = _check_coefficients(clip_eps, clip_eps_high, kl_coef, ref_logprobs)

    m = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)[:, None]  # [B, 1]
    ratio = (logprobs - old_logprobs).exp()  # [B, T]
    clipped = ratio.clamp(1 - clip_eps, 1 + eps_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)  # [B, T]
    kl = torch.zeros_like(pg) if ref_logprobs is None else _k3_kl(logprobs, ref_logprobs)

    denom = _denominator(m, aggregation, num_items)
    pg_loss = _masked_sum(pg, m, aggregation) / denom
    kl_loss = _masked_sum(kl, m, aggregation) / denom
    loss = pg_loss + kl_coef * kl_loss if kl_coef > 0 else pg_loss
    clip_fraction, ratio_mean = _clip_stats(ratio, adv, m, clip_eps, eps_high)
    return GRPOLossOutput(loss, pg_loss, kl_loss, clip_fraction, ratio_mean)


def _k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(policy || reference)``: ``exp(d) - d - 1`` with ``d = ref - logp``.

    Unbiased and never negative. ``[B, T]`` in, ``[B, T]`` out.
    """
    d = ref_logprobs - logprobs
    return d.exp() - d - 1


def _masked_sum(values: torch.Tensor, m: torch.Tensor, aggregation: Aggregation) -> torch.Tensor:
    """``values`` ``[B, T]`` summed over the tokens where ``m`` is 1: per token (``"token"``) or as
    the sum of each sequence's mean (``"sequence"``). Scalar."""
    if aggregation == "token":
        return (values * m).sum()
    per_seq = m.sum(1).clamp(min=1)  # [B]
    return ((values * m).sum(1) / per_seq).sum()


def _denominator(
    m: torch.Tensor, aggregation: Aggregation, num_items: float | torch.Tensor | None
) -> torch.Tensor:
    """``num_items``, or this batch's token (``"token"``) or sequence count; at least 1. Scalar."""
    if num_items is not None:
        count = torch.as_tensor(num_items, dtype=m.dtype, device=m.device)
    elif aggregation == "token":
        count = m.sum()
    else:
        count = torch.tensor(float(m.shape[0]), device=m.device)
    return count.clamp(min=1)


def _clip_stats(
    ratio: torch.Tensor, adv: torch.Tensor, m: torch.Tensor, clip_eps: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(clip_fraction, ratio_mean)`` over the masked tokens, detached: the share of tokens where the
    clip was active (the clipped side is the one that bounds the objective) and the mean ratio."""
    with torch.no_grad():
        tokens = m.sum().clamp(min=1)
        is_clipped = ((ratio < 1 - clip_eps) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
        clip_fraction = (is_clipped.to(m.dtype) * m).sum() / tokens
        ratio_mean = (ratio * m).sum() / tokens
    return clip_fraction, ratio_mean


def _check_loss_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    aggregation: str,
) -> None:
    """Refuse tensors whose shapes do not match ``logprobs`` ``[B, T]`` and an unknown aggregation."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {list(logprobs.shape)}")
    shape = logprobs.shape
    for name, t in (("old_logprobs", old_logprobs), ("mask", mask), ("ref_logprobs", ref_logprobs)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} must have the shape of logprobs {list(shape)}, got {list(t.shape)}")
    if advantages.shape != shape[:1]:
        raise ValueError(f"advantages must be [B] = [{shape[0]}], got shape {list(advantages.shape)}")
    check(aggregation in AGGREGATIONS, "aggregation", aggregation, f"one of {AGGREGATIONS}")


def _check_coefficients(
    clip_eps: float, clip_eps_high: float | None, kl_coef: float, ref_logprobs: torch.Tensor | None
) -> float:
    """Refuse clip ranges and KL weights out of range; returns the upper clip range."""
    if not 0 <= clip_eps < 1:
        raise ValueError(f"clip_eps must be in [0, 1), got {clip_eps!r}")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if not eps_high >= 0:
        raise ValueError(f"clip_eps_high must be >= 0 or None, got {clip_eps_high!r}")
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef!r}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the frozen reference's log-probabilities)")
    return eps_high
