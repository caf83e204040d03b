"""Drafter training losses: pure, batched functions of tensors, and their weighted combination.

Masks are ``[N]`` bool (or 0/1 float) over samples; every mean is over the masked samples only
(``0`` when the mask is empty), so padded and out-of-range positions never contribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "DrafterLoss",
    "LossOutput",
    "acceptance_rate",
    "draft_vocab_mass",
    "feature_loss",
    "soft_ce",
    "top1_agreement",
]


def _masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``[N]`` values over ``mask`` (all when ``None``)."""
    if mask is None:
        return values.mean()
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1)


def feature_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Smooth-L1 (Huber, beta 1) between predicted and true features, as EAGLE.

    Args:
        pred: ``[N, H]`` predicted features.
        target: ``[N, H]`` true features.
        mask: ``[N]`` samples that count.

    Returns:
        Scalar: per-sample mean over ``H``, then mean over masked samples.

    Example:
        >>> feature_loss(torch.tensor([[0.0, 3.0]]), torch.tensor([[0.5, 0.0]]))
        tensor(1.3125)
    """
    per_sample = F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1)
    return _masked_mean(per_sample, mask)


def _restrict(target_logits: torch.Tensor, t2d: torch.Tensor | None) -> torch.Tensor:
    return target_logits if t2d is None else target_logits[..., t2d]


def _target_probs(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, t2d: torch.Tensor | None
) -> torch.Tensor:
    """The target's distribution on the draft vocabulary (renormalised), ``[N, V_draft]``."""
    target_p = _restrict(target_logits.float(), t2d).softmax(-1)
    if target_p.shape != draft_logits.shape:
        raise ValueError(
            f"draft logits {list(draft_logits.shape)} do not match the (restricted) target logits "
            f"{list(target_p.shape)}"
        )
    return target_p


def soft_ce(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    t2d: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of the drafter against the target's next-token distribution.

    With a reduced draft vocabulary the target distribution is restricted to the draft vocabulary
    and renormalised (a softmax over the target's logits of the draft tokens), as EAGLE-3 does:
    the drafter can only propose draft tokens, and this makes the loss 0 exactly when the drafter
    matches the target's conditional distribution on them. The mass the target puts outside the
    draft vocabulary is lost to speculation whatever the drafter does, so it is left out.

    Args:
        draft_logits: ``[N, V_draft]`` drafter logits (draft ids in ascending target-id order).
        target_logits: ``[N, V]`` target logits.
        mask: ``[N]`` samples that count.
        t2d: ``[V]`` bool, True for target ids in the draft vocabulary; ``None`` = full vocabulary.

    Returns:
        Scalar ``-sum_v p_target(v) log p_draft(v)`` averaged over masked samples.
    """
    target_p = _target_probs(draft_logits, target_logits, t2d)
    per_sample = -(target_p * draft_logits.float().log_softmax(-1)).sum(-1)
    return _masked_mean(per_sample, mask)


def acceptance_rate(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    t2d: torch.Tensor | None = None,
    vocab_mass: torch.Tensor | None = None,
) -> torch.Tensor:
    """Probability that a draft sampled from the drafter at temperature 1 is accepted.

    Speculative sampling accepts a draft ``x ~ q`` with probability ``min(1, p(x) / q(x))``, so a
    draft is accepted with probability ``sum_v min(p(v), q(v)) = 1 - TV(p, q)``: the quantity that
    sets the accept length when sampling, where top-1 agreement only sets it greedily. ``p`` is
    the target's distribution renormalised on the draft vocabulary, as in :func:`soft_ce` (the
    mass outside it is lost whatever the drafter does), unless ``vocab_mass`` gives that mass: then
    ``p`` is the target's own distribution and the result is exactly what speculative sampling
    accepts (:func:`draft_vocab_mass`). Differentiable: ``1 -`` this is the
    total-variation objective of :class:`DrafterLoss` (``accept_weight``), which trains for
    acceptance directly (DistillSpec's argument), where cross-entropy fits the target's whole
    distribution, tail included.

    Args:
        draft_logits: ``[N, V_draft]`` drafter logits.
        target_logits: ``[N, V]`` target logits.
        mask: ``[N]`` samples that count.
        t2d: ``[V]`` bool, True for target ids in the draft vocabulary; ``None`` = full vocabulary.
        vocab_mass: ``[N]`` the target's probability mass on the draft vocabulary; ``None`` = 1
            (renormalised, the training objective).

    Returns:
        Scalar in ``[0, 1]``, averaged over masked samples.

    Example:
        >>> acceptance_rate(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 100.0]]))
        tensor(0.5000)
    """
    target_p = _target_probs(draft_logits, target_logits, t2d)
    if vocab_mass is not None:
        target_p = target_p * vocab_mass.to(target_p.dtype)[:, None]
    per_sample = torch.minimum(target_p, draft_logits.float().softmax(-1)).sum(-1)
    return _masked_mean(per_sample, mask)


def draft_vocab_mass(target_logits: torch.Tensor, t2d: torch.Tensor | None) -> torch.Tensor:
    """``[N, V]`` target logits (full vocabulary) -> ``[N]`` the target's probability on the draft vocabulary.

    A draft is never a token outside the draft vocabulary, so speculative sampling rejects this
    much more than the renormalised :func:`acceptance_rate` says (``1 - mass`` at most).

    Example:
        >>> draft_vocab_mass(torch.zeros(1, 4), torch.tensor([True, True, True, False]))
        tensor([0.7500])
    """
    if t2d is None:
        return target_logits.new_ones(target_logits.shape[:-1], dtype=torch.float32)
    logits = target_logits.float()
    return (logits[..., t2d].logsumexp(-1) - logits.logsumexp(-1)).exp()


def top1_agreement(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    d2t: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fraction of samples where the drafter's argmax is the target's argmax (full vocabulary).

    A target argmax outside the draft vocabulary counts as a disagreement, which is what greedy
    speculative decoding would see.

    Args:
        draft_logits: ``[N, V_draft]``.
        target_logits: ``[N, V]``.
        mask: ``[N]`` samples that count.
        d2t: ``[V_draft]`` int64 offsets (target id = draft id + ``d2t[draft id]``); ``None`` = identity.
    """
    draft = draft_logits.argmax(-1)
    if d2t is not None:
        draft = draft + d2t[draft]
    hits = (draft == target_logits.argmax(-1)).float()
    return _masked_mean(hits, mask)


