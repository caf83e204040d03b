"""RL: reasoning-gym tasks and rewards, prompt sources, the GRPO math and the GRPO LightningModule.

``TorchtuneGRPOModule`` (:mod:`tlt_lightning.rl.torchtune_module`, a torchtune decoder as the policy)
needs the optional ``torchtune`` extra: it is imported on first access, so importing this package
never needs torchtune, and accessing it without torchtune raises an ``ImportError`` naming the extra.
"""

from typing import Any

from tlt_lightning.rl.config import OptimConfig, SpeculativeConfig
from tlt_lightning.rl.grpo import group_advantages, grpo_loss
from tlt_lightning.rl.listeners import RolloutListener
from tlt_lightning.rl.module import GRPOModule, NonFiniteLossError, RewardError
from tlt_lightning.rl.sources import (
    PromptSource,
    RewardFn,
    SyntheticPromptSource,
    TaskPromptSource,
    TokenPromptSource,
)
from tlt_lightning.rl.tasks import (
    DEFAULT_SYSTEM_PROMPT,
    SUPPORTED_TASKS,
    Prompt,
    Reward,
    TaskConfig,
    TaskDataset,
)

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "SUPPORTED_TASKS",
    "GRPOModule",
    "NonFiniteLossError",
    "OptimConfig",
    "Prompt",
    "PromptSource",
    "Reward",
    "RewardError",
    "RewardFn",
    "RolloutListener",
    "SpeculativeConfig",
    "SyntheticPromptSource",
    "TaskConfig",
    "TaskDataset",
    "TaskPromptSource",
    "TokenPromptSource",
    "group_advantages",
    "grpo_loss",
]

_TORCHTUNE = ("TorchtuneGRPOModule",)


def __getattr__(name: str) -> Any:
    if name in _TORCHTUNE:  # optional extra: imported on first use only
        from tlt_lightning.rl import torchtune_module

        return getattr(torchtune_module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
