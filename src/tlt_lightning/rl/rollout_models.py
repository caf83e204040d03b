"""The models a :class:`~tlt_lightning.rl.GRPOModule`'s rollouts run on, and what runs them.

The rollouts sample from the policy itself or from its ``rollout_dtype`` mirror (:func:`rollout_models`),
with the linear weights laid out for fast decoding (:func:`apply_weight_layout`), and draft with the
module's drafter (:func:`module_drafter`) when speculative rollouts are on (:func:`rollout_backend`);
:func:`generate` samples a module's rollouts on vLLM or on our engine. With compiled decoding
(:func:`apply_decode`), :func:`compile_rollouts` compiles the graphs once, before the first rollout.

Rollout precision. ``rollout_dtype="bfloat16"`` samples on a bf16 mirror of the fp32 policy
(about 2.5x faster decoding on CPUs with AMX, and what vLLM does on GPUs), refreshed after every
optimizer step (:func:`sync_mirror`); the loss is still computed by the fp32 policy. The sampling
policy is then the bf16 rounding of the trained one: ``old_logprobs`` stay the fp32 forward's (the
usual training/inference mismatch of RL stacks; the log-probability check bounds it, with the 16-bit
tolerance). Speculative decoding is lossless with respect to the bf16 mirror it verifies on.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from tlt_lightning.drafter import Drafter, DrafterConfig, load_drafter
from tlt_lightning.drafter.location import check_drafter_location
from tlt_lightning.models import HFTarget, TargetModel, set_weight_layout
from tlt_lightning.rl.config import SpeculativeConfig
from tlt_lightning.rl.crossover import calibrate_crossover
from tlt_lightning.rollout import RolloutConfig, RolloutEngine, RolloutResult
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.scheduling import BucketedStrategy
from tlt_lightning.speculative import Arm, DraftSpec, DraftStrategy

if TYPE_CHECKING:
    from tlt_lightning.rl.module import GRPOModule

__all__ = [
    "apply_decode",
    "apply_weight_layout",
    "compile_rollouts",
    "draft_arms",
    "generate",
    "module_drafter",
    "rollout_backend",
    "rollout_mirror",
    "rollout_models",
    "sync_mirror",
    "warm_up_rollouts",
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
        check_drafter_location(spec.drafter_path, "speculative.drafter_path")
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


def apply_decode(target: TargetModel, decode: str) -> str:
    """Run ``target``'s decode and verify forwards by ``decode`` (:meth:`HFTarget.set_decode`); returns the
    path taken. Other adapters keep their own (``"hf"`` is returned)."""
    if not isinstance(target, HFTarget):
        return "hf"
    return decode if decode == target.decode else target.set_decode(decode)


def draft_arms(strategy: DraftStrategy | DraftSpec) -> list[DraftSpec]:
    """The draft specs ``strategy`` may pick (a bucketed strategy: every bucket's arms), ``None`` left out."""
    arms: Sequence[Arm]
    if isinstance(strategy, BucketedStrategy):
        arms = [arm for bucket in strategy.arms for arm in bucket]
    elif isinstance(strategy, DraftSpec):
        arms = [strategy]
    else:
        arms = []
    return [arm for arm in dict.fromkeys(arms) if arm is not None]


@torch.no_grad()
def warm_up_rollouts(
    target: TargetModel,
    config: RolloutConfig,
    prompts: Sequence[Sequence[int]],
    drafter: Drafter | None = None,
    arms: Sequence[DraftSpec] = (),
) -> float | None:
    """Compile a compiled target's rollout graphs now: the seconds it took (``None``: not compiled).

    Short rollouts of one prompt and of ``prompts`` (the graphs of one row and of several, with the
    step's feature layers), and with a ``drafter`` one per arm (its verify graphs), sampled from a
    generator of their own: nothing of the run's random state, strategy or drafter changes.
    """
    if not isinstance(target, HFTarget) or target.decode != "compiled":
        return None
    start = time.perf_counter()
    depth = max((arm.num_steps for arm in arms), default=0)
    short = replace(config, max_new_tokens=min(config.max_new_tokens, 2 * depth + 4))
    groups = [list(prompts[:1]), list(prompts)] if len(prompts) > 1 else [list(prompts)]
    for group in groups:
        RolloutEngine(target, short).generate(group, generator=torch.Generator().manual_seed(0))
        for arm in arms if drafter is not None else ():
            loop = SpeculativeRolloutLoop(target, drafter, short, arm, threshold=len(group) + 1)
            loop.generate(group, generator=torch.Generator().manual_seed(0))
    return time.perf_counter() - start


def compile_rollouts(module: GRPOModule) -> float:
    """Compile ``module``'s rollout graphs once, right before its first rollout, when the drafter, feature
    layers and strategy arms are known (:func:`warm_up_rollouts` on two of its prompts), then give its
    strategy this machine's step costs (:func:`~tlt_lightning.rl.crossover.calibrate_crossover`).

    Returns the seconds both took, kept out of the rollout's time: 0 after the first call, or with nothing
    to do. The compile's are logged as ``time/compile_s``, printed and kept in ``module.compile_seconds``;
    the step costs' as ``time/crossover_s`` where they ran.
    """
    if module.compile_seconds is not None or module.vllm_rollouts is not None:
        return 0.0
    source = module.prompt_source
    prompts = [source.prompt_ids(i) for i in range(min(2, len(source)))]
    drafter = module.drafter if module.speculative_config.enabled else None
    arms = draft_arms(module.draft_strategy)
    seconds = warm_up_rollouts(module.rollout_target, module.rollout_config(), prompts, drafter, arms)
    module.compile_seconds = seconds or 0.0
    if seconds is not None:
        rank_zero_info(f"Compiled the rollout graphs in {seconds:.1f} s, before the first rollout")
        module.log("time/compile_s", seconds)
    start = time.perf_counter()
    if calibrate_crossover(module, arms) is None:
        return module.compile_seconds
    crossover_seconds = time.perf_counter() - start
    module.log("time/crossover_s", crossover_seconds)
    return module.compile_seconds + crossover_seconds
