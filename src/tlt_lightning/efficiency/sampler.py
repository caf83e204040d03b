"""Importance sampling of training batches: score many candidates with a proxy, keep the informative.

Each batch draws ``candidate_factor x batch_size`` candidate examples uniformly (without
replacement), scores them (:class:`LossScorer`: a small proxy model's per-example loss;
:class:`RhoLossScorer`: RHO-LOSS, the training model's loss minus the loss of a proxy trained on
held-out data, so examples that are learnable but not yet learnt win over noisy or already-known
ones) and samples the batch from ``softmax(score / temperature)`` without replacement, by Gumbel
top-k (the same distribution as drawing one candidate at a time and renormalising).

:class:`ImportanceSampler` is a ``batch_sampler`` for a ``DataLoader`` (and so for any
LightningDataModule); :class:`~tlt_lightning.efficiency.training.ImportanceSamplingCallback`
logs its choices and can keep a small proxy in step with the learner. Selected examples are not
re-weighted: like RHO-LOSS, the sampler changes what is learnt first, it is not an unbiased
estimate of the uniform-batch gradient.

Distributed (DDP): every rank runs its own sampler over the whole dataset, each with its own random
stream (seeded from the seed, the rank and the batch number), so ranks pick different batches, and
every rank's stream is reproducible and resumes exactly from the batch count alone. Ranks sample
independently: an example can now and then be picked on two ranks in the same step. Lightning
cannot put its ``DistributedSampler`` into this batch sampler: use ``Trainer(use_distributed_sampler=False)``.

Example:
    >>> from torch.utils.data import DataLoader
    >>> scorer = LossScorer(proxy, dataset, collate)  # doctest: +SKIP
    >>> config = ImportanceSamplerConfig(batch_size=32)
    >>> sampler = ImportanceSampler(len(dataset), scorer, config)  # doctest: +SKIP
    >>> loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Sampler

from tlt_lightning.validation import check, is_int, is_number

__all__ = [
    "ImportanceSampler",
    "ImportanceSamplerConfig",
    "LossScorer",
    "RhoLossScorer",
    "Scorer",
    "SelectionStats",
    "per_example_loss",
    "sample_without_replacement",
    "selection_probabilities",
]


@dataclass(frozen=True)
class ImportanceSamplerConfig:
    """How many candidates to score and how sharply to prefer high scores.

    Args:
        batch_size: examples per batch (>= 1).
        candidate_factor: candidates scored per batch, as a multiple of ``batch_size`` (>= 1; the
            source uses 10). ``1`` keeps every candidate: uniform sampling, no scoring needed.
        temperature: softmax temperature over scores (> 0); large is close to uniform, small close
            to "take the top ``batch_size``".
        num_batches: batches per epoch; ``None``: ``dataset_size // batch_size`` (at least 1).
        seed: seed of the candidate draws and of the Gumbel noise (each rank's stream derives from
            it and the rank).

    Example:
        >>> ImportanceSamplerConfig(batch_size=8).num_candidates
        80
    """

    batch_size: int
    candidate_factor: float = 10
    temperature: float = 1.0
    num_batches: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check(is_int(self.batch_size) and self.batch_size >= 1, "batch_size", self.batch_size, "an int >= 1")
        if not is_number(self.candidate_factor) or self.candidate_factor < 1:
            raise ValueError(f"candidate_factor must be a finite number >= 1, got {self.candidate_factor!r}")
        if not is_number(self.temperature) or self.temperature <= 0:
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        n = self.num_batches
        check(n is None or (is_int(n) and n >= 1), "num_batches", n, "an int >= 1 or None")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {self.seed!r}")

    @property
    def num_candidates(self) -> int:
        """Candidates per batch: ``ceil(candidate_factor * batch_size)``."""
        return math.ceil(self.candidate_factor * self.batch_size - 1e-9)


def _check_temperature(temperature: float) -> None:
    if not is_number(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def selection_probabilities(scores: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Probability of each candidate being drawn first: ``softmax(scores / temperature)``.

    Args:
        scores: ``[..., N]`` candidate scores (higher: more likely).
        temperature: > 0.

    Returns:
        ``[..., N]`` probabilities summing to 1 over the last dimension.
    """
    _check_temperature(temperature)
    return torch.softmax(scores.float() / temperature, dim=-1)


