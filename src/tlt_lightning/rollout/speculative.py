"""SpeculativeRolloutLoop: rollouts with lossless speculative decoding in the tail.

The decode step it runs on :class:`~tlt_lightning.rollout.engine.RolloutEngine` is
:class:`~tlt_lightning.rollout.speculative_step.SpeculativeStep` (how drafts are made and verified).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from tlt_lightning.models.target import TargetModel
from tlt_lightning.rollout.drafting import DraftModel
from tlt_lightning.rollout.engine import RolloutEngine
from tlt_lightning.rollout.speculative_step import SpeculativeStep
from tlt_lightning.rollout.types import RolloutConfig, RolloutResult
from tlt_lightning.speculative import DraftSpec, DraftStrategy, as_strategy

__all__ = ["SpeculativeRolloutLoop", "SpeculativeStep"]

DEFAULT_STRATEGY = DraftSpec(4)
"""The arm a :class:`SpeculativeRolloutLoop` drafts with unless told otherwise: a 4-token chain."""


class SpeculativeRolloutLoop:
    """Runs rollouts of prompt batches with lossless speculative decoding in the tail.

    Args:
        target: the policy being sampled.
        drafter: an EAGLE-style drafter for it (a :class:`~tlt_lightning.rollout.drafting.DraftModel`, e.g.
            :class:`~tlt_lightning.drafter.Drafter`).
        config: sampling and length settings (``feature_layers`` are extended with the drafter's).
        strategy: picks the arm per step (see :class:`SpeculativeStep`); default: a 4-token chain
            whenever speculation is on.
        threshold: speculate only while fewer than this many requests are active.
        max_depth: deepest draft a strategy may ask for.
        drafter_context: ``"response"`` or ``"prompt"``, see :class:`SpeculativeStep`.

    Example:
        >>> from tlt_lightning.models import HFTarget, load_model
        >>> from tlt_lightning.drafter import Drafter, DrafterConfig
        >>> target = HFTarget(load_model("tiny-llama").model)
        >>> loop = SpeculativeRolloutLoop(target, Drafter(DrafterConfig.from_target(target), target),
        ...                               RolloutConfig(max_new_tokens=8, temperature=0))
        >>> loop.generate([[5, 6, 7]]).rollouts[0].length
        8
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: DraftModel,
        config: RolloutConfig | None = None,
        strategy: DraftStrategy | DraftSpec | None = DEFAULT_STRATEGY,
        threshold: int = 32,
        max_depth: int = 32,
        drafter_context: str = "response",
    ) -> None:
        config = config or RolloutConfig()
        layers = tuple(drafter.config.feature_layers)
        extra = tuple(i for i in config.feature_layers if i not in layers)
        self.config = replace(config, feature_layers=layers + extra)
        self.drafter = drafter
        self.strategy = as_strategy(strategy)
        self.threshold, self.max_depth, self.drafter_context = threshold, max_depth, drafter_context
        self.engine = RolloutEngine(target, self.config, cache_margin=max_depth + 1)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        generator: torch.Generator | None = None,
        progress: bool = False,
    ) -> RolloutResult:
        """Sample one response per prompt; same distribution as plain decoding, fewer target passes."""
        return self.engine.generate(prompts, generator=generator, step=self.decode_step(), progress=progress)

    def decode_step(self) -> SpeculativeStep:
        """A fresh decode step of this loop's settings (what :meth:`generate` runs; one per rollout)."""
        return SpeculativeStep(
            self.engine.target,
            self.drafter,
            self.config,
            self.strategy,
            self.threshold,
            self.max_depth,
            self.drafter_context,
        )
