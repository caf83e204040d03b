"""SpotDrafter: the drafter trained on idle rollout time, with everything it needs, no Lightning.

It composes a :class:`~tlt_lightning.spot.SpotTrainer` (the drafter's AdamW optimizer, packed
batches from a :class:`~tlt_lightning.spot.RolloutBuffer`, local and paid drafter steps,
cross-rank averaging), a :class:`~tlt_lightning.spot.WorkerCoordinator` (BUSY / IDLE /
TRAINING), a :class:`~tlt_lightning.spot.DrafterPublisher` and an
:class:`~tlt_lightning.spot.AsyncCheckpointer`, and exposes one RL step as four verbs:

1. :meth:`begin_step`: the rollout's drafter, the newest published version (held until the step
   ends: never half-updated weights).
2. :meth:`before_rollout` / :meth:`after_rollout`: BUSY while generating, then IDLE; the rollout
   goes into the buffer tagged with the policy step, and with several ranks the worker trains the
   drafter (TRAINING) until the *last* rank has finished its share, preempted between drafter
   steps. In-window steps are local: no collectives.
3. :meth:`end_step` (after the policy update): the one sync point. If no rank trained in the tail
   (a single worker never can), every rank trains a *paid* bounded budget (with
   ``training.paid_share_of_savings``, no more than speculation saved: :mod:`~tlt_lightning.spot.savings`).
   The ranks' drafters are made identical by a step-weighted average (one ``reduce``), the result is
   published (version + 1) and, every ``checkpoint_interval`` steps, saved asynchronously (rank 0).

:class:`~tlt_lightning.callbacks.SpotDrafterCallback` hands these verbs to a
:class:`~tlt_lightning.rl.GRPOModule` as its rollout listener, whose training step calls them in this
order; any other training loop can call them itself.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tlt_lightning.drafter import Drafter, DrafterConfig, load_drafter
from tlt_lightning.drafter.location import check_drafter_location
from tlt_lightning.models.target import TargetModel
from tlt_lightning.rollout.types import RolloutResult
from tlt_lightning.spot.buffer import BufferConfig, RolloutBuffer
from tlt_lightning.spot.checkpoint import AsyncCheckpointer
from tlt_lightning.spot.config import SpotConfig
from tlt_lightning.spot.coordinator import CoordinatorConfig, Segment, WorkerCoordinator, WorkerState
from tlt_lightning.spot.publish import DrafterLease, DrafterPublisher
from tlt_lightning.spot.savings import SavingsAccount
from tlt_lightning.spot.trainer import SpotTrainer

__all__ = ["STEP_STATS", "SpotDrafter"]

STEP_STATS = ("tail_steps", "paid_steps", "loss", "top1", "tail_s", "idle_s", "paid_s", "step_s",
              "latency_sum", "latency_n", "buffer_mb", "buffer_tokens", "saved_s")  # fmt: skip
"""The per-step statistics every rank contributes to one summed reduce (:meth:`SpotDrafter.end_step`)."""

Reduce = Callable[[torch.Tensor], torch.Tensor]  # a sum over ranks (``None``: one process)


def initial_drafter(
    config: SpotConfig,
    target: TargetModel,
    drafter: Drafter | None = None,
    serving_target: TargetModel | None = None,
) -> Drafter:
    """The drafter to train, in fp32 (bf16 drafter training diverges) on ``target``.

    ``drafter`` (e.g. the module's, serving on ``serving_target``; copied unless that is ``target``
    and it is fp32) if given, else loaded from ``config.drafter_path``, else built
    with ``config.training.seed`` (identical initial weights on every rank).
    """
    path = config.drafter_path
    if drafter is not None:
        if path is not None:
            raise ValueError(
                f"drafter_path={str(path)!r} given, but the module already has a drafter "
                "(GRPOModule speculative.drafter_kind / drafter_path): pass only one"
            )
        if drafter.dtype == torch.float32 and (serving_target or target) is target:
            return drafter
        return drafter.for_target(target, dtype=torch.float32)
    if path is not None:
        check_drafter_location(path, "drafter_path")
        return load_drafter(path, target, dtype=torch.float32)
    vocab = target.info.vocab_size
    size = None if config.draft_vocab_size is None else min(config.draft_vocab_size, vocab)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.training.seed)
        return Drafter(DrafterConfig.from_target(target, config.kind, size), target, dtype=torch.float32)


class SpotDrafter:
    """Trains a drafter on the rollouts of ``target`` in idle time and publishes it for the rollouts.

    Args:
        config: the settings.
        target: the policy's target the drafter trains on (its hidden states come from the rollouts).
        checkpoint_dir: where async drafter checkpoints go (``step-XXXXXXXX/``); nothing is written
            before the first :meth:`save`.
        serving_target: the target the rollouts draft against (e.g. a bf16 mirror); default ``target``.
        drafter: train this drafter (copied to fp32 on ``target`` if needed) instead of building one.
        state: a :meth:`state_dict` to resume from (its drafter config wins over ``config``'s).

    Attributes:
        drafter, optimizer, buffer, coordinator, publisher, checkpointer, spot_trainer: what it drives.
        savings: what speculation saved against plain decoding, and the paid training's credit.
        steps, tail_steps, paid_steps, rl_steps, paid_seconds: counters over all ranks (in the state).
        local_stats: this rank's share of the last RL step (:data:`STEP_STATS`).
        last_checkpoint: the directory of the newest save.

    Example:
        >>> # spot = SpotDrafter(SpotConfig(), target, "out/drafter/checkpoints")
        >>> # for step, prompts in enumerate(batches):
        >>> #     drafter = spot.begin_step(step)     # draft this rollout with it
        >>> #     spot.before_rollout(); result = engine.generate(prompts); spot.after_rollout(result)
        >>> #     update_policy(result); totals = spot.end_step(result)
        >>> # spot.close()
    """

    def __init__(
        self,
        config: SpotConfig,
        target: TargetModel,
        checkpoint_dir: str | Path,
        *,
        serving_target: TargetModel | None = None,
        drafter: Drafter | None = None,
        state: Mapping[str, Any] | None = None,
    ) -> None:
        state = dict(state or {})
        self.config = config
        drafter = initial_drafter(config, target, drafter, serving_target)
        saved = state.get("drafter_config")
        if saved is not None and DrafterConfig.from_dict(saved) != drafter.config:
            # The checkpoint's drafter wins (e.g. resumed with other settings).
            drafter = Drafter(DrafterConfig.from_dict(saved), target, dtype=torch.float32)
        self.buffer = RolloutBuffer(BufferConfig(max_mb=config.buffer_mb, decay=config.recency_decay))
        self.coordinator = WorkerCoordinator(CoordinatorConfig(min_idle_s=config.min_idle_s))
        self.spot_trainer = SpotTrainer(
            drafter, target, self.buffer, config.training, rank=self.coordinator.rank
        )
        self.drafter, self.optimizer = drafter, self.spot_trainer.optimizer
        self.checkpointer = AsyncCheckpointer(Path(checkpoint_dir))
        self.savings = SavingsAccount(config.training.paid_share_of_savings)
        self.steps = self.tail_steps = self.paid_steps = self.rl_steps = 0
        self.paid_seconds = 0.0
        self.last_checkpoint: str | None = None
        self.local_stats: dict[str, float] = {}
        self._paid: deque[Segment] = deque(maxlen=100_000)  # paid-training spans, for the timeline
        self._lease: DrafterLease | None = None
        self._saved_at = -1
        self._in_step = self._added = False
        self.load_state_dict(state, publisher_too=False)
        self.publisher = DrafterPublisher(self.drafter, serving_target=serving_target or target)
        self.publisher.load_state_dict(state.get("publisher", {}))

    # ------------------------------------------------------------------------------ one RL step
    def begin_step(self, policy_step: int) -> Drafter:
        """Start RL step ``policy_step``; returns the drafter this step's rollouts draft with."""
        self._release()
        self._lease = self.publisher.acquire()
        self.spot_trainer.begin_step(policy_step)  # fresh batches, drawn for this policy step
        self._in_step, self._added = True, False
        self._stats = dict.fromkeys(STEP_STATS, 0.0)
        self._coord_base = (self.coordinator.train_seconds, self.coordinator.idle_seconds)
        self._step_start = time.perf_counter()
        return self._lease.drafter

    def before_rollout(self) -> None:
        """This rank starts generating (BUSY). Outside a step (evaluation) it does nothing."""
        if self._in_step and not self._added:
            self.coordinator.rollout_started()

    def after_rollout(self, result: RolloutResult) -> None:
        """This rank's share is done: keep its data, train in the other ranks' tail until it ends."""
        if not self._in_step or self._added:  # evaluation, or a second rollout in one step
            return
        coord, spot = self.coordinator, self.spot_trainer
        coord.share_done()  # first: the others' preemption signal must not wait for our bookkeeping
        self.buffer.add(result.rollouts, step=spot.policy_step)
        self._added = True
        if coord.distributed:
            before = spot.steps
            window = coord.maybe_train(spot.train_one, has_data=lambda: len(self.buffer) > 0)
            self._stats["tail_steps"] += spot.steps - before
            if window.latency_s is not None:
                self._stats["latency_sum"] += window.latency_s
                self._stats["latency_n"] += 1
        coord.wait_rollout_end()

    def end_step(
        self, result: RolloutResult, reduce: Reduce | None = None, device: torch.device | str = "cpu"
    ) -> dict[str, float]:
        """After the policy update: paid training if no rank trained, sync, publish, maybe save.

        Args:
            result: this step's rollouts (added to the buffer here if :meth:`after_rollout` was not called).
            reduce: sums a float64 tensor over ranks (e.g. ``trainer.strategy.reduce(t, "sum")``);
                ``None`` with one process.
            device: where the reduced statistics live (the collective's device).

        Returns:
            :data:`STEP_STATS` summed over ranks (identical on every rank).
        """
        if not self._in_step:
            raise RuntimeError(
                "SpotDrafter.end_step called without begin_step: call begin_step(policy_step) "
                "before the step's rollout"
            )
        self._release()
        spot, coord, stats = self.spot_trainer, self.coordinator, self._stats
        if not self._added:
            self.buffer.add(result.rollouts, step=spot.policy_step)
        self._in_step = False
        stats["step_s"] = time.perf_counter() - self._step_start
        stats["saved_s"] = self.savings.deposit(result.stats)
        summed: Reduce = reduce or (lambda t: t)
        tail = (
            float(summed(torch.tensor(stats["tail_steps"], dtype=torch.float64, device=device)))
            if coord.distributed
            else stats["tail_steps"]
        )
        paid = spot.train_paid(self.savings.budget_s()) if tail == 0 else None
        if paid is not None:
            self.savings.withdraw(paid.seconds)
            stats["paid_steps"] += paid.steps
            stats["paid_s"] += paid.seconds
            self.paid_seconds += paid.seconds
            self._paid.append(
                Segment(coord.rank, WorkerState.TRAINING, paid.start, paid.start + paid.seconds)
            )
        stats["loss"], stats["top1"] = spot.loss_sum, spot.top1_sum
        stats["tail_s"] = coord.train_seconds - self._coord_base[0]
        stats["idle_s"] = coord.idle_seconds - self._coord_base[1]
        stats["buffer_mb"], stats["buffer_tokens"] = self.buffer.size_mb, float(self.buffer.num_tokens)
        self.local_stats = dict(stats)
        local = torch.tensor([stats[k] for k in STEP_STATS], dtype=torch.float64, device=device)
        total = dict(zip(STEP_STATS, summed(local.clone()).tolist()))
        steps_here = stats["tail_steps"] + stats["paid_steps"]
        steps_all = total["tail_steps"] + total["paid_steps"]
        if steps_all > 0:
            if coord.distributed:
                spot.average(summed, steps_here / steps_all)
            self.publisher.publish(self.drafter)
        self.steps += int(steps_all)
        self.tail_steps += int(total["tail_steps"])
        self.paid_steps += int(total["paid_steps"])
        self.rl_steps += 1
        return total

    def due(self, rl_step: int) -> bool:
        """Whether ``checkpoint_interval`` asks for a save at ``rl_step``."""
        interval = self.config.checkpoint_interval
        return interval is not None and rl_step % interval == 0

    def save(self, rl_step: int) -> str | None:
        """Save the drafter and optimizer asynchronously (returns at once); the directory, or ``None``
        if this step was saved already."""
        if self._saved_at == rl_step:
            return None
        extra = {"rl_step": rl_step, "drafter_steps": self.steps, "version": self.publisher.version}
        self.checkpointer.save(self.drafter, self.optimizer, rl_step, extra)
        self._saved_at = rl_step
        self.last_checkpoint = str(self.checkpointer.directory / f"step-{rl_step:08d}")
        return self.last_checkpoint

    # ------------------------------------------------------------------------------ state
    def state_dict(self, buffer_data: bool = True) -> dict[str, Any]:
        """Everything a resumed run needs; ``buffer_data=False`` keeps the buffer's counters only."""
        return {
            "format": 1,
            **self.spot_trainer.state_dict(),  # drafter_config, drafter, optimizer
            "buffer": self.buffer.state_dict(include_data=buffer_data),
            "coordinator": self.coordinator.state_dict(),
            "publisher": self.publisher.state_dict(),
            "checkpointer": self.checkpointer.state_dict(),
            "savings": self.savings.state_dict(),
            "counters": {
                "steps": self.steps,
                "tail_steps": self.tail_steps,
                "paid_steps": self.paid_steps,
                "rl_steps": self.rl_steps,
                "paid_seconds": self.paid_seconds,
            },
            "last_checkpoint": self.last_checkpoint,
        }

    def load_state_dict(self, state: Mapping[str, Any], publisher_too: bool = True) -> None:
        """Restore a :meth:`state_dict`; missing keys keep their current values. With
        ``publisher_too`` the restored drafter is published again."""
        self.spot_trainer.load_state_dict(state)  # drafter weights, optimizer
        for key in ("buffer", "coordinator", "checkpointer", "savings"):
            if key in state:
                getattr(self, key).load_state_dict(state[key])
        if publisher_too and "publisher" in state:
            self.publisher.load_state_dict(state["publisher"])
            self.publisher.publish(self.drafter)
        counters = state.get("counters", {})
        for key in ("steps", "tail_steps", "paid_steps", "rl_steps"):
            setattr(self, key, int(counters.get(key, getattr(self, key))))
        self.paid_seconds = float(counters.get("paid_seconds", self.paid_seconds))
        self.last_checkpoint = state.get("last_checkpoint", self.last_checkpoint)

    # ------------------------------------------------------------------------------ reports / end
    def params(self) -> dict[str, Any]:
        """The settings and the trained drafter's kind, draft vocabulary and size (run parameters)."""
        c, t, d = self.config, self.config.training, self.drafter.config
        return {
            "lr": t.lr,
            "buffer_mb": c.buffer_mb,
            "packing_budget": t.packing_budget,
            "checkpoint_interval": c.checkpoint_interval,
            "min_idle_s": c.min_idle_s,
            "max_steps_per_rollout": t.max_steps_per_rollout,
            "max_seconds_per_rollout": t.max_seconds_per_rollout,
            "paid_share_of_savings": t.paid_share_of_savings,
            "kind": c.kind,
            "draft_vocab_size": c.draft_vocab_size,
            "drafter_path": c.drafter_path,
            "recency_decay": c.recency_decay,
            "weight_decay": t.weight_decay,
            "max_grad_norm": t.max_grad_norm,
            "seed": t.seed,
            "effective_kind": d.kind,
            "effective_draft_vocab": d.draft_vocab,
            "feature_layers": list(d.rollout_feature_layers),
            "trainable_parameters": self.drafter.num_trainable_parameters(),
        }

    def summary(self) -> dict[str, Any]:
        """Counters, version, newest checkpoint and this rank's coordinator statistics (JSON-ready)."""
        return {
            "drafter_steps": self.steps,
            "tail_steps": self.tail_steps,
            "paid_steps": self.paid_steps,
            "paid_seconds_rank0": self.paid_seconds,
            "rl_steps": self.rl_steps,
            "version": self.publisher.version,
            "checkpoint": self.last_checkpoint,
            "rank0": self.coordinator.stats(),
        }

    def timeline(self, since: float | None = None) -> tuple[list[Segment], list[Segment]]:
        """Every worker's coordinator segments and paid-training spans since ``since`` (a collective
        with several ranks)."""
        coord = self.coordinator
        mine = (coord.timeline(since), [s for s in self._paid if since is None or s.end > since])
        if not coord.distributed:
            return mine
        everyone: list[Any] = [None] * coord.world_size
        dist.all_gather_object(everyone, tuple([tuple(s) for s in part] for part in mine), group=coord.group)
        coord_segments, paid = (
            [Segment(w, WorkerState(st), a, b) for rank in everyone for (w, st, a, b) in rank[i]]
            for i in (0, 1)
        )
        return coord_segments, paid

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def close(self) -> None:
        """Release the rollout's drafter and wait for pending checkpoint writes."""
        self._release()
        self._in_step = False
        self.checkpointer.wait()
