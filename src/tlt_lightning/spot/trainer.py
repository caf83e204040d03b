"""The drafter's own training between and inside rollouts: one optimizer, one batch stream, bounded steps.

:class:`SpotTrainer` owns what spot training needs apart from the scheduling: the AdamW optimizer of
the drafter, a stream of packed batches drawn from a :class:`~tlt_lightning.spot.RolloutBuffer`
(recent policy steps preferred; the random source is a function of ``(seed, policy step, rank)``, so a
resumed run samples what the uninterrupted one did), one *local* drafter step (no collectives: it may
run inside a :class:`~tlt_lightning.spot.WorkerCoordinator` window while other ranks still
generate), the bounded *paid* loop for when no idle time exists, and the cross-rank averaging.

Cross-rank sync: ranks train different numbers of steps on their own rollouts in their own idle
windows, so gradients cannot be all-reduced step by step. :meth:`SpotTrainer.average` instead replaces
each rank's drafter (and AdamW moments and step count) by the average over ranks *weighted by the
drafter steps each rank took*: one summed ``reduce`` of a flat vector. Ranks start the RL step
identical, so this is ``theta + sum_r w_r * delta_r`` (local-SGD style model averaging); a rank that
did not train contributes nothing (weights ``(1, 0)`` reproduce the trainer's copy exactly), and the
result is bit-identical on every rank. No Lightning here: ``reduce`` is any callable (e.g.
``lambda t: strategy.reduce(t, reduce_op="sum")``, or ``torch.distributed.all_reduce`` wrapped).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tlt_lightning.drafter.losses import DrafterLoss
from tlt_lightning.drafter.model import Drafter
from tlt_lightning.drafter.packing import pack_batches
from tlt_lightning.drafter.snapshot import snapshot_state
from tlt_lightning.drafter.train import DrafterBatch, drafter_train_step
from tlt_lightning.models.target import TargetModel
from tlt_lightning.spot.buffer import RolloutBuffer
from tlt_lightning.validation import check, is_int, is_number

__all__ = ["PaidTraining", "SpotTrainer", "SpotTrainerConfig"]


def _seed(*parts: Any) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(frozen=True)
class SpotTrainerConfig:
    """Optimizer, packing, paid budget and seed of a :class:`SpotTrainer`.

    Args:
        lr: AdamW learning rate (``> 0``).
        packing_budget: samples (tokens) packed into one drafter step (``>= 2``).
        max_steps_per_rollout: paid training (:meth:`SpotTrainer.train_paid`): at most this many
            drafter steps (``>= 0``; ``None``: no step limit).
        max_seconds_per_rollout: paid training: at most this many seconds (``> 0`` or ``None``); a
            step the remaining time cannot hold (by the mean step so far) is not started. At least
            one of the two must be set: paid training costs RL step time.
        weight_decay: AdamW weight decay (``>= 0``).
        max_grad_norm: gradient clipping (``> 0`` or ``None``).
        seed: seeds batch sampling, with the policy step and the rank (``>= 0``).
        unroll_steps: draft steps trained per position (``>= 1``): steps after the first read the
            drafter's own previous output, as drafting does (:class:`~tlt_lightning.drafter.DrafterLoss`).
        accept_weight: weight of ``1 - acceptance rate`` (the total-variation distance to the target,
            what sampled speculation accepts; ``>= 0``) beside the kind's feature and CE losses.
    """

    lr: float = 3e-4
    packing_budget: int = 1024
    max_steps_per_rollout: int | None = 4
    max_seconds_per_rollout: float | None = 2.0
    paid_share_of_savings: float | None = None
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    seed: int = 0
    unroll_steps: int = 1
    accept_weight: float = 0.0

    def __post_init__(self) -> None:
        steps, seconds = self.max_steps_per_rollout, self.max_seconds_per_rollout
        for name, value, ok, allowed in (
            ("lr", self.lr, is_number(self.lr) and self.lr > 0, "a finite number > 0"),
            ("packing_budget", self.packing_budget,
             is_int(self.packing_budget) and self.packing_budget >= 2, "an int >= 2"),
            ("max_steps_per_rollout", steps, steps is None or (is_int(steps) and steps >= 0),
             "an int >= 0 or None"),
            ("max_seconds_per_rollout", seconds, seconds is None or (is_number(seconds) and seconds > 0),
             "a finite number > 0 or None"),
            ("paid_share_of_savings", self.paid_share_of_savings,
             self.paid_share_of_savings is None or (is_number(self.paid_share_of_savings)
                                                    and self.paid_share_of_savings > 0),
             "a number > 0 or None"),
            ("weight_decay", self.weight_decay, is_number(self.weight_decay) and self.weight_decay >= 0,
             "a number >= 0"),
            ("max_grad_norm", self.max_grad_norm,
             self.max_grad_norm is None or (is_number(self.max_grad_norm) and self.max_grad_norm > 0),
             "a number > 0 or None"),
            ("seed", self.seed, is_int(self.seed) and self.seed >= 0, "an int >= 0"),
            ("unroll_steps", self.unroll_steps, is_int(self.unroll_steps) and self.unroll_steps >= 1,
             "an int >= 1"),
            ("accept_weight", self.accept_weight, is_number(self.accept_weight) and self.accept_weight >= 0,
             "a number >= 0"),
        ):  # fmt: skip
            check(ok, name, value, allowed)
        if steps is None and seconds is None:
            raise ValueError(
                "max_steps_per_rollout and max_seconds_per_rollout are both None: training between "
                "rollouts (a single worker has no idle time) must be bounded; set at least one"
            )


class PaidTraining(NamedTuple):
    """What one :meth:`SpotTrainer.train_paid` call did.

    Attributes:
        steps: drafter steps taken.
        seconds: time they took (``time.perf_counter``).
        start: when they started (wall clock, ``time.time()``, as the coordinator's timeline).
    """

    steps: int
    seconds: float
    start: float


class SpotTrainer:
    """Trains a drafter on a :class:`~tlt_lightning.spot.RolloutBuffer`, a step at a time.

    Call :meth:`begin_step` at each RL step (it fixes the policy step the batches are drawn for),
    then :meth:`train_one` (e.g. as a coordinator's ``step_fn`` in an idle window) and/or
    :meth:`train_paid`; with several ranks, :meth:`average` makes the drafters identical again.

    Args:
        drafter: the drafter to train (updated in place; train it in fp32).
        target: the target model whose hidden states and head it learns (read, never updated).
        buffer: harvested rollouts to sample from (filled by the caller).
        config: optimizer, packing, paid budget and seed.
        rank: this worker's rank (``>= 0``): part of the sampling seed.

    Attributes:
        optimizer: AdamW over the drafter's trainable parameters.
        steps: drafter steps taken by this object (all RL steps, tail and paid).
        loss_sum, top1_sum: sums of the loss and top-1 agreement over the steps since :meth:`begin_step`.

    Example:
        >>> # trainer = SpotTrainer(drafter, target, buffer, SpotTrainerConfig(max_steps_per_rollout=4))
        >>> # buffer.add(rollout.rollouts, step=7); trainer.begin_step(7)
        >>> # paid = trainer.train_paid()           # <= 4 steps, then
        >>> # trainer.average(lambda t: strategy.reduce(t, reduce_op="sum"), weight=my_steps / all_steps)
    """

    def __init__(
        self,
        drafter: Drafter,
        target: TargetModel,
        buffer: RolloutBuffer,
        config: SpotTrainerConfig | None = None,
        rank: int = 0,
    ) -> None:
        check(is_int(rank) and rank >= 0, "rank", rank, "an int >= 0")
        self.drafter, self.target, self.buffer = drafter, target, buffer
        self.config, self.rank = config or SpotTrainerConfig(), rank
        params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=float(self.config.lr), weight_decay=float(self.config.weight_decay)
        )
        self.loss_cfg = DrafterLoss.for_kind(
            drafter.config.kind,
            unroll_steps=self.config.unroll_steps,
            accept_weight=self.config.accept_weight,
        )
        self.steps, self.policy_step = 0, 0
        self.loss_sum = self.top1_sum = 0.0
        self._batches: Iterator[DrafterBatch] | None = None

    def begin_step(self, policy_step: int) -> None:
        """A new RL step: batches are drawn afresh for ``policy_step``; the loss / top-1 sums restart."""
        check(is_int(policy_step) and policy_step >= 0, "policy_step", policy_step, "an int >= 0")
        self.policy_step, self._batches = policy_step, None
        self.loss_sum = self.top1_sum = 0.0

    def generator(self) -> torch.Generator:
        """The CPU random source of this RL step: a function of ``(seed, policy step, rank)`` only."""
        return torch.Generator().manual_seed(_seed(self.config.seed, self.policy_step, self.rank))

    def stream(self, generator: torch.Generator) -> Iterator[DrafterBatch]:
        """Packed batches of buffered rollouts, recent policy steps preferred, resampled when used up.

        Ends when the buffer is empty (or holds no rollout with a training sample).
        """
        while len(self.buffer):
            mean_len = max(1.0, self.buffer.num_tokens / max(1, len(self.buffer)))
            n = max(1, math.ceil(4 * self.config.packing_budget / mean_len))  # about four steps per draw
            samples = self.buffer.sample(n, generator, dtype=self.drafter.dtype)
            batches = pack_batches(
                samples,
                self.drafter.config,
                self.config.packing_budget,
                rows=1,
                shuffle=True,
                generator=generator,
            )
            if not batches:
                return
            yield from batches

    def train_one(self) -> bool:
        """One local drafter step (no collectives: it may run inside a coordinator window).

        In float32 whatever the caller's autocast: an autocast region casts each weight once and reuses
        the cast until the region ends, so inside a training step under Lightning's ``bf16-mixed`` every
        drafter step after the first would run on the first one's weights (the optimizer updates them
        in place).

        Returns:
            Whether a step was taken (``False``: no data).
        """
        if self._batches is None:
            self._batches = self.stream(self.generator())
        batch = next(self._batches, None)
        if batch is None:
            return False
        with torch.autocast(self.drafter.device.type, enabled=False):
            metrics = drafter_train_step(
                self.drafter, self.target, batch, self.optimizer, self.loss_cfg, self.config.max_grad_norm
            )
        self.loss_sum += metrics["loss"]
        self.top1_sum += metrics["top1"]
        self.steps += 1
        return True

    def train_paid(self, max_seconds: float | None = None) -> PaidTraining | None:
        """Bounded training the RL step pays for (no idle device to hide it in).

        At most ``max_steps_per_rollout`` steps and ``max_seconds_per_rollout`` seconds; a step the
        remaining time cannot hold (judged by the mean step so far) is not started.

        Args:
            max_seconds: a tighter time bound for this call (e.g. the credit of a
                :class:`~tlt_lightning.spot.savings.SavingsAccount`); ``<= 0``: no step.

        Returns:
            Steps, seconds and start; ``None`` when there was nothing to do (a step budget of ``0``
            or an empty buffer).
        """
        limit_steps, limit_s = self.config.max_steps_per_rollout, self.config.max_seconds_per_rollout
        if max_seconds is not None:
            limit_s = max_seconds if limit_s is None else min(limit_s, max_seconds)
        if limit_steps == 0 or not len(self.buffer) or (limit_s is not None and limit_s <= 0):
            return None
        t0, start, steps = time.time(), time.perf_counter(), 0
        while limit_steps is None or steps < limit_steps:
            elapsed = time.perf_counter() - start
            if limit_s is not None and steps and elapsed + elapsed / steps > limit_s:
                break
            if not self.train_one():
                break
            steps += 1
        return PaidTraining(steps, time.perf_counter() - start, t0)

    def average(self, reduce: Callable[[torch.Tensor], torch.Tensor], weight: float) -> None:
        """Replace the drafter and its AdamW state by their ``weight``-ed sum over ranks.

        Every rank calls it at the same point (``reduce`` is a collective) with its own ``weight``;
        the weights over ranks should sum to 1 (e.g. this rank's drafter steps over all ranks').
        State a rank does not have yet (no step taken) counts as zeros.

        Args:
            reduce: sums a float32 ``[N]`` tensor over ranks and returns the result (the same on
                every rank), e.g. ``lambda t: strategy.reduce(t, reduce_op="sum")``.
            weight: this rank's weight, in ``[0, 1]``.
        """
        check(is_number(weight) and 0 <= weight <= 1, "weight", weight, "a number in [0, 1]")
        slots = []  # (tensor to write back, or None with (param, key) for state this rank lacks)
        for p in (p for p in self.drafter.parameters() if p.requires_grad):
            state = self.optimizer.state[p]
            slots.append((p.data, None))
            for key in ("exp_avg", "exp_avg_sq", "step"):
                slots.append((state.get(key), (p, key)))
        device = self.drafter.device
        pieces = []
        for tensor, where in slots:
            if tensor is None:
                p, key = where
                pieces.append(
                    torch.zeros(
                        () if key == "step" else p.shape, dtype=torch.float32, device=device
                    ).flatten()
                )
            else:
                pieces.append(tensor.detach().to(device, torch.float32).flatten())
        flat = reduce(torch.cat(pieces) * weight)
        at = 0
        with torch.no_grad():
            for (tensor, where), piece in zip(slots, pieces):
                value = flat[at : at + piece.numel()]
                at += piece.numel()
                if tensor is None:
                    p, key = where
                    if key == "step":
                        tensor = torch.zeros((), dtype=torch.float32)
                    else:
                        tensor = torch.zeros_like(p, memory_format=torch.preserve_format)
                    self.optimizer.state[p][key] = tensor
                tensor.copy_(value.view_as(tensor).to(tensor.device, tensor.dtype))

    def state_dict(self) -> dict[str, Any]:
        """The drafter's config and weights and the optimizer state (CPU copies)."""
        return {
            "drafter_config": self.drafter.config.to_dict(),
            "drafter": snapshot_state(self.drafter.state_dict()),
            "optimizer": snapshot_state(self.optimizer.state_dict()),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore weights and optimizer state; missing keys keep the current values.

        ``drafter_config`` is not applied: build the drafter from it before this object.
        """
        if "drafter" in state:
            self.drafter.load_state_dict(state["drafter"], strict=True)
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
