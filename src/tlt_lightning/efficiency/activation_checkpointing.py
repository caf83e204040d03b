"""Budgeted activation checkpointing: profile the blocks, choose the cheapest set that fits, apply it.

Checkpointing a block keeps only its output in the forward pass and recomputes the rest during
backward. Which blocks to checkpoint is a 0/1 knapsack: each block has a recompute cost (its
forward time) and a memory saving, and the peak activation memory must stay under a budget.

1. **profile** (:func:`~tlt_lightning.efficiency.activation_profile.profile_blocks`): per block the
   bytes it holds for backward, its output, its transient peak and its forward time, measured on a
   real forward pass, and the memory of the code between blocks;
2. **plan** (:mod:`~tlt_lightning.efficiency.activation_plan`): the exact optimum by dynamic
   programming, the static every-other-block baseline and a cost-benefit greedy. There is no learned
   (RL) policy: the DP is exact and takes milliseconds, so a learned policy could only match it
   (the reasons are in :mod:`~tlt_lightning.efficiency.activation_plan`);
3. **apply** (:func:`apply_activation_checkpointing`): the chosen blocks' ``forward`` goes through
   non-reentrant ``torch.utils.checkpoint``; the returned handle removes it again.

:class:`DynamicActivationCheckpointing` does all three;
:class:`~tlt_lightning.efficiency.callbacks.ActivationCheckpointingCallback` does it inside a Lightning
fit.

Example:
    >>> from tlt_lightning.models import load_model
    >>> model = load_model("tiny-llama").model.train()
    >>> ids = torch.randint(3, 128, (2, 32))
    >>> step = lambda: model(input_ids=ids, labels=ids, use_cache=False).loss
    >>> layers = list(model.model.layers)
    >>> profile = profile_blocks(layers, step)
    >>> plan = plan_optimal(profile, plan_static(profile).peak_bytes)  # static's memory, less recompute
    >>> handle = apply_activation_checkpointing(layers, plan)  # train as usual; handle.remove() undoes it
    >>> handle.remove()
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from typing_extensions import Self

from tlt_lightning.efficiency.activation_plan import plan_greedy, plan_optimal, plan_static
from tlt_lightning.efficiency.activation_profile import (
    ActivationCheckpointPlan,
    ActivationCheckpointProfile,
    BlockCost,
    Gap,
    profile_blocks,
)
from tlt_lightning.validation import check, is_int

__all__ = [
    "ActivationCheckpointHandle",
    "ActivationCheckpointPlan",
    "ActivationCheckpointProfile",
    "BlockCost",
    "DynamicActivationCheckpointing",
    "Gap",
    "apply_activation_checkpointing",
    "find_blocks",
    "is_activation_checkpointed",
    "plan_greedy",
    "plan_optimal",
    "plan_static",
    "profile_blocks",
]


def find_blocks(module: nn.Module, patterns: str | Sequence[str] | None = None) -> list[nn.Module]:
    """The candidate blocks of ``module``, in registration order (for transformers: execution order).

    Args:
        module: any module (a LightningModule, an HF model, the drafter).
        patterns: ``None``: the children of the longest ``nn.ModuleList`` (the decoder layers);
            else dotted module-name patterns where ``*`` matches one name segment, e.g.
            ``"model.layers.*"`` (layers) or ``["model.layers.*.self_attn", "model.layers.*.mlp"]``
            (attention and MLP sub-blocks).

    Raises:
        ValueError: no ``ModuleList`` (or two of the same, largest length), or a pattern that
            matches no module.

    Example:
        >>> from tlt_lightning.models import load_model
        >>> len(find_blocks(load_model("tiny-llama").model, "model.layers.*.mlp"))
        4
    """
    if patterns is None:
        lists = [
            (name, m) for name, m in module.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1
        ]
        if not lists:
            raise ValueError(
                f"patterns=None needs an nn.ModuleList of blocks in {type(module).__name__}; none found"
            )
        longest = max(len(m) for _, m in lists)
        names = [name for name, m in lists if len(m) == longest]
        if len(names) > 1:
            raise ValueError(
                f"patterns=None is ambiguous: ModuleLists {names} all have {longest} blocks; name one"
            )
        return list(dict(lists)[names[0]])
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    parts = [p.split(".") for p in patterns]
    found, unmatched = [], set(patterns)
    for name, m in module.named_modules():
        segments = name.split(".")
        for pattern, pat in zip(patterns, parts):
            if len(pat) == len(segments) and all(fnmatch.fnmatchcase(s, p) for s, p in zip(segments, pat)):
                found.append(m)
                unmatched.discard(pattern)
                break
    if unmatched:
        raise ValueError(f"patterns {sorted(unmatched)} match no module of {type(module).__name__}")
    return found


def is_activation_checkpointed(block: nn.Module) -> bool:
    """Whether :func:`apply_activation_checkpointing` wrapped this block's ``forward``."""
    return isinstance(block.__dict__.get("forward"), _CheckpointedForward)


