"""Where an RL module's prompts come from and how their completions are scored.

A :class:`PromptSource` maps a dataset index to prompt token ids and scores a completion of that
prompt. Two implementations:

* :class:`TaskPromptSource`: a reasoning-gym :class:`~tlt_lightning.rl.tasks.TaskDataset`; the
  completion is decoded with the tokenizer and scored by the task (the real path).
* :class:`TokenPromptSource`: fixed token-id prompts and a :class:`RewardFn` on token ids, for tiny
  random models that have no tokenizer (tests, benchmarks of the machinery alone).
  :class:`SyntheticPromptSource` is one built from plain settings and a reward named in
  :data:`SYNTHETIC_REWARDS`, so a YAML config (``tlt-lightning fit``) can select it by ``class_path``.

:class:`PromptIndexLoader` is the ``DataLoader`` over prompt indices: it remembers how many
batches of the current epoch it has served, so a run resumed from a mid-epoch checkpoint sees the
same prompts as an uninterrupted one (Lightning saves and restores its ``state_dict``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader, Dataset

from tlt_lightning.rl.tasks import Reward, TaskDataset
from tlt_lightning.validation import check, is_int

__all__ = [
    "SYNTHETIC_REWARDS",
    "IndexDataset",
    "PromptIndexLoader",
    "PromptSource",
    "RewardFn",
    "SyntheticPromptSource",
    "TaskPromptSource",
    "TokenPromptSource",
    "copy_reward",
    "even_reward",
]


class RewardFn(Protocol):
    """A reward on token ids: ``reward_fn(prompt_ids [P], completion_ids [T]) -> float``."""

    def __call__(self, prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> float: ...


@runtime_checkable
class PromptSource(Protocol):
    """Prompts by index, and the reward of a completion of one of them.

    Attributes:
        name: names the task in logs and error messages.
    """

    name: str

    def __len__(self) -> int: ...

    def prompt_ids(self, index: int) -> list[int]:
        """Token ids of prompt ``index``."""
        ...

    def score(self, index: int, prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> Reward:
        """The reward of ``completion_ids`` (``[T]`` int64) as an answer to prompt ``index``."""
        ...


class TaskPromptSource:
    """A reasoning-gym task: chat prompts, completions decoded and scored by the task.

    Args:
        dataset: the task's prompts and scorer (its tokenizer decodes completions).

    Example:
        >>> source = TaskPromptSource(TaskDataset(TaskConfig(size=8), tokenizer))  # doctest: +SKIP
        >>> source.score(0, prompt, completion).total  # doctest: +SKIP
    """

    def __init__(self, dataset: TaskDataset) -> None:
        if not isinstance(dataset, TaskDataset):
            raise TypeError(f"dataset must be a TaskDataset, got {type(dataset).__name__}")
        self.dataset = dataset
        self.name = dataset.config.name

    def __len__(self) -> int:
        return len(self.dataset)

    def prompt_ids(self, index: int) -> list[int]:
        return self.dataset[index].input_ids

    def score(self, index: int, prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> Reward:
        text = self.dataset.tokenizer.decode(completion_ids.tolist(), skip_special_tokens=True)
        return self.dataset.score(index, text)


class TokenPromptSource:
    """Fixed token-id prompts scored by a reward function on token ids.

    The reward is its own correctness (``Reward(total=r, correctness=r)``), so "accuracy" in the
    logs is the share of completions with a reward of at least 1.

    Args:
        prompts: the prompts, each a non-empty sequence of token ids.
        reward_fn: scores a completion; must be picklable for DDP with spawned processes (a
            module-level function or an instance of a module-level class).
        name: names the task in logs and error messages.

    Example:
        >>> def even(prompt_ids, completion_ids):
        ...     return float((completion_ids % 2 == 0).float().mean())
        >>> source = TokenPromptSource([[5, 6, 7], [8, 9]], even)
        >>> source.score(0, torch.tensor([5, 6, 7]), torch.tensor([2, 3])).total
        0.5
    """

    def __init__(
        self, prompts: Sequence[Sequence[int]], reward_fn: RewardFn, name: str = "synthetic"
    ) -> None:
        if len(prompts) == 0:
            raise ValueError("prompts is empty: pass at least one prompt (a list of token ids)")
        if not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
        self.prompts = [[int(t) for t in p] for p in prompts]
        for i, p in enumerate(self.prompts):
            if not p:
                raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
        self.reward_fn = reward_fn
        self.name = name

    def __len__(self) -> int:
        return len(self.prompts)

    def prompt_ids(self, index: int) -> list[int]:
        return self.prompts[index]

    def score(self, index: int, prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> Reward:
        value = self.reward_fn(prompt_ids, completion_ids)
        if value is None or isinstance(value, (str, bytes)):
            fn = getattr(self.reward_fn, "__qualname__", type(self.reward_fn).__name__)
            raise TypeError(
                f"reward_fn {fn!r} returned {value!r}: it must return a float for every "
                "completion (a missing `return`?)"
            )
        r = float(value)
        return Reward(total=r, correctness=r, format=0.0, answer=None)


def even_reward(prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> float:
    """Share of even token ids in the completion (``0`` for an empty one): varies within a group."""
    if completion_ids.numel() == 0:
        return 0.0
    return float((completion_ids % 2 == 0).float().mean())


def copy_reward(prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> float:
    """Share of completion positions ``t`` that repeat the prompt: ``completion[t] == prompt[t % P]``."""
    if completion_ids.numel() == 0 or prompt_ids.numel() == 0:
        return 0.0
    t = torch.arange(completion_ids.numel())
    return float((completion_ids == prompt_ids[t % prompt_ids.numel()]).float().mean())


# Module-level functions, so sources built from them pickle for DDP with spawned processes.
SYNTHETIC_REWARDS: dict[str, RewardFn] = {"copy": copy_reward, "even": even_reward}

# Ids below this are the tiny models' pad / bos / eos (0, 1, 2): prompts never contain them.
_FIRST_SYNTHETIC_ID = 3


class SyntheticPromptSource(TokenPromptSource):
    """Random token-id prompts scored by a reward named in :data:`SYNTHETIC_REWARDS`.

    A :class:`TokenPromptSource` built from plain settings (no callables), so a config file can
    select it: ``prompt_source: {class_path: tlt_lightning.rl.SyntheticPromptSource, init_args:
    {reward: even}}``. Prompt ids are drawn uniformly from ``[3, vocab_size)`` (ids 0-2 are the
    tiny models' pad, bos and eos) with a generator seeded by ``seed``.

    Args:
        reward: a key of :data:`SYNTHETIC_REWARDS` (``"even"``: share of even ids; ``"copy"``:
            share of positions that repeat the prompt).
        num_prompts: number of distinct prompts.
        prompt_length: tokens per prompt.
        vocab_size: the model's vocabulary size (``128`` for the tiny registry models).
        seed: seeds the prompts.

    Example:
        >>> source = SyntheticPromptSource("even", num_prompts=4, prompt_length=3)
        >>> len(source), source.name
        (4, 'synthetic:even')
    """

    def __init__(
        self,
        reward: str = "even",
        num_prompts: int = 16,
        prompt_length: int = 4,
        vocab_size: int = 128,
        seed: int = 0,
    ) -> None:
        check(reward in SYNTHETIC_REWARDS, "reward", reward, f"one of {sorted(SYNTHETIC_REWARDS)}")
        for name, value, low in (
            ("num_prompts", num_prompts, 1),
            ("prompt_length", prompt_length, 1),
            ("vocab_size", vocab_size, _FIRST_SYNTHETIC_ID + 1),
            ("seed", seed, 0),
        ):
            check(is_int(value) and value >= low, name, value, f"an int >= {low}")
        generator = torch.Generator().manual_seed(seed)
        shape = (num_prompts, prompt_length)
        prompts = torch.randint(_FIRST_SYNTHETIC_ID, vocab_size, shape, generator=generator)
        super().__init__(prompts.tolist(), SYNTHETIC_REWARDS[reward], name=f"synthetic:{reward}")


class IndexDataset(Dataset):
    """The integers ``0 .. size - 1``: a dataset of prompt indices."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} is out of range for {self.size} prompts")
        return index


class PromptIndexLoader(DataLoader):
    """A ``DataLoader`` that can resume mid-epoch: it skips the batches it had served when saved.

    Lightning stores the ``state_dict`` of loaders that have one in the checkpoint and loads it
    back before iterating, so with a deterministic sampler (sequential, or Lightning's
    ``DistributedSampler`` without shuffling) the resumed run gets exactly the prompts the
    uninterrupted run would have. Skipped batches are only indices: skipping costs nothing.
    Lightning fetches nothing ahead for loaders with a length, so "served" is "trained on".
    Its iterators draw their base seed from a private generator (default), not from torch's global
    one: a resumed run creates an iterator where the uninterrupted one did not, and that draw would
    shift every later use of the global RNG.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("generator") is None:
            kwargs["generator"] = torch.Generator().manual_seed(0)
        super().__init__(*args, **kwargs)
        self._served = 0
        self._skip = 0

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        self._served = 0
        for i, batch in enumerate(super().__iter__()):
            self._served += 1
            if i >= skip:
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"served": self._served}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        served = int(state_dict.get("served", 0))
        # A finished epoch restarts at its beginning: the next one.
        self._skip = served % len(self) if len(self) else 0
