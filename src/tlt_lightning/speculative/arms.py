"""Arms and strategies: what one decode step runs, its name, and what picks it.

An *arm* is a :class:`DraftSpec` (one speculative-decoding configuration) or ``None`` (plain
decoding); a *strategy* (:class:`DraftStrategy`) picks the arm of each decode step. A Lightning
``Strategy`` (ddp, fsdp) is something else.

An arm's name (``"off"`` for plain decoding) is the
one format everything writes and reads (bandit state, benchmark JSON, ``--arms`` flags):
:func:`arm_key` writes it, :func:`parse_arm` reads it back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

__all__ = ["Arm", "DraftSpec", "DraftStrategy", "arm_key", "as_strategy", "parse_arm"]


@dataclass(frozen=True, order=True)
class DraftSpec:
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
        >>> DraftSpec(4, 1, 4).is_chain
        True
        >>> str(DraftSpec(6, 2, sampled=True))
        'chain6x2'
        >>> arm = DraftSpec(6, 2, sampled=True, fork_depth=2)
        >>> str(arm), arm.level_widths, arm.num_draft_tokens
        ('chain6x2f2', (2, 4, 4, 4, 4, 4), 22)
        >>> str(DraftSpec(10, min_confidence=0.25))
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
            raise ValueError(
                f"fork_depth must be an int in [1, num_steps] = [1, {self.num_steps}], got {f!r}"
            )
        if f > 1 and not self.sampled:
            raise ValueError(f"fork_depth={f} describes sampled trees; pass sampled=True (or fork_depth=1)")
        if self.num_draft_tokens is None:
            wide = sum(self.level_widths) if self.sampled else 2 * self.num_steps
            object.__setattr__(self, "num_draft_tokens", self.num_steps if self.topk == 1 else wide)
        c = self.min_confidence
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < 1:
            raise ValueError(f"min_confidence must be a number in [0, 1), got {c!r}")
        if c and not self.is_chain:
            raise ValueError(
                f"min_confidence stops chains early; a tree (topk={self.topk}) needs min_confidence=0"
            )
        n, lo, hi = self.num_draft_tokens, self.num_steps, self.topk * self.num_steps
        if self.sampled:
            if n != sum(self.level_widths):
                raise ValueError(
                    f"a sampled tree verifies all its {sum(self.level_widths)} nodes, "
                    f"got num_draft_tokens={n}"
                )
        elif not isinstance(n, int) or not lo <= n <= hi:
            raise ValueError(
                f"num_draft_tokens must be an int in [num_steps, topk * num_steps] = [{lo}, {hi}], got {n!r}"
            )

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def level_widths(self) -> tuple[int, ...]:
        """Sampled trees: nodes per level, ``topk ** min(d + 1, fork_depth)`` at level ``d``."""
        return tuple(self.topk ** min(d + 1, self.fork_depth) for d in range(self.num_steps))

    def __str__(self) -> str:
        """The arm name :func:`parse_arm` reads back (``parse_arm(str(s)) == s``)."""
        if self.sampled:
            fork = f"f{self.fork_depth}" if self.fork_depth > 1 else ""
            return f"chain{self.num_steps}x{self.topk}{fork}"
        if self.min_confidence:
            return f"chain{self.num_steps}@{self.min_confidence:g}"
        return (
            f"chain{self.num_steps}"
            if self.is_chain
            else f"tree{self.num_steps}x{self.topk}/{self.num_draft_tokens}"
        )


Arm: TypeAlias = DraftSpec | None
"""What a strategy picks for one decode step: a speculative configuration, or ``None`` for plain decoding."""

_ARM_NAME = re.compile(r"off|chain(\d+)(?:x(\d+)(?:f(\d+))?|@(\d*\.?\d+))?|tree(\d+)x(\d+)/(\d+)")


def arm_key(arm: Arm) -> str:
    """A short unique name for an arm: ``"off"``, ``"chain4"``, ``"tree5x4/15"`` (see
    :meth:`DraftSpec.__str__`)."""
    return "off" if arm is None else str(arm)


def parse_arm(key: str) -> Arm:
    """The arm an :func:`arm_key` names: ``"off"`` -> ``None``, ``"chain6"``, ``"tree4x2/8"``,
    ``"chain6x2"`` (a sampled tree: two chains of 6 forking at the root), ``"chain6x2f2"`` (a
    sampled tree forking into two at its first two levels: four chains of 6) and ``"chain10@0.25"``
    (a chain of up to 10 that stops once its confidence is below 0.25).

    Example:
        >>> parse_arm("tree4x2/8")
        DraftSpec(num_steps=4, topk=2, num_draft_tokens=8, sampled=False, min_confidence=0.0, fork_depth=1)
        >>> parse_arm(arm_key(None)) is None
        True
    """
    match = _ARM_NAME.fullmatch(key.strip())
    if match is None:
        raise ValueError(
            f"arm {key!r} is not 'off', 'chain<depth>', 'chain<depth>x<branches>[f<fork levels>]', "
            "'chain<depth>@<min confidence>' or 'tree<depth>x<topk>/<tokens>'"
        )
    chain, chains, forks, confidence, depth, topk, tokens = match.groups()
    if chain is not None:
        if chains is not None:
            return DraftSpec(int(chain), int(chains), sampled=True, fork_depth=int(forks or 1))
        return DraftSpec(int(chain), min_confidence=float(confidence or 0))
    return None if depth is None else DraftSpec(int(depth), int(topk), int(tokens))


@runtime_checkable
class DraftStrategy(Protocol):
    """Picks the arm of each decode step from the active batch size; learns from the outcome.

    ``select`` returns a :class:`DraftSpec` or ``None`` (plain decoding for this step). ``update``
    reports what the step achieved: ``accepted_tokens`` is the mean number of tokens each request
    emitted, ``step_time`` the step's seconds.
    """

    def select(self, batch_size: int) -> DraftSpec | None: ...

    def update(
        self, batch_size: int, arm: DraftSpec | None, accepted_tokens: float, step_time: float
    ) -> None: ...


class _Always:
    """The :class:`DraftStrategy` that always picks ``arm`` and learns nothing."""

    def __init__(self, arm: Arm) -> None:
        self.arm = arm

    def select(self, batch_size: int) -> Arm:
        return self.arm

    def update(self, batch_size: int, arm: Arm, accepted_tokens: float, step_time: float) -> None:
        pass

    def __repr__(self) -> str:
        return f"always {arm_key(self.arm)}"


def as_strategy(strategy: DraftStrategy | DraftSpec | None) -> DraftStrategy:
    """``strategy`` itself, or for an arm (a :class:`DraftSpec`, or ``None`` = plain decoding) the
    strategy that always picks it.

    Example:
        >>> as_strategy(DraftSpec(4)).select(batch_size=8)
        DraftSpec(num_steps=4, topk=1, num_draft_tokens=4, sampled=False, min_confidence=0.0, fork_depth=1)
        >>> as_strategy(None).select(batch_size=1) is None
        True
    """
    if strategy is None or isinstance(strategy, DraftSpec):
        return _Always(strategy)
    if not isinstance(strategy, DraftStrategy):
        raise TypeError(
            "strategy must be a DraftSpec, None (plain decoding) or a DraftStrategy "
            "(with select and update), "
            f"got {type(strategy).__name__}"
        )
    return strategy