class _CheckpointedForward:
    """A block's ``forward`` through non-reentrant ``torch.utils.checkpoint`` (when grad is on)."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward  # the bound original; deepcopy rebinds it to the copied module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # inference: nothing is saved, nothing to recompute
            return self.forward(*args, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


class ActivationCheckpointHandle:
    """Undoes :func:`apply_activation_checkpointing`: ``handle.remove()``, or use it as a context manager."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.blocks = blocks

    def remove(self) -> None:
        for block in self.blocks:
            if is_activation_checkpointed(block):
                del block.forward  # the class's forward shows through again
        self.blocks = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def apply_activation_checkpointing(
    blocks: Sequence[nn.Module], plan: ActivationCheckpointPlan | Sequence[bool]
) -> ActivationCheckpointHandle:
    """Checkpoint ``blocks[i]`` where the plan says so (module, parameters and state_dict unchanged).

    Call models with ``use_cache=False`` while training (as with any activation checkpointing: a
    KV cache would be written again by the recomputation). Dropout is recomputed with the same RNG
    state (``preserve_rng_state``), so gradients match training without checkpointing.

    Raises:
        ValueError: the plan's length differs from ``len(blocks)``, or a block is already checkpointed.
    """
    flags = plan.checkpointed if isinstance(plan, ActivationCheckpointPlan) else tuple(bool(c) for c in plan)
    if len(flags) != len(blocks):
        raise ValueError(f"plan must have one entry per block ({len(blocks)}), got {len(flags)}")
    chosen = [b for b, c in zip(blocks, flags) if c]
    if any(is_activation_checkpointed(b) for b in chosen):
        raise ValueError(
            "blocks are already checkpointed: remove the previous ActivationCheckpointHandle first"
        )
    for block in chosen:
        block.forward = _CheckpointedForward(block.forward)
    return ActivationCheckpointHandle(chosen)


# ------------------------------------------------------------------------------------ the policy
@dataclass(frozen=True)
class DynamicActivationCheckpointing:
    """Profile, plan (exact DP) and apply checkpointing under an activation-memory budget.

    Args:
        memory_budget: peak activation bytes allowed (as :mod:`~tlt_lightning.efficiency.memory`
            measures them), or ``None`` with ``budget_fraction``.
        budget_fraction: the budget as a fraction in ``(0, 1]`` of the peak without checkpointing.
        resolution: DP memory units (see :func:`plan_optimal`).
        repeats: timed profiling runs.

    Example:
        >>> policy = DynamicActivationCheckpointing(budget_fraction=0.6)
        >>> # plan, handle = policy.apply(list(model.model.layers), step)
    """

    memory_budget: int | None = None
    budget_fraction: float | None = None
    resolution: int = 4096
    repeats: int = 3

    def __post_init__(self) -> None:
        if (self.memory_budget is None) == (self.budget_fraction is None):
            raise ValueError(
                "give exactly one of memory_budget and budget_fraction, got "
                f"memory_budget={self.memory_budget!r}, "
                f"budget_fraction={self.budget_fraction!r}"
            )
        b = self.memory_budget
        check(b is None or (is_int(b) and b > 0), "memory_budget", b, "a positive int (bytes)")
        f = self.budget_fraction
        if f is not None and not (isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1):
            raise ValueError(f"budget_fraction must be a number in (0, 1], got {f!r}")
        for name in ("resolution", "repeats"):
            v = getattr(self, name)
            check(is_int(v) and v >= 1, name, v, "an int >= 1")

    def budget_bytes(self, profile: ActivationCheckpointProfile) -> int:
        if self.memory_budget is not None:
            return self.memory_budget
        return int(self.budget_fraction * profile.max_peak_bytes)

    def plan(self, profile: ActivationCheckpointProfile) -> ActivationCheckpointPlan:
        """The optimal plan for this budget (``ValueError`` naming ``memory_budget`` if none fits)."""
        budget = self.budget_bytes(profile)
        if self.budget_fraction is not None and budget < profile.min_peak_bytes:
            raise ValueError(
                f"budget_fraction={self.budget_fraction} gives memory_budget={budget} bytes, "
                f"below the minimum possible peak {profile.min_peak_bytes} bytes (fraction "
                f"{profile.min_peak_bytes / profile.max_peak_bytes:.3f}, every block checkpointed)"
            )
        return plan_optimal(profile, budget, self.resolution)

    def apply(
        self, blocks: Sequence[nn.Module], forward: Callable[[], Any]
    ) -> tuple[ActivationCheckpointPlan, ActivationCheckpointHandle]:
        """Profile ``blocks`` on ``forward()``, plan, and checkpoint the chosen blocks."""
        plan = self.plan(profile_blocks(blocks, forward, self.repeats))
        return plan, apply_activation_checkpointing(blocks, plan)
