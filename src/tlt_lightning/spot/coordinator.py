"""Spot training of the drafter on idle rollout workers: BUSY / IDLE / TRAINING, preemptible.

Every rollout worker (one process per device, a ``torch.distributed`` rank) generates its share of
the rollout (``BUSY``). A worker whose share is done while others are still in the long tail is
``IDLE``; if there is training data it runs drafter steps on that time (``TRAINING``), one at a
time, until the rollout ends everywhere; then it is needed again (``BUSY``: policy update, next
rollout). Preemption is at drafter-step granularity: the loop polls between steps.

The "rollout is over" signal goes through ``torch.distributed``: at :meth:`WorkerCoordinator.share_done`
each rank posts an asynchronous ``all_reduce(MAX)`` of its finish time. It completes exactly when
the last rank has finished its share, so ``work.is_completed()`` polled between drafter steps is the
preemption signal, and the reduced value is the time the signal was given (preemption latency =
leaving TRAINING minus that time; same host: same clock, across hosts it includes their clock offset).
Without a process group (or with a world of one) there is no tail: the coordinator degrades to a local
flag (:meth:`preempt`) and a step / time budget per window. Every transition is recorded with a
wall-clock timestamp. The signal is a CPU tensor: on a group whose backend cannot carry one (NCCL, a
GPU job's default) the coordinator signals over a gloo group of the same ranks (:func:`cpu_group`).

Drafter steps inside a window must be local (no collectives): ranks train in different windows.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from tlt_lightning.validation import check, is_int, is_number

__all__ = ["CoordinatorConfig", "Segment", "TrainWindow", "WorkerCoordinator", "WorkerState", "cpu_group"]


class WorkerState(str, Enum):
    """What a rollout worker is doing (a :class:`Segment` of its timeline): generating its share, idle
    in the other workers' tail, or training the drafter there."""

    BUSY = "busy"  # generating its share (or, after the rollout, the policy update)
    IDLE = "idle"  # share done, others still in the tail
    TRAINING = "training"  # drafter steps on idle time


class Segment(NamedTuple):
    """One stretch of a worker in one state (wall-clock seconds, ``time.time()``)."""

    worker: int
    state: WorkerState
    start: float
    end: float


class TrainWindow(NamedTuple):
    """What one :meth:`WorkerCoordinator.maybe_train` call did.

    Attributes:
        steps: drafter steps run.
        seconds: time spent TRAINING.
        preempted: ended because the rollout ended (or :meth:`~WorkerCoordinator.preempt`), not by
            the budget or ``should_continue``.
        latency_s: signal to leaving TRAINING (``None`` unless preempted while training).
        step_seconds: mean seconds per drafter step (``0`` if none).
    """

    steps: int
    seconds: float
    preempted: bool
    latency_s: float | None
    step_seconds: float


@dataclass(frozen=True)
class CoordinatorConfig:
    """Budgets and polling of a :class:`WorkerCoordinator`.

    Args:
        min_idle_s: start training only if the rollout is still running this long after the
            worker's share is done (a step cannot pay off in a shorter tail); ``>= 0``.
        max_steps: drafter steps per window at most (``None``: no limit while others are busy).
        max_seconds: seconds of training per window at most (``None``: no limit).
        poll_s: sleep between polls while IDLE (``> 0``).
        max_segments: timeline segments kept (oldest dropped).

    With a single worker there is no tail to fill: windows end only by :meth:`~WorkerCoordinator.preempt`
    or the budget, so at least one of ``max_steps`` / ``max_seconds`` must be set there.
    """

    min_idle_s: float = 0.05
    max_steps: int | None = None
    max_seconds: float | None = None
    poll_s: float = 0.001
    max_segments: int = 100_000

    def __post_init__(self) -> None:
        def positive(value: Any) -> bool:  # inf allowed: no budget
            return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0

        steps, seconds = self.max_steps, self.max_seconds
        for name, value, ok, allowed in (
            ("min_idle_s", self.min_idle_s, is_number(self.min_idle_s) and self.min_idle_s >= 0,
             "a finite number >= 0"),
            ("max_steps", steps, steps is None or (is_int(steps) and steps > 0), "a positive int or None"),
            ("max_seconds", seconds, seconds is None or positive(seconds), "a number > 0 or None"),
            ("poll_s", self.poll_s, positive(self.poll_s), "a number > 0"),
            ("max_segments", self.max_segments, is_int(self.max_segments) and self.max_segments >= 1,
             "an int >= 1"),
        ):  # fmt: skip
            check(ok, name, value, allowed)


