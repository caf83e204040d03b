"""The models a :class:`~tlt_lightning.rl.GRPOModule`'s rollouts run on, and what runs them.

The rollouts sample from the policy itself or from its ``rollout_dtype`` mirror (:func:`rollout_models`),
with the linear weights laid out for fast decoding (:func:`apply_weight_layout`), and draft with the
module's drafter (:func:`module_drafter`) when speculative rollouts are on (:func:`rollout_backend`);
:func:`generate` samples a module's rollouts on vLLM or on our engine.

Rollout precision. ``rollout_dtype="bfloat16"`` samples on a bf16 mirror of the fp32 policy
(about 2.5x faster decoding on CPUs with AMX, and what vLLM does on GPUs), refreshed after every
optimizer step (:func:`sync_mirror`); the loss is still computed by the fp32 policy. The sampling
policy is then the bf16 rounding of the trained one: ``old_logprobs`` stay the fp32 forward's (the
usual training/inference mismatch of RL stacks; the log-probability check bounds it, with the 16-bit
tolerance). Speculative decoding is lossless with respect to the bf16 mirror it verifies on.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from tlt_lightning.drafter import Drafter, DrafterConfig, load_drafter
from tlt_lightning.models import HFTarget, TargetModel, set_weight_layout
from tlt_lightning.rl.config import SpeculativeConfig
from tlt_lightning.rollout import RolloutConfig, RolloutEngine, RolloutResult
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.speculative import DraftStrategy

if TYPE_CHECKING:
    from tlt_lightning.rl.module import GRPOModule

__all__ = [
    "apply_weight_layout",
    "generate",
    "module_drafter",
    "rollout_backend",
    "rollout_mirror",
    "rollout_models",
    "sync_mirror",
]


def rollout_mirror(policy: nn.Module, dtype: str) -> nn.Module:
    """A frozen copy of ``policy`` in ``dtype`` (``"bfloat16"``, ...), in eval mode."""
    mirror = copy.deepcopy(policy).to(getattr(torch, dtype))
    return mirror.eval().requires_grad_(False)


def apply_weight_layout(target: TargetModel, model: nn.Module, layout: str) -> None:
    """Lay out the linear weights of the rollout ``model`` (wrapped by ``target``) as ``layout``
    (:mod:`tlt_lightning.models.layout`); ``"out_in"`` (PyTorch's) leaves them as they are."""
    if layout == "out_in":
        return
    if isinstance(target, HFTarget):
        target.set_weight_layout(layout)  # a tied LM head gets a column-major copy
    else:
        set_weight_layout(model, layout)


def rollout_models(
    policy: nn.Module,
    policy_target: TargetModel,
    rollout_dtype: str | None,
    dtype: str,
    layout: str,
    make_target: Callable[[nn.Module], TargetModel],
) -> tuple[nn.Module | None, TargetModel]:
    """``(mirror or None, target)`` the rollouts run on: ``policy`` (``policy_target``) itself when
    ``rollout_dtype`` is ``None`` or its ``dtype``, else a :func:`rollout_mirror` in ``rollout_dtype``
    wrapped by ``make_target``; its linear weights laid out as ``layout`` (:func:`apply_weight_layout`)."""
    mirror, target = None, policy_target
    if rollout_dtype not in (None, dtype):
        mirror = rollout_mirror(policy, rollout_dtype)
        target = make_target(mirror)
    apply_weight_layout(target, policy if mirror is None else mirror, layout)
    return mirror, target


@torch.no_grad()
def sync_mirror(policy: nn.Module, mirror: nn.Module) -> None:
    """Copy the policy's weights into its rollout mirror.

    Raises:
        ValueError: the policy's parameters changed after the mirror was built.
    """
    mirrored = dict(mirror.named_parameters())
    params = dict(policy.named_parameters())
    if params.keys() != mirrored.keys():
        extra = sorted(params.keys() - mirrored.keys())[:3]
        raise ValueError(
            f"the policy's parameters no longer match its rollout_dtype mirror (e.g. {extra}): the policy "
            "was changed after configure_model (such as apply_dora(module.policy)); make the change in an "
            "overridden configure_policy() instead, so the mirror is built from the changed policy"
        )
    for name, param in params.items():
        mirrored[name].copy_(param)


def module_drafter(spec: SpeculativeConfig, target: TargetModel, seed: int) -> Drafter | None:
    """The drafter ``spec`` asks for on ``target``: loaded from ``drafter_path``, or a fresh one of
    ``drafter_kind`` seeded with ``seed``; ``None`` if it asks for neither."""
    if spec.drafter_path is not None:
        return load_drafter(spec.drafter_path, target)
    if spec.drafter_kind is None:
        return None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Drafter(DrafterConfig.from_target(target, kind=spec.drafter_kind), target)


def rollout_backend(
    target: TargetModel,
    config: RolloutConfig,
    drafter: Drafter | None,
    strategy: DraftStrategy,
    threshold: int,
) -> RolloutEngine | SpeculativeRolloutLoop:
    """Our engine for one rollout: speculative with ``drafter`` (and ``strategy`` below ``threshold``
    active requests) when there is one, else plain decoding."""
    if drafter is None:
        return RolloutEngine(target, config)
    return SpeculativeRolloutLoop(target, drafter, config, strategy, threshold=threshold)


def generate(
    module: GRPOModule, prompts: Sequence[Sequence[int]], generator: torch.Generator | None
) -> RolloutResult:
    """``module``'s rollouts of ``prompts`` (:meth:`~tlt_lightning.rl.GRPOModule.rollout`): on its vLLM
    engine when it has one, else on :func:`rollout_backend`; the policy in eval mode meanwhile."""
    spec, config = module.speculative_config, module.rollout_config()
    drafter = module.drafter if spec.enabled else None
    progress = module.hparams.rollout_progress and module.global_rank == 0
    was_training = module.policy.training
    module.policy.eval()
    try:
        if module.vllm_rollouts is not None:
            policy = module.rollout_policy if module.rollout_policy is not None else module.policy
            return module.vllm_rollouts.generate(
                prompts,
                config,
                policy=policy,
                drafter=drafter,
                target=module.rollout_target,
                step=module.global_step,
                generator=generator,
                progress=progress,
            )
        backend = rollout_backend(
            module.rollout_target, config, drafter, module.draft_strategy, spec.threshold
        )
        return backend.generate(prompts, generator=generator, progress=progress)
    finally:
        module.policy.train(was_training)
