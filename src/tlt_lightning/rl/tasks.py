"""reasoning-gym tasks as prompt datasets with rewards, for RL rollouts.

A :class:`TaskDataset` turns a reasoning-gym dataset (generated in memory from a seed) into chat
prompts for a tokenizer, and scores completions with the dataset's own ``score_answer`` on a
leniently extracted answer (:mod:`tlt_lightning.rl.rewards`), plus a small format bonus.

The defaults are tuned so that SmolLM2-135M-Instruct sampling at temperature 1 gets a mean reward
well inside ``(0, 1)`` with variance inside groups of the same prompt, which GRPO needs to learn;
reasoning-gym's own defaults score ~0 with it. ``docs/tasks.md`` has the measurements.

reasoning-gym is the ``tasks`` extra (it pins its own dependencies exactly): imported on first use,
so a run on a custom prompt source, the tiny models or any tool that only reads a
:class:`TaskConfig` work without it.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset

from tlt_lightning.rl.rewards import EXPLICIT_SOURCES, AnswerKind, find_answer
from tlt_lightning.validation import MissingExtraError, check

__all__ = [
    "ANSWER_DESCRIPTIONS",
    "DEFAULT_SYSTEM_PROMPT",
    "EASY_TASK_KWARGS",
    "SUPPORTED_TASKS",
    "Prompt",
    "Reward",
    "TaskConfig",
    "TaskDataset",
    "collate_prompts",
    "reasoning_gym",
    "task_prompts",
]


def reasoning_gym() -> ModuleType:
    """The ``reasoning_gym`` module, imported on first use (``ImportError`` naming the extra without it)."""
    try:
        import reasoning_gym as module
    except ImportError as err:
        raise MissingExtraError(
            "the reasoning-gym tasks need the `tasks` extra: pip install 'tlt-lightning[tasks]' "
            "(make setup installs it); or pass a prompt_source of your own"
        ) from err
    return module


SUPPORTED_TASKS: dict[str, AnswerKind] = {
    "basic_arithmetic": "number",
    "chain_sum": "number",
    "countdown": "expression",
    "gsm_symbolic": "number",
}
"""The reasoning-gym tasks :class:`TaskConfig` accepts, each with how its answers look (picks the
extraction rules)."""

# The easiest settings of each task: SmolLM2-135M solves ~20-25% of chain_sum/basic_arithmetic
# problems under them at temperature 1, and none of countdown's (docs/tasks.md).
# ``TaskConfig.task_kwargs`` is merged over these when ``TaskConfig.easy`` is true.
EASY_TASK_KWARGS: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ("+", "-"),
        "allow_parentheses": False,
        "allow_negation": False,
    },
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "countdown": {
        "min_numbers": 2,
        "max_numbers": 3,
        "min_value": 1,
        "max_value": 10,
        "min_target": 1,
        "max_target": 30,
        "operators": ("+", "-"),
    },
    # gsm_symbolic has one difficulty level: nothing to make easier.
    "gsm_symbolic": {},
}

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful math assistant. Solve the problem, then finish with one line of the form "
    "'The answer is X.' where X is only {answer}."
)
"""The system prompt of :class:`TaskConfig`; ``{answer}`` becomes ``ANSWER_DESCRIPTIONS[kind]``, so one prompt
serves numbers and expressions."""
ANSWER_DESCRIPTIONS: dict[str, str] = {
    "number": "the final number",
    "expression": "the arithmetic expression",
}


@dataclass
class TaskConfig:
    """Which reasoning-gym task to train on, and how to prompt and score it.

    Args:
        name: reasoning-gym dataset name; one of :data:`SUPPORTED_TASKS`.
        size: number of distinct prompts (reasoning-gym generates them on access).
        seed: generation seed; the same seed gives the same prompts.
        task_kwargs: reasoning-gym config fields (e.g. ``min_terms``, ``max_digits``), merged over
            :data:`EASY_TASK_KWARGS` when ``easy`` is true.
        easy: start from the tuned easy settings of :data:`EASY_TASK_KWARGS` (``False``: from
            reasoning-gym's own defaults, which a 135M model scores ~0 on).
        system_prompt: system message of every prompt; ``"{answer}"`` in it is replaced by what the
            answer is (``"the final number"`` or ``"the arithmetic expression"``). ``None`` leaves
            it to the chat template (SmolLM2's inserts "You are a helpful AI assistant named SmolLM").
        format_weight: reward added when the completion marks its answer explicitly (answer tags,
            ``\\boxed{}`` or "the answer is X"); ``0`` disables it.

    Example:
        >>> TaskConfig(name="chain_sum", task_kwargs={"max_terms": 3}).size
        256
    """

    name: str = "chain_sum"
    size: int = 256
    seed: int = 0
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    easy: bool = True
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    format_weight: float = 0.1

    def __post_init__(self) -> None:
        check(self.name in SUPPORTED_TASKS, "name", self.name, f"one of {sorted(SUPPORTED_TASKS)}")
        for name in ("size", "seed"):
            value, low = getattr(self, name), 1 if name == "size" else 0
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int >= {low}, got {value!r}")
            if value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.task_kwargs, dict) or not all(isinstance(k, str) for k in self.task_kwargs):
            raise TypeError(f"task_kwargs must be a dict with str keys, got {self.task_kwargs!r}")
        reserved = {"size", "seed"} & set(self.task_kwargs)
        if reserved:
            raise ValueError(
                f"task_kwargs must not set {sorted(reserved)}: use the TaskConfig fields size and seed"
            )
        if not isinstance(self.easy, bool):
            raise TypeError(f"easy must be a bool, got {self.easy!r}")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise TypeError(f"system_prompt must be a str or None, got {self.system_prompt!r}")
        weight = self.format_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise TypeError(f"format_weight must be a float in [0, 1], got {weight!r}")
        if not (math.isfinite(weight) and 0 <= weight <= 1):
            raise ValueError(f"format_weight must be a float in [0, 1], got {weight!r}")
        # Build only reasoning-gym's config (cheap, nothing generated) so a bad kwarg fails here; without
        # reasoning-gym, TaskDataset names the extra when a dataset is built.
        if importlib.util.find_spec("reasoning_gym") is None:
            return
        from reasoning_gym.factory import DATASETS

        _, config_cls = DATASETS[self.name]
        try:
            config_cls(**self.reasoning_gym_kwargs()).validate()
        except (TypeError, ValueError, AssertionError) as err:
            raise ValueError(
                f"task_kwargs {self.task_kwargs!r} are invalid for reasoning-gym task {self.name!r}: "
                f"{type(err).__name__}: {err}"
            ) from err

    @property
    def answer_kind(self) -> AnswerKind:
        """``"number"`` or ``"expression"``: how this task's answers are extracted."""
        return SUPPORTED_TASKS[self.name]

    def rendered_system_prompt(self) -> str | None:
        """The system message with ``{answer}`` filled in for this task, or ``None``."""
        if self.system_prompt is None:
            return None
        return self.system_prompt.replace("{answer}", ANSWER_DESCRIPTIONS[self.answer_kind])

    def reasoning_gym_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for ``reasoning_gym.create_dataset``, without size and seed."""
        base = EASY_TASK_KWARGS[self.name] if self.easy else {}
        return {**base, **self.task_kwargs}


@dataclass(frozen=True)
class Prompt:
    """One rendered prompt.

    Attributes:
        index: position in the dataset (pass it back to :meth:`TaskDataset.reward`).
        question: the reasoning-gym question.
        text: the chat-template rendering with the generation prompt appended.
        input_ids: ``text`` tokenized (special tokens come from the template, none are added).
        entry: the reasoning-gym entry (``question``, ``answer``, ``metadata``) used for scoring.
    """

    index: int
    question: str
    text: str
    input_ids: list[int]
    entry: dict[str, Any]


class Reward(NamedTuple):
    """A scored completion: ``total = correctness + format``.

    Attributes:
        total: the reward used for training, in ``[0, 1 + format_weight]``.
        correctness: the task's ``score_answer`` on the extracted answer, in ``[0, 1]``.
        format: ``format_weight`` when the answer was marked explicitly, else ``0``.
        answer: the extracted answer, ``None`` when none was found.
    """

    total: float
    correctness: float
    format: float
    answer: str | None


def collate_prompts(batch: list[Prompt]) -> list[Prompt]:
    """``collate_fn`` for a ``DataLoader`` over a :class:`TaskDataset`: keeps the prompts a list."""
    return list(batch)


class TaskDataset(Dataset):
    """Chat prompts from a reasoning-gym task, and the rewards of their completions.

    Args:
        config: the task, its size, seed, settings, system prompt and format weight.
        tokenizer: a Hugging Face tokenizer with a chat template (or any tokenizer whose
            ``decode(ids, skip_special_tokens=True)`` gives the completion's text, with ``render``).
        render: ``messages -> (text, input_ids)``, the chat rendering with the generation prompt;
            default the tokenizer's ``apply_chat_template`` (e.g.
            :func:`~tlt_lightning.rl.torchtune_module.torchtune_chat_render` for a torchtune tokenizer).

    Example:
        >>> ds = TaskDataset(TaskConfig(name="chain_sum", size=8), tokenizer)  # doctest: +SKIP
        >>> prompt = ds[0]  # doctest: +SKIP
        >>> ds.reward(0, f"The answer is {prompt.entry['answer']}.")  # doctest: +SKIP
        1.1
    """

    def __init__(
        self,
        config: TaskConfig,
        tokenizer: Any,
        render: Callable[[list[dict[str, str]]], tuple[str, list[int]]] | None = None,
    ) -> None:
        if not isinstance(config, TaskConfig):
            raise TypeError(f"config must be a TaskConfig, got {type(config).__name__}")
        if render is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has no chat_template: prompts are rendered "
                "with apply_chat_template, so use an instruct/chat tokenizer or set one"
            )
        self.config = config
        self.tokenizer = tokenizer
        self.render = render or self._apply_chat_template
        try:
            self.source = reasoning_gym().create_dataset(
                config.name, size=config.size, seed=config.seed, **config.reasoning_gym_kwargs()
            )
        except (TypeError, ValueError, AssertionError) as err:
            raise ValueError(f"reasoning-gym task {config.name!r} could not be created: {err}") from err
        # Entries and renderings are deterministic in (seed, index): cache them, the reward needs
        # the entry again after the rollout.
        self._prompts: dict[int, Prompt] = {}

    def __len__(self) -> int:
        return self.config.size

    def __getitem__(self, index: int) -> Prompt:
        index = self._check_index(index)
        prompt = self._prompts.get(index)
        if prompt is None:
            prompt = self._render(index)
            self._prompts[index] = prompt
        return prompt

    def _check_index(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index must be an int, got {type(index).__name__}")
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range for a task of size {len(self)}")
        return index % len(self)

    def _render(self, index: int) -> Prompt:
        try:
            entry = self.source[index]
        except (ValueError, AssertionError) as err:
            raise ValueError(
                f"reasoning-gym task {self.config.name!r} failed to generate prompt {index} with "
                f"{self.config.reasoning_gym_kwargs()!r}: {err}"
            ) from err
        messages = [{"role": "user", "content": entry["question"]}]
        system_prompt = self.config.rendered_system_prompt()
        if system_prompt is not None:
            messages.insert(0, {"role": "system", "content": system_prompt})
        text, input_ids = self.render(messages)
        return Prompt(index=index, question=entry["question"], text=text, input_ids=input_ids, entry=entry)

    def _apply_chat_template(self, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def score(self, prompt: int | Prompt, completion: str) -> Reward:
        """Score one completion, with the parts of its reward.

        Args:
            prompt: the prompt's index in this dataset, or the :class:`Prompt` itself.
            completion: the generated text, special tokens stripped.

        Returns:
            The :class:`Reward`: ``total = score_answer(extracted answer) + format bonus``.

        Raises:
            RuntimeError: the task's ``score_answer`` raised; the message names task and index.
        """
        if not isinstance(completion, str):
            raise TypeError(f"completion must be a str, got {type(completion).__name__}")
        item = prompt if isinstance(prompt, Prompt) else self[prompt]
        found = find_answer(completion, self.config.answer_kind)
        answer = found.answer if found else None
        try:
            correctness = float(self.source.score_answer(answer, item.entry))
        except Exception as err:  # any scorer failure: re-raise with the context to debug it
            raise RuntimeError(
                f"reasoning-gym task {self.config.name!r} failed to score prompt {item.index} "
                f"(extracted answer {answer!r}): {type(err).__name__}: {err}"
            ) from err
        followed = found is not None and found.source in EXPLICIT_SOURCES
        bonus = float(self.config.format_weight) if followed else 0.0
        return Reward(total=correctness + bonus, correctness=correctness, format=bonus, answer=answer)

    def reward(self, prompt: int | Prompt, completion: str) -> float:
        """The training reward of one completion (``score(prompt, completion).total``)."""
        return self.score(prompt, completion).total

    def rewards(self, prompts: Sequence[int | Prompt], completions: Sequence[str]) -> torch.Tensor:
        """Rewards of many completions at once.

        Args:
            prompts: ``[N]`` prompt indices (or prompts); repeat an index for each sample of a group.
            completions: ``[N]`` generated texts, aligned with ``prompts``.

        Returns:
            ``[N]`` float32 tensor of total rewards.
        """
        if len(prompts) != len(completions):
            raise ValueError(
                f"prompts and completions must have the same length, got {len(prompts)} and "
                f"{len(completions)}"
            )
        return torch.tensor([self.reward(p, c) for p, c in zip(prompts, completions)], dtype=torch.float32)


def task_prompts(tokenizer: Any, task: str, count: int, seed: int = 0) -> list[list[int]]:
    """``count`` real prompts of reasoning-gym ``task`` rendered with the model's chat template (token
    ids)."""
    dataset = TaskDataset(TaskConfig(name=task, size=count, seed=seed), tokenizer)
    return [list(dataset[i].input_ids) for i in range(count)]
