"""Online drafter training data: the rollouts' own tokens and target features, bounded by memory.

The rollout engine already returns, per generated token, the target's hidden states at the position
that predicted it (``RolloutConfig.feature_layers = drafter.config.rollout_feature_layers``), so
harvesting training data costs no extra target forward: :meth:`RolloutBuffer.add` keeps a compact
copy (bf16 by default) tagged with the policy step that produced it. The buffer evicts the oldest
rollouts first when it exceeds its memory budget, and :meth:`RolloutBuffer.sample` prefers recent
policy steps (weight ``decay ** (current_step - step)``), so the drafter follows the moving policy.

Records are :class:`DrafterSample` objects, which :func:`~tlt_lightning.drafter.make_batches` and
:func:`~tlt_lightning.drafter.pack_batches` accept in place of rollouts.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tlt_lightning.rollout.types import Rollout

__all__ = ["BufferConfig", "DrafterSample", "RolloutBuffer"]

_MB = 1024 * 1024


@dataclass(frozen=True, eq=False)  # eq on tensors is ambiguous: identity comparison
class DrafterSample:
    """One harvested rollout, as drafter training data (duck-compatible with :class:`Rollout`).

    Attributes:
        prompt_ids: ``[P]`` int64 prompt tokens (only their count is used: it fixes the positions).
        token_ids: ``[T]`` int64 generated tokens.
        features: ``[T, C, H]`` target features at the position that predicted each token.
        step: the policy step that generated the rollout.
    """

    prompt_ids: torch.Tensor
    token_ids: torch.Tensor
    features: torch.Tensor
    step: int

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.prompt_ids, self.token_ids, self.features))


@dataclass(frozen=True)
class BufferConfig:
    """Memory bound, storage and sampling preference of a :class:`RolloutBuffer`.

    Args:
        max_mb: memory budget in MiB (tokens and features together); the oldest rollouts are evicted
            beyond it. A single rollout larger than the whole budget is dropped (and counted).
        decay: sampling weight of a rollout is ``decay ** (current_step - step)``; in ``(0, 1]``,
            ``1`` samples uniformly.
        dtype: storage dtype of the features (bf16 halves the memory of fp32 targets).
        device: where the features are kept (``"cpu"`` keeps accelerator memory for the rollout).

    Example:
        >>> BufferConfig(max_mb=512, decay=0.5).decay
        0.5
    """

    max_mb: float = 256.0
    decay: float = 0.5
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"

    def __post_init__(self) -> None:
        if isinstance(self.max_mb, bool) or not isinstance(self.max_mb, (int, float)) or not self.max_mb > 0:
            raise ValueError(f"max_mb must be a number > 0, got {self.max_mb!r}")
        if not math.isfinite(self.max_mb):
            raise ValueError(f"max_mb must be finite, got {self.max_mb!r}")
        if (
            isinstance(self.decay, bool)
            or not isinstance(self.decay, (int, float))
            or not 0 < self.decay <= 1
        ):
            raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {self.dtype!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(
                f"device must be a torch device string such as 'cpu', got {self.device!r}"
            ) from err


class RolloutBuffer:
    """A FIFO of harvested rollouts bounded by memory, sampled with a preference for recent steps.

    Thread-safe: the rollout side may :meth:`add` while a training loop :meth:`sample` s.

    Args:
        config: budget, decay, storage dtype and device.

    Example:
        >>> # buffer = RolloutBuffer(BufferConfig(max_mb=256, decay=0.5))
        >>> # buffer.add(result.rollouts, step=trainer.global_step)
        >>> # batches = make_batches(buffer.sample(64, generator), drafter.config, batch_size=8)
    """

    def __init__(self, config: BufferConfig | None = None) -> None:
        self.config = config or BufferConfig()
        self._items: deque[DrafterSample] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self._shape: tuple[int, int] | None = None  # (C, H) of the first rollout: all must agree
        self.current_step = 0
        self.added = 0
        self.evicted = 0
        self.dropped = 0

    # ------------------------------------------------------------------------------ size
    def __len__(self) -> int:
        return len(self._items)

    @property
    def size_mb(self) -> float:
        """Memory held by the stored tensors, in MiB."""
        return self._bytes / _MB

    @property
    def num_tokens(self) -> int:
        with self._lock:
            return sum(item.length for item in self._items)

    def stats(self) -> dict[str, float]:
        """Size and counters, for logging."""
        with self._lock:
            steps = [item.step for item in self._items]
            return {
                "rollouts": float(len(self._items)),
                "tokens": float(sum(item.length for item in self._items)),
                "size_mb": self.size_mb,
                "max_mb": float(self.config.max_mb),
                "added": float(self.added),
                "evicted": float(self.evicted),
                "dropped": float(self.dropped),
                "oldest_step": float(min(steps)) if steps else float("nan"),
                "newest_step": float(max(steps)) if steps else float("nan"),
            }

    # ------------------------------------------------------------------------------ writing
    def add(self, rollouts: Iterable[Rollout | DrafterSample], step: int) -> int:
        """Store the rollouts of policy step ``step`` (a compact copy of their tokens and features).

        Rollouts with fewer than 2 tokens hold no training sample and are skipped; one larger
        than the whole budget is dropped. ``step`` also advances :attr:`current_step`.

        Args:
            rollouts: rollouts generated with features (``RolloutConfig.feature_layers``).
            step: the policy step (e.g. ``trainer.global_step``), ``>= 0``.

        Returns:
            How many rollouts were stored.

        Raises:
            ValueError: a negative step, a rollout without features, or features whose ``[C, H]``
                differ from the rollouts already stored.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        budget = int(self.config.max_mb * _MB)
        stored = 0
        for i, rollout in enumerate(rollouts):
            sample = self._compact(rollout, i, step)
            if sample is None:
                continue
            with self._lock:
                if sample.nbytes > budget:
                    self.dropped += 1
                    continue
                self._items.append(sample)
                self._bytes += sample.nbytes
                while self._bytes > budget:
                    old = self._items.popleft()
                    self._bytes -= old.nbytes
                    self.evicted += 1
                self.added += 1
                stored += 1
        with self._lock:
            self.current_step = max(self.current_step, step)
        return stored

    def _compact(self, rollout: Rollout | DrafterSample, index: int, step: int) -> DrafterSample | None:
        feats = rollout.features
        if feats is None:
            raise ValueError(
                f"rollouts[{index}] has no features: generate with RolloutConfig.feature_layers="
                "drafter.config.rollout_feature_layers"
            )
        T = rollout.token_ids.numel()
        if feats.dim() != 3 or feats.shape[0] != T:
            raise ValueError(f"rollouts[{index}].features must be [T={T}, C, H], got {list(feats.shape)}")
        shape = (int(feats.shape[1]), int(feats.shape[2]))
        with self._lock:
            self._shape = self._shape or shape
        if shape != self._shape:
            raise ValueError(
                f"rollouts[{index}].features have [C, H] = {list(shape)}, "
                f"the buffer holds {list(self._shape)}"
            )
        if T < 2:
            return None
        device = torch.device(self.config.device)
        # copy=True: a rollout's features may be a view of the engine's whole transcript tensor.
        return DrafterSample(
            prompt_ids=rollout.prompt_ids.detach().to(device, torch.long, copy=True),
            token_ids=rollout.token_ids.detach().to(device, torch.long, copy=True),
            features=feats.detach().to(device, self.config.dtype, copy=True).contiguous(),
            step=step,
        )

    def set_step(self, step: int) -> None:
        """Advance the policy step that sampling weights are relative to (without adding data)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        with self._lock:
            self.current_step = max(self.current_step, step)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    # ------------------------------------------------------------------------------ reading
    def weights(self) -> torch.Tensor:
        """``[N]`` float64 sampling probabilities of the stored rollouts (oldest first)."""
        with self._lock:
            return self._log_weights(list(self._items)).softmax(0)

    def _log_weights(self, items: list[DrafterSample]) -> torch.Tensor:
        age = torch.tensor([self.current_step - item.step for item in items], dtype=torch.float64)
        return age.clamp(min=0) * math.log(self.config.decay)  # log space: never underflows to 0

    def sample(
        self, n: int, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32
    ) -> list[DrafterSample]:
        """Draw ``min(n, len(self))`` distinct rollouts, recent policy steps preferred.

        Sampling is without replacement with probabilities proportional to
        ``decay ** (current_step - step)`` (Gumbel top-k, so very old entries keep a tiny, nonzero
        chance instead of underflowing).

        Args:
            n: rollouts wanted (``>= 0``).
            generator: CPU random source.
            dtype: dtype of the returned features (the drafter's compute dtype; the stored copy is
                not modified).

        Returns:
            Records for :func:`make_batches` / :func:`pack_batches`, in sampled order.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        with self._lock:
            items = list(self._items)
            log_w = self._log_weights(items)
        if not items or n == 0:
            return []
        u = torch.rand(len(items), generator=generator, dtype=torch.float64).clamp_(min=1e-300)
        keys = log_w - torch.log(-torch.log(u))  # + Gumbel(0, 1)
        picked = keys.topk(min(n, len(items))).indices.tolist()
        return [
            DrafterSample(items[i].prompt_ids, items[i].token_ids, items[i].features.to(dtype), items[i].step)
            for i in picked
        ]

    # ------------------------------------------------------------------------------ state
    def state_dict(self, include_data: bool = False) -> dict[str, Any]:
        """Counters (small); with ``include_data`` also the stored tensors.

        By default the data is not checkpointed: it can be hundreds of MB, and after a resume the
        next rollout refills the buffer with data from the current policy, which is what the
        drafter should train on anyway.
        """
        with self._lock:
            state: dict[str, Any] = {
                "current_step": self.current_step,
                "added": self.added,
                "evicted": self.evicted,
                "dropped": self.dropped,
            }
            if include_data:
                state["items"] = [
                    {
                        "prompt_ids": s.prompt_ids,
                        "token_ids": s.token_ids,
                        "features": s.features,
                        "step": s.step,
                    }
                    for s in self._items
                ]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters (missing keys keep their current values) and data when present."""
        items = state.get("items")
        with self._lock:
            for key in ("current_step", "added", "evicted", "dropped"):
                if key in state:
                    setattr(self, key, int(state[key]))
        if items is not None:
            self.clear()
            for item in items:
                self._restore(item)

    def _restore(self, item: dict[str, Any]) -> None:
        sample = self._compact(
            DrafterSample(item["prompt_ids"], item["token_ids"], item["features"], int(item["step"])),
            0,
            int(item["step"]),
        )
        if sample is None:
            return
        budget = int(self.config.max_mb * _MB)
        with self._lock:
            self._items.append(sample)
            self._bytes += sample.nbytes
            while self._bytes > budget:  # a smaller budget than the run that saved it
                self._bytes -= self._items.popleft().nbytes
