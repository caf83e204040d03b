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
    A *sampled* tree (``sampled=True``) forks at its first ``fork_depth`` levels: there every node
    gets ``topk`` children drawn without replacement from the drafter, deeper every node gets one
    sampled child, so the tree is ``topk ** fork_depth`` sampled chains of ``num_steps`` tokens
    sharing their first ones; all its nodes are verified with recursive rejection sampling. When a
    draft is rejected, its next sibling gets a chance against what remains of the target's
    distribution, at the price of more verified tokens (cheap at small batch). With
    ``fork_depth=1`` it is ``topk`` chains forking at the root.

    Args:
        num_steps: draft depth (drafter forward passes per step), ``>= 1``.
        topk: children expanded per node (per root with ``sampled``), ``>= 1``.
        num_draft_tokens: drafted tokens verified in one target forward, between ``num_steps``
            and ``topk * num_steps``; for a chain it must equal ``num_steps``; for a sampled tree
            it is its node count ``sum(level_widths)`` (default and only value).
        sampled: a sampled tree (``topk >= 2``).
        min_confidence: chains only: stop drafting early once every row's chain confidence (the
            product of the drafter's probabilities of its drafted tokens, under the rollout's
            sampling; with a greedy target its top-1 probabilities) is below this; ``num_steps``
            is then the most drafted. ``0`` always drafts ``num_steps``. Lossless at any value: the
            stop depends on the drafts only, and every verified draft is verified exactly.
        fork_depth: sampled trees only: how many levels fork into ``topk`` children, in
            ``[1, num_steps]``.

    Example:
        >>> SDStrategy(4, 1, 4).is_chain
        True
        >>> str(SDStrategy(6, 2, sampled=True))
        'chain6x2'
        >>> arm = SDStrategy(6, 2, sampled=True, fork_depth=2)
        >>> str(arm), arm.level_widths, arm.num_draft_tokens
        ('chain6x2f2', (2, 4, 4, 4, 4, 4), 22)
        >>> str(SDStrategy(10, min_confidence=0.25))
        'chain10@0.25'
    """

    num_steps: int
    topk: int = 1
    num_draft_tokens: int | None = None
    sampled: bool = False
    min_confidence: float = 0.0
    fork_depth: int = 1

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
        f = self.fork_depth
        if isinstance(f, bool) or not isinstance(f, int) or not 1 <= f <= self.num_steps:
            raise ValueError(f"fork_depth must be an int in [1, num_steps] = [1, {self.num_steps}], got {f!r}")
        if f > 1 and not self.sampled:
            raise ValueError(f"fork_depth={f} describes sampled trees; pass sampled=True (or fork_depth=1)")
        if self.num_draft_tokens is None:
            wide = sum(self.level_widths) if self.sampled else 2 * self.num_steps
            object.__setattr__(self, "num_draft_tokens", self.num_steps if self.topk == 1 else wide)
        c = self.min_confidence
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < 1:
            raise ValueError(f"min_confidence must be a number in [0, 1), got {c!r}")
        if c and not self.is_chain:
            raise ValueError(f"min_confidence stops chains early; a tree (topk={self.topk}) needs min_confidence=0")
        n, lo, hi = self.num_draft_tokens, self.num_steps, self.topk * self.num_steps
        if self.sampled:
            if n != sum(self.level_widths):
                raise ValueError(
                    f"a sampled tree verifies all its {sum(self.level_widths)} nodes, got num_draft_tokens={n}"
                )
        elif not isinstance(n, int) or not lo <= n <= hi:
            raise ValueError(f"num_draft_tokens must be an int in [num_steps, topk * num_steps] = [{lo}, {hi}], got {n!r}")

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def level_widths(self) -> tuple[int, ...]:
        """Sampled trees: nodes per level, ``topk ** min(d + 1, fork_depth)`` at level ``d``."""
        return tuple(self.topk ** min(d + 1, self.fork_depth) for d in range(self.num_steps))

    def __str__(self) -> str:
        if self.sampled:
            fork = f"f{self.fork_depth}" if self.fork_depth > 1 else ""
            return f"chain{self.num_steps}x{self.topk}{fork}"
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
