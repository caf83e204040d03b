"""What a :class:`~tlt_lightning.rl.GRPOModule` tells about each training step: its rollout listeners.

One training step calls, on every listener in the order added
(:meth:`~tlt_lightning.rl.GRPOModule.add_rollout_listener`):

1. ``begin_step(module)`` before anything else (e.g. hand the module this step's drafter),
2. ``before_rollout()`` right before the step's rollout starts,
3. ``after_rollout(result)`` right after it ended,
4. ``end_step(module, result)`` after the policy update.

Other rollouts (evaluation, a probe calling :meth:`~tlt_lightning.rl.GRPOModule.rollout`) are not
heard. :class:`~tlt_lightning.callbacks.SpotDrafterCallback` drives its
:class:`~tlt_lightning.spot.SpotDrafter` this way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tlt_lightning.rollout.types import RolloutResult

if TYPE_CHECKING:
    from tlt_lightning.rl.module import GRPOModule

__all__ = ["RolloutListener", "RolloutListeners"]


class RolloutListener:
    """Told about every training step's rollout; subclass it and override what you need (each method
    does nothing by default).

    Example:
        >>> class CountTokens(RolloutListener):
        ...     tokens = 0
        ...
        ...     def after_rollout(self, result):
        ...         self.tokens += sum(r.length for r in result.rollouts)
        >>> # module.add_rollout_listener(CountTokens())
    """

    def begin_step(self, module: GRPOModule) -> None:
        """A training step starts (``module.global_step`` is its step); its rollout comes next."""

    def before_rollout(self) -> None:
        """The step's rollout starts."""

    def after_rollout(self, result: RolloutResult) -> None:
        """The step's rollout ended with ``result``."""

    def end_step(self, module: GRPOModule, result: RolloutResult) -> None:
        """The step's policy update is done (``result``: its rollout)."""


class RolloutListeners(RolloutListener):
    """Several listeners as one: each event goes to every listener, in the order added."""

    def __init__(self) -> None:
        self.listeners: list[RolloutListener] = []

    def add(self, listener: RolloutListener) -> None:
        """Tell ``listener`` too, after those added before it."""
        self.listeners.append(listener)

    def remove(self, listener: RolloutListener) -> None:
        """Stop telling ``listener``; one that was not added is ignored."""
        self.listeners = [x for x in self.listeners if x is not listener]

    def begin_step(self, module: GRPOModule) -> None:
        for listener in self.listeners:
            listener.begin_step(module)

    def before_rollout(self) -> None:
        for listener in self.listeners:
            listener.before_rollout()

    def after_rollout(self, result: RolloutResult) -> None:
        for listener in self.listeners:
            listener.after_rollout(result)

    def end_step(self, module: GRPOModule, result: RolloutResult) -> None:
        for listener in self.listeners:
            listener.end_step(module, result)
