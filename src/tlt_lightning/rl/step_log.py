"""What one GRPO training step logs: rollout speed and acceptance, rewards, lengths, times, loss parts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tlt_lightning.rl.scoring import RewardBatch
from tlt_lightning.rollout import RolloutResult
from tlt_lightning.vllm.backend import VLLMRolloutStats

if TYPE_CHECKING:
    from tlt_lightning.rl.module import GRPOModule

__all__ = ["log_step"]


def log_step(
    module: GRPOModule,
    result: RolloutResult,
    rewards: RewardBatch,
    parts: dict[str, torch.Tensor],
    reward_time: float,
    train_time: float,
) -> None:
    """Log the step's ``rollout/*``, ``reward/*``, ``response/*``, ``time/*`` and ``train/*`` values
    through ``module.log``, averaged over ranks (the longest response: its maximum)."""
    stats, lengths = result.stats, result.lengths.float()
    module.accept_length.update(stats)
    module.rollout_tokens_per_s.update(stats)
    # Metrics sync across ranks in compute(); reset: these are per-step values.
    module.log("rollout/accept_length", module.accept_length.compute(), prog_bar=True)
    module.log("rollout/tokens_per_s", module.rollout_tokens_per_s.compute(), prog_bar=True)
    module.accept_length.reset()
    module.rollout_tokens_per_s.reset()

    def log(name: str, value: Any, **kw: Any) -> None:
        module.log(name, value, sync_dist=True, **kw)

    log("reward/mean", rewards.total.mean(), prog_bar=True)
    log("reward/std", rewards.total.std() if rewards.total.numel() > 1 else torch.tensor(0.0))
    log("reward/accuracy", (rewards.correctness >= 1).float().mean())
    log("response/length_mean", lengths.mean())
    log("response/length_max", lengths.max(), reduce_fx="max")
    log("time/rollout_s", stats.total_time)
    if isinstance(stats, VLLMRolloutStats):  # the policy version vLLM served (one refresh per step)
        log("rollout/weights_version", float(stats.weights_version))
    log("time/reward_s", reward_time)
    log("time/train_s", train_time)
    for name, value in parts.items():  # loss, pg_loss, kl, clip_fraction, ..., forward_tokens (optimize)
        log(f"train/{name}", value)
