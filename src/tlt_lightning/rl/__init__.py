"""RL pieces: reasoning-gym tasks, prompts and rewards (GRPO math and the LightningModule to come)."""

from tlt_lightning.rl.rewards import (
    ANSWER_KINDS,
    EXPLICIT_SOURCES,
    AnswerKind,
    Extraction,
    extract_answer,
    find_answer,
    follows_format,
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
    "ANSWER_DESCRIPTIONS",
    "ANSWER_KINDS",
    "DEFAULT_SYSTEM_PROMPT",
    "EASY_TASK_KWARGS",
    "EXPLICIT_SOURCES",
    "SUPPORTED_TASKS",
    "AnswerKind",
    "Extraction",
    "Prompt",
    "Reward",
    "TaskConfig",
    "TaskDataset",
    "collate_prompts",
    "extract_answer",
    "find_answer",
    "follows_format",
]
