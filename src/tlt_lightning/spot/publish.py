"""Versioned drafter weights for the rollout engine: a rollout never runs on half-updated weights.

The trainer updates its drafter in place, step after step, possibly while a rollout is drafting
with it. :class:`DrafterPublisher` decouples the two: the trainer :meth:`~DrafterPublisher.publish`
es a copy into a serving instance no reader holds, then swaps it in under a lock (version + 1);
the rollout side :meth:`~DrafterPublisher.acquire` s the current instance at the start of each
rollout and holds it (a lease) until the rollout ends, so its weights never change mid-rollout.

Double buffering: with one rollout at a time there are two serving instances, the one being read
and the one being written. If the trainer publishes again while a rollout still holds an old
version, a third instance is created rather than waiting (publishing never blocks on readers);
in general there are at most ``2 + concurrent rollouts`` instances. Serving instances are
``deepcopy`` s of the trainer's drafter: they share the target's embedding and LM head by reference.
With ``serving_target`` they are :meth:`Drafter.for_target` copies instead: the trainer's fp32
drafter on the fp32 policy publishes into bf16 instances that read the policy's bf16 rollout mirror.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from typing_extensions import Self

from tlt_lightning.drafter.model import Drafter
from tlt_lightning.models.target import TargetModel

__all__ = ["DrafterLease", "DrafterPublisher"]


class _Slot:
    __slots__ = ("drafter", "leases", "version", "writing")

    def __init__(self, drafter: Drafter, version: int) -> None:
        self.drafter, self.version, self.leases, self.writing = drafter, version, 0, False


class DrafterLease:
    """A rollout's hold on one published drafter version; release it when the rollout ends.

    Unpacks as ``version, drafter = lease`` and works as a context manager (released on exit).

    Attributes:
        version: the published version (``0`` = the weights the publisher was built with).
        drafter: a serving instance (eval mode, no gradients); do not modify it.
    """

    def __init__(self, publisher: DrafterPublisher, slot: _Slot) -> None:
        self._publisher, self._slot = publisher, slot
        self.version, self.drafter = slot.version, slot.drafter
        self.released = False

    def release(self) -> None:
        """Give the instance back (idempotent)."""
        self._publisher._release(self)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.version, self.drafter))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _copy_weights(dst: Drafter, src: Mapping[str, torch.Tensor]) -> None:
    own = dst.state_dict()
    if own.keys() != src.keys():
        missing, unexpected = sorted(own.keys() - src.keys()), sorted(src.keys() - own.keys())
        raise ValueError(
            f"published weights do not fit the drafter: missing {missing}, unexpected {unexpected}"
        )
    with torch.no_grad():
        for key, tensor in own.items():
            if tensor.shape != src[key].shape:
                raise ValueError(
                    f"published {key} has shape {list(src[key].shape)}, expected {list(tensor.shape)}"
                )
            tensor.copy_(src[key])


class DrafterPublisher:
    """Versioned, double-buffered drafter weights shared by a trainer and rollouts (thread-safe).

    Args:
        drafter: the trainer's drafter; version 0 is a copy of its current weights.
        serving_target: the target the rollouts run on, when it is not the one ``drafter`` was
            built on (e.g. a bf16 mirror of the policy): serving instances read its embedding and
            LM head and take its dtype. ``None``: the trainer's target and dtype.

    Example:
        >>> # publisher = DrafterPublisher(drafter)
        >>> # trainer side, after drafter steps:   publisher.publish(drafter)
        >>> # rollout side, per rollout:
        >>> # with publisher.acquire() as lease:
        >>> #     loop = SpeculativeRolloutLoop(target, lease.drafter, ...); loop.generate(prompts)
    """

    def __init__(self, drafter: Drafter, serving_target: TargetModel | None = None) -> None:
        if not isinstance(drafter, torch.nn.Module):
            raise TypeError(f"drafter must be a Drafter (nn.Module), got {type(drafter).__name__}")
        self._serving_target = serving_target
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()  # one publish at a time
        self._slots = [_Slot(self._serving_copy(drafter), 0), _Slot(self._serving_copy(drafter), -1)]
        self._front = self._slots[0]
        self.published = 0

    def _serving_copy(self, drafter: Drafter) -> Drafter:
        if self._serving_target is None:
            copy_ = copy.deepcopy(drafter).eval()
        else:
            copy_ = drafter.for_target(self._serving_target).eval()
        for p in copy_.parameters():
            p.grad = None
            p.requires_grad_(False)
        return copy_

    # ------------------------------------------------------------------------------ trainer side
    @property
    def version(self) -> int:
        """The newest published version."""
        with self._lock:
            return self._front.version

    @property
    def num_instances(self) -> int:
        with self._lock:
            return len(self._slots)

    def publish(self, weights: Drafter | Mapping[str, torch.Tensor]) -> int:
        """Make ``weights`` the current version (a copy: later in-place updates do not leak).

        Call it from the thread that trains ``weights`` (between optimizer steps), so the copy is
        a consistent step. Never waits for readers.

        Args:
            weights: the trainer's drafter or its ``state_dict`` (e.g. received from another rank).

        Returns:
            The new version.

        Raises:
            ValueError: the weights do not fit the drafter (missing, unexpected or reshaped tensors).
        """
        state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
        if not isinstance(state, Mapping):
            raise TypeError(f"weights must be a Drafter or a state_dict, got {type(weights).__name__}")
        with self._publish_lock:
            with self._lock:
                slot = next((s for s in self._slots if s is not self._front and s.leases == 0), None)
                if slot is None:  # every spare is held by a rollout on an older version
                    slot = _Slot(self._serving_copy(self._front.drafter), -1)
                    self._slots.append(slot)
                slot.writing = True
            try:
                _copy_weights(slot.drafter, state)  # no reader can see this slot: it is not the front
            finally:
                with self._lock:
                    slot.writing = False
            with self._lock:
                slot.version = self._front.version + 1
                self._front = slot
                self.published += 1
                return slot.version

    # ------------------------------------------------------------------------------ rollout side
    def acquire(self) -> DrafterLease:
        """Hold the current version for one rollout (release it, or use ``with``, when it ends)."""
        with self._lock:
            slot = self._front
            slot.leases += 1
            return DrafterLease(self, slot)

    def _release(self, lease: DrafterLease) -> None:
        with self._lock:
            if not lease.released:
                lease.released = True
                lease._slot.leases -= 1
            # Drop extra instances no one holds (back to double buffering).
            while len(self._slots) > 2:
                extra = next(
                    (s for s in self._slots if s is not self._front and s.leases == 0 and not s.writing), None
                )
                if extra is None:
                    break
                self._slots.remove(extra)

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The version counter (the weights are the trainer's drafter's, checkpointed with it)."""
        return {"version": self.version, "published": self.published}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the version counter so versions stay monotonic across a resume (then :meth:`publish`)."""
        with self._publish_lock, self._lock:
            self._front.version = max(self._front.version, int(state.get("version", self._front.version)))
            self.published = int(state.get("published", self.published))
