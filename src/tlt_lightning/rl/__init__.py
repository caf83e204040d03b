"""RL: reasoning-gym tasks and rewards, prompt sources, the GRPO math and the GRPO LightningModule.

``TorchtuneGRPOModule`` (:mod:`tlt_lightning.rl.torchtune_module`, a torchtune decoder as the policy)
needs the optional ``torchtune`` extra: it is imported on first access, so importing this package
never needs torchtune, and accessing it without torchtune raises an ``ImportError`` naming the extra.
"""

from typing import Any

from tlt_lightning.rl.batch import PolicyBatch, completion_logprobs, policy_batch
from tlt_lightning.rl.config import OptimConfig, SpeculativeConfig
from tlt_lightning.rl.grpo import AGGREGATIONS, GRPOLossOutput, group_advantages, grpo_loss, token_logprobs
from tlt_lightning.rl.module import GRPOModule, NonFiniteLossError, RewardBatch, RewardError
from tlt_lightning.rl.rewards import (
    ANSWER_KINDS,
    EXPLICIT_SOURCES,
    AnswerKind,
    Extraction,
    extract_answer,
    find_answer,
    follows_format,
)
from tlt_lightning.rl.sources import (
    SYNTHETIC_REWARDS,
    IndexDataset,
    PromptIndexLoader,
    PromptSource,
    RewardFn,
    SyntheticPromptSource,
    TaskPromptSource,
    TokenPromptSource,
)
from tlt_lightning.rl.tasks import (
    ANSWER_DESCRIPTIONS,
    DEFAULT_SYSTEM_PROMPT,
    EASY_TASK_KWARGS,
    SUPPORTED_TASKS,
    Prompt,
    Reward,
    TaskConfig,
    TaskDataset,
    collate_prompts,
)

__all__ = [
    "AGGREGATIONS",
    "ANSWER_DESCRIPTIONS",
    "ANSWER_KINDS",
    "DEFAULT_SYSTEM_PROMPT",
    "EASY_TASK_KWARGS",
    "EXPLICIT_SOURCES",
    "SUPPORTED_TASKS",
    "SYNTHETIC_REWARDS",
    "AnswerKind",
    "Extraction",
    "GRPOLossOutput",
    "GRPOModule",
    "IndexDataset",
    "NonFiniteLossError",
    "OptimConfig",
    "PolicyBatch",
    "Prompt",
    "PromptIndexLoader",
    "PromptSource",
    "Reward",
    "RewardBatch",
    "RewardError",
    "RewardFn",
    "SpeculativeConfig",
    "SyntheticPromptSource",
    "TaskConfig",
    "TaskDataset",
    "TaskPromptSource",
    "TokenPromptSource",
    "collate_prompts",
    "completion_logprobs",
    "extract_answer",
    "find_answer",
    "follows_format",
    "group_advantages",
    "grpo_loss",
    "policy_batch",
    "token_logprobs",
]

_TORCHTUNE = ("TorchtuneGRPOModule",)


def __getattr__(name: str) -> Any:
    if name in _TORCHTUNE:  # optional extra: imported on first use only
        from tlt_lightning.rl import torchtune_module

        return getattr(torchtune_module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