def cpu_group(group: Any = None) -> Any:
    """``group`` (``None``: the world) if its backend carries CPU tensors, else a new gloo group of its ranks.

    A collective when it creates a group: every rank of the world calls it at the same point.

    Example:
        >>> # dist.init_process_group("nccl"); cpu_group() -> a gloo group of every rank
    """
    if "cpu:" in dist.get_backend_config(group):
        return group
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo")


class WorkerCoordinator:
    """The BUSY / IDLE / TRAINING state machine of one rollout worker.

    Args:
        config: budgets and polling.
        group: the process group of the rollout workers (default: the world, when initialised).

    Example:
        >>> # coord = WorkerCoordinator()
        >>> # coord.rollout_started()                     # BUSY
        >>> # result = engine.generate(my_prompts); buffer.add(result.rollouts, step)
        >>> # coord.share_done()                          # IDLE, tells the other ranks
        >>> # coord.maybe_train(lambda: drafter_train_step(...), has_data=len(buffer) > 0)
        >>> # coord.wait_rollout_end()                    # BUSY: every rank is done
    """

    def __init__(self, config: CoordinatorConfig | None = None, group: Any = None) -> None:
        self.config = config or CoordinatorConfig()
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.group = cpu_group(group) if self.distributed else group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self._state = WorkerState.BUSY
        self._since = time.time()
        self._segments: deque[Segment] = deque(maxlen=self.config.max_segments)
        self._preempt = threading.Event()
        self._preempt_time: float | None = None
        self._work: Any = None  # the pending all_reduce of this rollout
        self._signal = torch.zeros(1, dtype=torch.float64)
        self._done_at: float | None = None
        self.latencies: deque[float] = deque(maxlen=10_000)
        self.rollouts = self.windows = self.train_steps = 0
        self.train_seconds = self.idle_seconds = 0.0

    # ------------------------------------------------------------------------------ state
    @property
    def state(self) -> WorkerState:
        return self._state

    def _set(self, state: WorkerState, force: bool = False) -> None:
        now = time.time()
        if state is self._state and not force:
            return
        self._segments.append(Segment(self.rank, self._state, self._since, now))
        if self._state is WorkerState.IDLE:
            self.idle_seconds += now - self._since
        elif self._state is WorkerState.TRAINING:
            self.train_seconds += now - self._since
        self._state, self._since = state, now

    def timeline(self, since: float | None = None) -> list[Segment]:
        """This worker's segments (the current one ends now), optionally those ending after ``since``."""
        segs = [*self._segments, Segment(self.rank, self._state, self._since, time.time())]
        return [s for s in segs if since is None or s.end > since]

    def gather_timeline(self, since: float | None = None) -> list[Segment]:
        """Every worker's segments (a collective: all ranks must call it at the same point)."""
        mine = [tuple(s) for s in self.timeline(since)]
        if not self.distributed:
            return [Segment(*s) for s in mine]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        return [Segment(w, WorkerState(st), a, b) for segs in everyone for (w, st, a, b) in segs]

    # ------------------------------------------------------------------------------ transitions
    def rollout_started(self) -> None:
        """Any state -> BUSY: this worker starts generating its share of a new rollout."""
        if self._work is not None:  # the last rollout's collective must complete first
            self._work.wait()
        self._preempt.clear()
        self._preempt_time = None
        self._work, self._done_at = None, None
        self.rollouts += 1
        self._set(WorkerState.BUSY, force=True)

    def share_done(self) -> None:
        """BUSY -> IDLE: this worker's share is generated; tell the others (asynchronously)."""
        if self._state is not WorkerState.BUSY or self._done_at is not None:
            raise RuntimeError(
                f"share_done() needs a started rollout (state BUSY), the worker is {self._state.value}"
            )
        self._done_at = time.time()
        self._set(WorkerState.IDLE)
        if self.distributed:
            self._signal.fill_(self._done_at)
            self._work = dist.all_reduce(self._signal, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def preempt(self) -> None:
        """Local signal (thread-safe): stop training after the current step (e.g. the next rollout starts)."""
        self._preempt_time = time.time()
        self._preempt.set()

    def rollout_over(self) -> bool:
        """Whether every worker has finished its share (or a local :meth:`preempt` came)."""
        if self._preempt.is_set():
            return True
        return self._work is not None and self._work.is_completed()

    def _signal_time(self) -> float | None:
        if self._work is not None and self._work.is_completed():
            self._work.wait()
            t = float(self._signal.item())
            return t if self._preempt_time is None else min(t, self._preempt_time)
        return self._preempt_time

    def wait_rollout_end(self) -> None:
        """Block (IDLE) until every worker's share is done, then BUSY. No-op outside a rollout."""
        if self._work is not None:
            self._work.wait()
        if self._state is not WorkerState.BUSY:
            self._set(WorkerState.BUSY)

    def finished_last(self) -> bool:
        """After :meth:`wait_rollout_end`: whether this worker's share was the last one done (the
        all-reduced finish time is its own). Always True without a process group."""
        if not self.distributed:
            return True
        if self._done_at is None or self._work is None or not self._work.is_completed():
            raise RuntimeError(
                "finished_last() needs share_done() and the rollout's end (wait_rollout_end())"
            )
        return self._done_at >= float(self._signal.item())

    # ------------------------------------------------------------------------------ training
    def _budget_left(self, steps: int, start: float) -> bool:
        c = self.config
        if c.max_steps is not None and steps >= c.max_steps:
            return False
        return c.max_seconds is None or time.perf_counter() - start < c.max_seconds

    def should_continue(self, steps: int = 0, start: float | None = None) -> bool:
        """Whether another drafter step may start (rollout not over, budget left)."""
        if self.rollout_over():
            return False
        return start is None or self._budget_left(steps, start)

    def maybe_train(
        self, step_fn: Callable[[], Any], has_data: bool | Callable[[], bool] = True
    ) -> TrainWindow:
        """IDLE -> TRAINING: run ``step_fn`` (one drafter step) while the others are still busy.

        Waits up to ``min_idle_s`` first (a tail that short is not worth a step). Leaves TRAINING
        for BUSY when the rollout ends (checked between steps), or for IDLE when the budget or
        the data runs out.

        Args:
            step_fn: one drafter optimisation step (local: no collectives).
            has_data: whether there is training data (or a callable checked before each step).

        Returns:
            The window's :class:`TrainWindow`.
        """
        if self._state is not WorkerState.IDLE:
            raise RuntimeError(
                f"maybe_train() needs an IDLE worker (after share_done()), it is {self._state.value}"
            )
        c = self.config
        if not self.distributed and c.max_steps is None and c.max_seconds is None:
            raise ValueError(
                "a single worker has no tail to fill: set CoordinatorConfig.max_steps or max_seconds "
                "to bound its training between rollouts"
            )
        data = has_data if callable(has_data) else (lambda: bool(has_data))
        if self.distributed:
            assert self._done_at is not None
            while not self.rollout_over() and time.time() - self._done_at < c.min_idle_s:
                time.sleep(c.poll_s)
        if self.rollout_over() or not data():
            over = self._work is not None and self._work.is_completed()
            if over:
                self.wait_rollout_end()
            return TrainWindow(0, 0.0, self.rollout_over(), None, 0.0)
        self.windows += 1
        self._set(WorkerState.TRAINING)
        start, steps = time.perf_counter(), 0
        try:
            while True:
                step_fn()
                steps += 1
                if not self.should_continue(steps, start) or not data():
                    break
        finally:
            seconds = time.perf_counter() - start
            self.train_steps += steps
            preempted = self.rollout_over()
            signal = self._signal_time() if preempted else None
            # BUSY once the rollout is over everywhere; a local preempt() while others are still in
            # the tail leaves the worker IDLE until wait_rollout_end().
            over = not self.distributed or (self._work is not None and self._work.is_completed())
            self._set(WorkerState.BUSY if preempted and over else WorkerState.IDLE)
        latency = None if signal is None else max(0.0, self._since - signal)
        if latency is not None:
            self.latencies.append(latency)
        return TrainWindow(steps, seconds, preempted, latency, seconds / steps if steps else 0.0)

    # ------------------------------------------------------------------------------ stats / state
    def stats(self) -> dict[str, float]:
        """Counters and preemption latency percentiles (seconds), for logging."""
        lat = torch.tensor(list(self.latencies), dtype=torch.float64)
        p50, p99 = (
            lat.quantile(torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
            if lat.numel()
            else [math.nan] * 2
        )
        return {
            "rollouts": float(self.rollouts),
            "windows": float(self.windows),
            "train_steps": float(self.train_steps),
            "train_seconds": self.train_seconds,
            "idle_seconds": self.idle_seconds,
            "preemption_latency_p50": p50,
            "preemption_latency_p99": p99,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "rollouts": self.rollouts,
            "windows": self.windows,
            "train_steps": self.train_steps,
            "train_seconds": self.train_seconds,
            "idle_seconds": self.idle_seconds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters; missing keys keep their current values."""
        for key in ("rollouts", "windows", "train_steps"):
            setattr(self, key, int(state.get(key, getattr(self, key))))
        for key in ("train_seconds", "idle_seconds"):
            setattr(self, key, float(state.get(key, getattr(self, key))))
