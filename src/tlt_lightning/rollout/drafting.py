"""The drafter as rollout code sees it: the :class:`DraftModel` protocol, and the law drafts are drawn from.

Speculative rollouts (:class:`~tlt_lightning.rollout.SpeculativeRolloutLoop`,
:class:`~tlt_lightning.rollout.SpeculativeStep` and its tree drafts) take any object with the methods of
:class:`DraftModel`; :class:`~tlt_lightning.drafter.Drafter` implements it (structurally: it does not
import this module's names).

Glossary: the *draft vocabulary* (``V_draft`` ids) is what the drafter proposes from, a subset of the
target's ``V`` tokens (all of them unless the drafter's vocabulary is reduced); ``H`` is the hidden size
the drafter works at.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from tlt_lightning.models.kv_cache import KVCache
from tlt_lightning.speculative import SamplingParams, sampling_probs

__all__ = ["DraftModel", "DraftModelConfig", "draft_probs"]


class DraftModelConfig(Protocol):
    """What rollout code reads of a drafter's config."""

    @property
    def feature_layers(self) -> Sequence[int]:
        """The target hidden-state indices the drafter reads (``0``: embeddings, ``L``: final state);
        a rollout's ``feature_layers`` start with them."""
        ...


@runtime_checkable
class DraftModel(Protocol):
    """What speculative rollouts call on a drafter (EAGLE-style: it reads the target's features).

    The drafter keeps a KV cache of its own, one entry per position: pair ``(f_p, x_{p+1})`` (the target's
    features at ``p`` and the token after) at position ``p``.

    Attributes:
        config: its settings; rollouts read ``config.feature_layers``.
        weight_layout: how its linear weights are laid out (:mod:`tlt_lightning.models.layout`); a drafter
            of a target in the ``"packed"`` layout is moved from ``"out_in"`` to ``"packed"`` too.

    Example:
        >>> from tlt_lightning.drafter import Drafter, DrafterConfig
        >>> from tlt_lightning.models import HFTarget, load_model
        >>> target = HFTarget(load_model("tiny-llama").model)
        >>> isinstance(Drafter(DrafterConfig.from_target(target), target), DraftModel)
        True
    """

    @property
    def config(self) -> DraftModelConfig: ...

    weight_layout: str

    def set_weight_layout(self, layout: str) -> int:
        """Lay the linear weights out as ``layout``; returns how many linears changed."""
        ...

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        """Its own empty cache for ``max_batch`` rows of ``max_len`` positions."""
        ...

    def lift(self, features: torch.Tensor) -> torch.Tensor:
        """``[n, q, C, H]`` target features (``C = len(config.feature_layers)``) -> ``[n, q, H]`` its
        input."""
        ...

    def __call__(
        self,
        tokens: torch.Tensor,
        hidden_in: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One cached pass: ``[n, q]`` tokens, ``[n, q, H]`` inputs (:meth:`lift`, or its own outputs),
        ``[n, q]`` positions, ``[n, 1, q, kv_len]`` bool mask, ``[n, q]`` cache slots where they differ
        from ``positions`` (tree siblings) -> ``[n, q, H]`` outputs (the next pass's ``hidden_in``)."""
        ...

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` outputs -> ``[..., V_draft]`` logits on the draft vocabulary."""
        ...

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """``[...]`` draft-vocabulary ids -> the target's token ids."""
        ...

    def to_target_vocab(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``[..., V_draft]`` values -> ``[..., V]``, ``fill`` at the tokens outside the draft vocabulary."""
        ...


def draft_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """``[..., V_draft]`` drafter logits -> ``[..., V_draft]`` the distribution drafts are sampled from.

    It lives on the draft vocabulary: the target's other tokens have probability 0, so the sampling
    transforms (temperature, top-k, top-p) give the same distribution as on the full one, for a fraction
    of the cost; the verifier gets it scattered into the target's by ``to_target_vocab``.

    Example:
        >>> draft_probs(torch.tensor([[0.0, 2.0, 1.0]]), SamplingParams(temperature=0.0)).tolist()
        [[0.0, 1.0, 0.0]]
    """
    return sampling_probs(logits.float(), sampling)
