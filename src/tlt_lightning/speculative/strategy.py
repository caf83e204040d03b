"""SDStrategy: one speculative-decoding configuration, and the protocol of whatever chooses it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["SDStrategy", "StrategyChooser"]


@dataclass(frozen=True, order=True)
class SDStrategy:
    """How one speculative step drafts and verifies.

    A chain is the special case ``topk == 1``: ``num_steps`` drafted tokens, all verified
    (``num_draft_tokens == num_steps``). A tree expands the ``topk`` most likely children of the
    best nodes for ``num_steps`` levels and verifies the ``num_draft_tokens`` best nodes (EAGLE-2;
    its children are deterministic, which at temperature 1 accepts less than a sampled chain).
    A *sampled* tree (``sampled=True``) is ``topk`` chains of ``num_steps`` tokens that fork at the
    root: the first tokens are ``topk`` draws without replacement from the drafter, each followed
    by a sampled chain, all ``topk * num_steps`` tokens verified with recursive rejection sampling.
    When the first draft is rejected, the second gets a chance against what remains of the
    target's distribution, at the price of more verified tokens (cheap at small batch).

    Args:
        num_steps: draft depth (drafter forward passes per step), ``>= 1``.
        topk: children expanded per node (per root with ``sampled``), ``>= 1``.
        num_draft_tokens: drafted tokens verified in one target forward, between ``num_steps``
            and ``topk * num_steps``; for a chain it must equal ``num_steps``, for a sampled tree
            ``topk * num_steps``.
        sampled: ``topk`` sampled chains forking at the root (``topk >= 2``).
        min_confidence: chains only: stop drafting early once every row's chain confidence (the
            product of the drafter's probabilities of its drafted tokens, under the rollout's
            sampling; with a greedy target its top-1 probabilities) is below this; ``num_steps``
            is then the most drafted. ``0`` always drafts ``num_steps``. Lossless at any value: the
            stop depends on the drafts only, and every verified draft is verified exactly.

    Example:
        >>> SDStrategy(4, 1, 4).is_chain
        True
        >>> str(SDStrategy(6, 2, sampled=True))
        'chain6x2'
        >>> str(SDStrategy(10, min_confidence=0.25))
        'chain10@0.25'
    """

    num_steps: int
    topk: int = 1
    num_draft_tokens: int | None = None
    sampled: bool = False
    min_confidence: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1, got {self.num_steps!r}")
        if not isinstance(self.topk, int) or self.topk < 1:
            raise ValueError(f"topk must be an int >= 1, got {self.topk!r}")
        if not isinstance(self.sampled, bool):
            raise TypeError(f"sampled must be a bool, got {self.sampled!r}")
        if self.sampled and self.topk < 2:
            raise ValueError(
                f"a sampled tree forks into topk >= 2 chains, got topk={self.topk} (use a chain)"
            )
        if self.num_draft_tokens is None:
            wide = self.topk * self.num_steps if self.sampled else 2 * self.num_steps
            object.__setattr__(self, "num_draft_tokens", self.num_steps if self.topk == 1 else wide)
        c = self.min_confidence
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < 1:
            raise ValueError(f"min_confidence must be a number in [0, 1), got {c!r}")
        if c and not self.is_chain:
            raise ValueError(f"min_confidence stops chains early; a tree (topk={self.topk}) needs min_confidence=0")
        n, lo, hi = self.num_draft_tokens, self.num_steps, self.topk * self.num_steps
        if not isinstance(n, int) or not lo <= n <= hi:
            raise ValueError(f"num_draft_tokens must be an int in [num_steps, topk * num_steps] = [{lo}, {hi}], got {n!r}")
        if self.sampled and n != hi:
            raise ValueError(
                f"a sampled tree verifies all topk * num_steps = {hi} tokens, got num_draft_tokens={n}"
            )

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    def __str__(self) -> str:
        if self.sampled:
            return f"chain{self.num_steps}x{self.topk}"
        if self.min_confidence:
            return f"chain{self.num_steps}@{self.min_confidence:g}"
        return f"chain{self.num_steps}" if self.is_chain else f"tree{self.num_steps}x{self.topk}/{self.num_draft_tokens}"


@runtime_checkable
class StrategyChooser(Protocol):
    """Picks the strategy for each decode step from the active batch size; learns from the outcome.

    ``select`` returns an :class:`SDStrategy` or ``None`` (plain decoding for this step). ``update``
    reports what the step achieved: ``accepted_tokens`` is the mean number of tokens each request
    emitted, ``step_time`` the step's seconds.
    """

    def select(self, batch_size: int) -> SDStrategy | None: ...

    def update(self, batch_size: int, arm: SDStrategy | None, accepted_tokens: float, step_time: float) -> None: ...
