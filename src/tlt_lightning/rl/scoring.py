"""Scoring a step's rollouts: the rewards GRPO trains on, refused when a reward function misbehaves.

A reward that raises, is missing, not a number, not finite or beyond ``max_abs_reward`` stops the run
with a :class:`RewardError` naming the task, the reward function and the prompt index.

Example:
    >>> from tlt_lightning.rl import TokenPromptSource
    >>> source = TokenPromptSource([[1, 2]], lambda prompt, completion: 0.5, name="half")
    >>> rewards = RewardBatch(torch.tensor([0.5, float("nan")]), torch.zeros(2))
    >>> indices = torch.zeros(2, dtype=torch.long)
    >>> check_rewards(rewards, indices, source, group_size=2, limit=1e6)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    tlt_lightning.rl.scoring.RewardError: the reward total of task 'half' is nan on prompt index 0
    (sample 1 of its group): rewards must be finite and within +-max_abs_reward=1e+06
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from tlt_lightning.rl.sources import PromptSource
from tlt_lightning.rollout import RolloutResult
from tlt_lightning.validation import UserError

__all__ = [
    "NonFiniteLossError",
    "RewardBatch",
    "RewardError",
    "agreed_rewards",
    "check_rewards",
    "score_rollouts",
]


class RewardError(RuntimeError, UserError):
    """A reward function raised or returned a non-finite value; the message names task and prompt."""


class NonFiniteLossError(FloatingPointError, UserError):
    """The loss or the gradient norm is not finite; raised before the optimizer step."""


class RewardBatch(NamedTuple):
    """Rewards of ``N = P * G`` completions, in rollout order.

    Attributes:
        total: ``[N]`` float32, the reward GRPO trains on.
        correctness: ``[N]`` float32, the task score alone (accuracy = share ``>= 1``: fully correct;
            reasoning-gym gives partial credit, e.g. countdown 0.01 for a well-formed wrong answer).
    """

    total: torch.Tensor
    correctness: torch.Tensor


def _reward_fn_name(source: Any) -> str:
    """`` (reward fn 'even_reward')`` for a source scored by a reward function, else ``""``."""
    fn = getattr(source, "reward_fn", None)
    if fn is None:
        return ""
    return f" (reward fn {getattr(fn, '__qualname__', type(fn).__name__)!r})"


def _reward_value(reward: Any, field: str, where: str, limit: float) -> float:
    """``reward.<field>`` as a float, refused (``RewardError``) when missing, not a number, not
    finite or beyond ``limit`` in absolute value (float32 sums of such rewards overflow to NaN)."""
    if reward is None or not hasattr(reward, field):
        raise RewardError(
            f"the reward of {where} is {reward!r}, not a Reward with .total and .correctness: "
            "the reward function must return a number (a PromptSource.score a Reward) for every completion"
        )
    value = getattr(reward, field)
    try:
        number = float(value)
    except (TypeError, ValueError) as err:
        raise RewardError(
            f"the reward {field} of {where} is {value!r}, not a number: the reward function must return "
            "a finite float for every completion"
        ) from err
    if not math.isfinite(number) or abs(number) > limit:
        raise RewardError(
            f"the reward {field} of {where} is {number!r}: rewards must be finite and within "
            f"+-max_abs_reward={limit:g}; fix the reward function (or raise GRPOModule(max_abs_reward=...) "
            "for a reward scale this large)"
        )
    return number


def score_rollouts(
    source: PromptSource, indices: torch.Tensor, result: RolloutResult, group_size: int, limit: float
) -> RewardBatch:
    """Score every rollout of ``result``; ``indices`` ``[N]`` are their prompts' dataset indices.

    Raises:
        RewardError: the prompt source raised or gave a bad reward; the message names task and prompt index.
    """
    total, correct = [], []
    for j, (index, r) in enumerate(zip(indices.tolist(), result.rollouts)):
        where = (
            f"task {source.name!r}{_reward_fn_name(source)} on prompt index {index} "
            f"(sample {j % group_size} of its group)"
        )
        try:
            reward = source.score(index, r.prompt_ids, r.token_ids)
        except Exception as err:  # user reward code: re-raise with where it failed
            raise RewardError(f"the reward of {where} failed: {type(err).__name__}: {err}") from err
        total.append(_reward_value(reward, "total", where, limit))
        correct.append(_reward_value(reward, "correctness", where, limit))
    return RewardBatch(torch.tensor(total, dtype=torch.float32), torch.tensor(correct, dtype=torch.float32))


def check_rewards(
    rewards: Any, indices: torch.Tensor, source: PromptSource, group_size: int, limit: float
) -> RewardBatch:
    """``rewards`` when it is a :class:`RewardBatch` of ``[N]`` finite values within ``+-limit``
    (also what an overridden ``compute_rewards`` returns).

    Raises:
        TypeError: not a :class:`RewardBatch`.
        ValueError: not one reward per rollout.
        RewardError: a value is not finite or beyond ``limit``; the message names task and prompt index.
    """
    if not isinstance(rewards, RewardBatch):
        raise TypeError(f"compute_rewards must return a RewardBatch, got {type(rewards).__name__}")
    if rewards.total.shape != indices.shape or rewards.correctness.shape != indices.shape:
        raise ValueError(
            f"compute_rewards must return [{indices.numel()}] rewards (one per rollout), got "
            f"total {list(rewards.total.shape)} and correctness {list(rewards.correctness.shape)}"
        )
    for field in ("total", "correctness"):
        values = getattr(rewards, field)
        bad = (~torch.isfinite(values) | (values.abs() > limit)).nonzero()
        if bad.numel():
            j = int(bad[0])
            raise RewardError(
                f"the reward {field} of task {source.name!r} is {float(values[j])} on prompt index "
                f"{int(indices[j])} (sample {j % group_size} of its group): "
                f"rewards must be finite and within +-max_abs_reward={limit:g}"
            )
    return rewards


def agreed_rewards(
    compute: Callable[[], Any],
    indices: torch.Tensor,
    source: PromptSource,
    group_size: int,
    limit: float,
    any_rank: Callable[[bool], bool],
) -> RewardBatch:
    """``compute()``'s rewards, checked (:func:`check_rewards`), with every rank stopping if any rank's
    failed.

    A failure is held until every rank knows (``any_rank``: whether the flag is set on any rank, a
    collective), so that none hangs in a later collective.

    Raises:
        RewardError: this rank's rewards failed (its own error is raised), or another rank's did.
    """
    error: Exception | None = None
    rewards = None
    try:
        rewards = check_rewards(compute(), indices, source, group_size, limit)
    except Exception as err:  # noqa: BLE001 -- held until every rank knows: none hangs in a collective
        error = err
    if any_rank(error is not None):
        if error is None:
            raise RewardError("stopping: the reward function failed on another rank (see its error)")
        raise error
    return rewards