def sample_without_replacement(
    scores: torch.Tensor, k: int, temperature: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Draw ``k`` distinct candidates from ``softmax(scores / temperature)`` (Gumbel top-k).

    The top ``k`` of ``scores / temperature + Gumbel noise`` have the law of ``k`` sequential draws
    without replacement, each from the softmax renormalised over the candidates left.

    Args:
        scores: ``[..., N]`` finite scores.
        k: draws per row, ``1 <= k <= N``.
        temperature: > 0.
        generator: source of the noise (CPU generator; the noise is moved to ``scores.device``).

    Returns:
        ``[..., k]`` int64 candidate positions, distinct within a row, in draw order.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> sample_without_replacement(torch.tensor([0.0, 5.0, 0.0, 5.0]), 2, 0.1, g).sort().values
        tensor([1, 3])
    """
    _check_temperature(temperature)
    n = scores.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k must be an int in [1, {n}] (the number of candidates), got {k!r}")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("scores must be finite: a NaN or infinite loss cannot be ranked")
    # -log(Exp(1)) is Gumbel(0, 1); exponential_ takes a generator on every torch we support.
    noise = -torch.empty(scores.shape, dtype=torch.float64).exponential_(generator=generator).log()
    keys = scores.double() / temperature + noise.to(scores.device)
    return keys.topk(k, dim=-1).indices


def per_example_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy of each sequence over its labelled positions.

    Args:
        logits: ``[B, T, V]`` causal-LM logits (position ``t`` predicts token ``t + 1``).
        labels: ``[B, T]`` token ids, ``ignore_index`` where there is no target (prompt, padding).

    Returns:
        ``[B]`` float32 mean loss per sequence (0 for a sequence with no labelled position).
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] and labels [B, T], got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    targets = labels[:, 1:]
    token_loss = F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), targets, ignore_index=ignore_index, reduction="none"
    )  # [B, T-1]
    count = (targets != ignore_index).sum(-1)
    return token_loss.sum(-1) / count.clamp(min=1)


def _model_logits(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    return out if isinstance(out, torch.Tensor) else out.logits


def _batch_losses(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    device = next(model.parameters()).device
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    was_training = model.training
    model.eval()  # no dropout while scoring
    try:
        with torch.no_grad():
            return per_example_loss(_model_logits(model, batch), batch["labels"]).cpu()
    finally:
        model.train(was_training)


class Scorer(Protocol):
    """Scores dataset examples by index: ``[N]`` indices -> ``[N]`` float scores (higher: pick more)."""

    def __call__(self, indices: Sequence[int]) -> torch.Tensor: ...


class LossScorer:
    """A model's per-example loss (:func:`per_example_loss`) as the score, computed without gradients.

    Args:
        model: the proxy (a small model), or the training model itself; called as
            ``model(input_ids=, attention_mask=)``, returning logits or an object with ``.logits``.
        dataset: indexable examples.
        collate_fn: list of examples -> dict with ``input_ids`` and ``labels`` ``[B, T]`` (and
            optionally ``attention_mask``); labels are ``-100`` where nothing is predicted.
        chunk_size: candidates per forward pass (bounds the scoring memory); ``None``: all at once.
    """

    def __init__(
        self,
        model: nn.Module,
        dataset: Any,
        collate_fn: Callable[[list[Any]], Mapping[str, torch.Tensor]],
        chunk_size: int | None = None,
    ) -> None:
        check(
            chunk_size is None or (is_int(chunk_size) and chunk_size >= 1),
            "chunk_size",
            chunk_size,
            "an int >= 1 or None",
        )
        self.model, self.dataset, self.collate_fn, self.chunk_size = model, dataset, collate_fn, chunk_size

    def losses(self, model: nn.Module, indices: Sequence[int]) -> torch.Tensor:
        """``[N]`` per-example losses of ``model`` on these examples."""
        step = self.chunk_size or max(len(indices), 1)
        parts = [
            _batch_losses(model, self.collate_fn([self.dataset[i] for i in indices[s : s + step]]))
            for s in range(0, len(indices), step)
        ]
        return torch.cat(parts) if parts else torch.zeros(0)

    def __call__(self, indices: Sequence[int]) -> torch.Tensor:
        return self.losses(self.model, indices)


class RhoLossScorer(LossScorer):
    """RHO-LOSS: ``loss(model) - loss(holdout_model)``, the reducible held-out loss of each example.

    ``model`` is the model being trained (or a proxy of it); ``holdout_model`` a small model
    trained on held-out data of the same task. Its losses (the "irreducible" part) do not change,
    so they are computed once per example and cached.

    Example:
        >>> scorer = RhoLossScorer(learner, holdout_proxy, dataset, collate)  # doctest: +SKIP
    """

    def __init__(
        self,
        model: nn.Module,
        holdout_model: nn.Module,
        dataset: Any,
        collate_fn: Callable[[list[Any]], Mapping[str, torch.Tensor]],
        chunk_size: int | None = None,
    ) -> None:
        super().__init__(model, dataset, collate_fn, chunk_size)
        self.holdout_model = holdout_model
        self._irreducible: dict[int, float] = {}

    def irreducible(self, indices: Sequence[int]) -> torch.Tensor:
        """``[N]`` held-out model losses (cached per index)."""
        missing = [i for i in dict.fromkeys(indices) if i not in self._irreducible]
        if missing:
            self._irreducible.update(zip(missing, self.losses(self.holdout_model, missing).tolist()))
        return torch.tensor([self._irreducible[i] for i in indices], dtype=torch.float32)

    def __call__(self, indices: Sequence[int]) -> torch.Tensor:
        return self.losses(self.model, indices) - self.irreducible(indices)


class SelectionStats(NamedTuple):
    """What one batch's selection did (logged by the callback).

    Attributes:
        candidate_score: mean score over the candidates.
        selected_score: mean score over the selected examples.
        max_probability: largest first-draw probability (1/N: uniform; near 1: one example dominates).
    """

    candidate_score: float
    selected_score: float
    max_probability: float


def _batch_seed(seed: int, rank: int, batch: int) -> int:
    digest = hashlib.sha256(f"{seed}:{rank}:{batch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class ImportanceSampler(Sampler[list[int]]):
    """A ``batch_sampler`` that yields batches of dataset indices picked by importance.

    Iterate it in the process that owns the scorer's model (``DataLoader`` workers only load the
    examples; the batch sampler always runs in the main process).

    Batch ``b`` (counted over the sampler's life, across epochs) draws its candidates and its Gumbel
    noise from a generator seeded with ``(config.seed, rank, b)``: the state is the batch count
    alone, the same on every rank, so a Lightning checkpoint (which keeps rank 0's callback state)
    resumes every rank's own stream exactly. Under DDP pass ``Trainer(use_distributed_sampler=False)``.

    Args:
        dataset_size: number of examples (indices ``0 .. dataset_size - 1``).
        scorer: ``indices -> [N] scores`` (:class:`LossScorer`, :class:`RhoLossScorer`, or any
            callable); not called when ``candidate_factor`` leaves no choice.
        config: batch size, candidate factor, temperature, epoch length, seed.
        rank: this process's rank (>= 0), which picks its random stream; ``None``: the
            ``torch.distributed`` rank when a process group is initialised when iteration starts
            (so a sampler built before DDP starts still gets each rank's own), else 0.

    Attributes:
        last_stats: the :class:`SelectionStats` of the latest batch (``None`` before the first).
        batches_drawn: batches drawn so far (the random state).

    Example:
        >>> scores = lambda idx: torch.tensor([float(i) for i in idx])  # prefer high indices
        >>> sampler = ImportanceSampler(100, scores, ImportanceSamplerConfig(batch_size=4, temperature=0.01))
        >>> batch = next(iter(sampler))
        >>> len(batch), len(set(batch))
        (4, 4)
    """

    def __init__(
        self,
        dataset_size: int,
        scorer: Scorer | Callable[[Sequence[int]], torch.Tensor],
        config: ImportanceSamplerConfig,
        rank: int | None = None,
    ) -> None:
        if not isinstance(config, ImportanceSamplerConfig):
            raise TypeError(f"config must be an ImportanceSamplerConfig, got {type(config).__name__}")
        if (
            isinstance(dataset_size, bool)
            or not isinstance(dataset_size, int)
            or dataset_size < config.batch_size
        ):
            raise ValueError(
                f"dataset_size must be an int >= batch_size ({config.batch_size}), got {dataset_size!r}"
            )
        if not callable(scorer):
            raise TypeError(f"scorer must be callable (indices -> scores), got {type(scorer).__name__}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ValueError(f"rank must be an int >= 0 or None (the torch.distributed rank), got {rank!r}")
        self.dataset_size, self.scorer, self.config, self.rank = dataset_size, scorer, config, rank
        self.last_stats: SelectionStats | None = None
        self.batches_drawn = 0

    def current_rank(self) -> int:
        """``rank`` if given, else the ``torch.distributed`` rank when initialised, else 0."""
        if self.rank is not None:
            return self.rank
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def batch_generator(self, batch: int, rank: int | None = None) -> torch.Generator:
        """The CPU generator of batch number ``batch`` on ``rank`` (default :meth:`current_rank`)."""
        rank = self.current_rank() if rank is None else rank
        return torch.Generator().manual_seed(_batch_seed(self.config.seed, rank, batch))

    def __len__(self) -> int:
        return self.config.num_batches or max(self.dataset_size // self.config.batch_size, 1)

    def select(self, candidates: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Score ``[N]`` candidate indices and return the ``[batch_size]`` chosen ones (draw order).

        ``generator``: source of the Gumbel noise (default: the next batch's, :meth:`batch_generator`).
        """
        k = self.config.batch_size
        if len(candidates) == k:  # nothing to choose: skip the scorer
            self.last_stats = SelectionStats(float("nan"), float("nan"), 1.0 / k)
            return candidates
        scores = torch.as_tensor(self.scorer(candidates.tolist()), dtype=torch.float32).flatten()
        if scores.shape != candidates.shape:
            raise ValueError(f"scorer returned {tuple(scores.shape)} scores for {len(candidates)} candidates")
        if generator is None:
            generator = self.batch_generator(self.batches_drawn)
        pick = sample_without_replacement(scores, k, self.config.temperature, generator)
        probs = selection_probabilities(scores, self.config.temperature)
        self.last_stats = SelectionStats(float(scores.mean()), float(scores[pick].mean()), float(probs.max()))
        return candidates[pick]

    def __iter__(self) -> Iterator[list[int]]:
        m = min(self.config.num_candidates, self.dataset_size)
        rank = self.current_rank()  # once per epoch: the process group exists by the time DDP iterates
        for _ in range(len(self)):
            generator = self.batch_generator(self.batches_drawn, rank)
            candidates = torch.randperm(self.dataset_size, generator=generator)[:m]
            self.batches_drawn += 1
            yield self.select(candidates, generator).tolist()

    def state_dict(self) -> dict[str, Any]:
        """``{"batches_drawn"}``: with the seed and the rank, all a resumed sampler needs (on every rank)."""
        return {"batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume after ``state["batches_drawn"]`` batches; missing keys keep the current count.

        A ``"generator"`` entry (saved by versions that kept one stream per sampler) is ignored.
        """
        self.batches_drawn = int(state.get("batches_drawn", self.batches_drawn))