class LossOutput(NamedTuple):
    """``loss`` carries the gradient; the others are detached scalars for logging."""

    loss: torch.Tensor
    feature_loss: torch.Tensor
    ce_loss: torch.Tensor
    top1: torch.Tensor
    accept: torch.Tensor


@dataclass(frozen=True)
class DrafterLoss:
    """Weights of the drafter objective
    ``feature_weight * smooth_l1 + ce_weight * soft_ce + accept_weight * (1 - acceptance_rate)``.

    EAGLE-1 uses 1.0 / 0.1 (the defaults); EAGLE-3 drops the feature loss (its output is not a
    target feature): use :meth:`for_kind`. The total-variation term (``accept_weight``, off by
    default) trains for what sampled speculation accepts (see :func:`acceptance_rate`).

    Args:
        feature_weight: weight of :func:`feature_loss` (``>= 0``).
        ce_weight: weight of :func:`soft_ce` (``>= 0``).
        accept_weight: weight of ``1 - acceptance_rate`` (``>= 0``), the total-variation distance
            between the drafter and the target.
        unroll_steps: draft steps trained per sample; step ``k > 1`` feeds the drafter its own
            previous output instead of the target's feature, as at decode time.
        step_decay: weight of step ``k`` is ``step_decay ** (k - 1)`` (EAGLE-3 uses 0.8).

    Example:
        >>> DrafterLoss.for_kind("eagle3").feature_weight
        0.0
    """

    feature_weight: float = 1.0
    ce_weight: float = 0.1
    unroll_steps: int = 1
    step_decay: float = 0.8
    accept_weight: float = 0.0

    def __post_init__(self) -> None:
        for name in ("feature_weight", "ce_weight", "accept_weight"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.feature_weight == 0 and self.ce_weight == 0 and self.accept_weight == 0:
            raise ValueError("feature_weight, ce_weight and accept_weight are all 0: nothing to train")
        if (
            isinstance(self.unroll_steps, bool)
            or not isinstance(self.unroll_steps, int)
            or self.unroll_steps < 1
        ):
            raise ValueError(f"unroll_steps must be an int >= 1, got {self.unroll_steps!r}")
        if not isinstance(self.step_decay, (int, float)) or not 0 < self.step_decay <= 1:
            raise ValueError(f"step_decay must be in (0, 1], got {self.step_decay!r}")

    @classmethod
    def for_kind(cls, kind: str, unroll_steps: int = 1, accept_weight: float = 0.0) -> DrafterLoss:
        """EAGLE's weights for ``kind``: eagle1 1.0 feature + 0.1 CE; eagle3 CE only."""
        if kind == "eagle1":
            return cls(1.0, 0.1, unroll_steps, accept_weight=accept_weight)
        if kind == "eagle3":
            return cls(0.0, 1.0, unroll_steps, accept_weight=accept_weight)
        raise ValueError(f"kind must be 'eagle1' or 'eagle3', got {kind!r}")

    def __call__(
        self,
        pred_hidden: torch.Tensor,
        draft_logits: torch.Tensor,
        target_hidden: torch.Tensor,
        target_logits: torch.Tensor,
        mask: torch.Tensor | None = None,
        d2t: torch.Tensor | None = None,
        t2d: torch.Tensor | None = None,
        vocab_mass: torch.Tensor | None = None,
    ) -> LossOutput:
        """One step's loss over ``N`` samples (``[N, H]`` hidden, ``[N, V_draft]`` / ``[N, V]`` logits).

        ``vocab_mass`` (``[N]``, see :func:`acceptance_rate`) makes ``accept`` what speculative
        sampling accepts; the total-variation term then trains for that too.
        """
        ce = soft_ce(draft_logits, target_logits, mask, t2d)
        feat = feature_loss(pred_hidden, target_hidden, mask) if self.feature_weight > 0 else ce.new_zeros(())
        # A metric only, unless it is trained on: no graph for it then.
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.accept_weight > 0):
            accept = acceptance_rate(draft_logits, target_logits, mask, t2d, vocab_mass)
        loss = self.feature_weight * feat + self.ce_weight * ce + self.accept_weight * (1 - accept)
        with torch.no_grad():
            top1 = top1_agreement(draft_logits, target_logits, mask, d2t)
        return LossOutput(loss, feat.detach(), ce.detach(), top1, accept.detach())
