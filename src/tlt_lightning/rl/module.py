"""GRPOModule: GRPO training of a causal LM as a LightningModule, with speculative rollouts.

One training step (one optimizer step) on a batch of ``P`` prompt indices: every prompt ``G`` times
through our engine (speculative when a drafter is attached) or vLLM, with a generator seeded from
``(seed, global_step, rank)`` (:meth:`GRPOModule.rollout`); rewards from the prompt source, a failing
or non-finite one stopping the run with the task and prompt named (:meth:`GRPOModule.compute_rewards`);
advantages within each group (:func:`~tlt_lightning.rl.grpo.group_advantages`); the policy update over
micro-batches, a non-finite loss or gradient caught on every rank before the optimizer step
(:mod:`tlt_lightning.rl.optimize`). :mod:`tlt_lightning.rl.rollout_models` says what the rollouts run
on; a resumed run continues bit for bit like an uninterrupted one (:mod:`tlt_lightning.rl.run_state`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import lightning as L
import torch
from torch import nn

from tlt_lightning.drafter import Drafter
from tlt_lightning.models import HFTarget, TargetModel, load_model, resolve_decode, resolve_dtype
from tlt_lightning.rl.batch import PolicyBatch, completion_logprobs, policy_batch
from tlt_lightning.rl.config import OptimConfig, SpeculativeConfig
from tlt_lightning.rl.grpo import GRPOLossOutput, group_advantages, grpo_loss
from tlt_lightning.rl.listeners import RolloutListener, RolloutListeners
from tlt_lightning.rl.module_settings import ROLLOUT_BACKENDS, check_settings, config_groups, group_hparams
from tlt_lightning.rl.optimize import StepCheck, any_rank, clip_and_check, optimize
from tlt_lightning.rl.optimizers import (
    build_optimizer,
    pack_optimizer_states,
    unpack_optimizer_states,
)
from tlt_lightning.rl.rollout_models import (
    apply_decode,
    compile_rollouts,
    generate,
    module_drafter,
    rollout_models,
    sync_mirror,
)
from tlt_lightning.rl.run_state import grpo_state, restore_grpo_state, rollout_seed
from tlt_lightning.rl.scoring import (
    NonFiniteLossError,
    RewardBatch,
    RewardError,
    agreed_rewards,
    score_rollouts,
)
from tlt_lightning.rl.sources import IndexDataset, PromptIndexLoader, PromptSource, TaskPromptSource
from tlt_lightning.rl.step_log import log_step
from tlt_lightning.rl.tasks import TaskConfig, TaskDataset
from tlt_lightning.rl.vllm_rollouts import VLLMRollouts
from tlt_lightning.rollout import RolloutConfig, RolloutResult
from tlt_lightning.speculative import DraftSpec, DraftStrategy
from tlt_lightning.tracking import MeanAcceptLength, RolloutTokensPerSecond

__all__ = ["ROLLOUT_BACKENDS", "GRPOModule", "NonFiniteLossError", "RewardBatch", "RewardError"]

# The groups' defaults (frozen dataclasses: one shared instance is safe).
_DEFAULT_ROLLOUT, _DEFAULT_OPTIM, _DEFAULT_SPECULATIVE = RolloutConfig(), OptimConfig(), SpeculativeConfig()


class GRPOModule(L.LightningModule):
    """GRPO on a causal LM, rollouts with lossless speculative decoding when a drafter is attached.

    Args:
        model: registry name (``"smollm2-135m"``, ``"tiny-llama"``, ...) or a local HF directory.
        dtype: parameter dtype, ``"float32"``, ``"bfloat16"`` (updated with stochastic rounding, no
            rollout mirror: half the memory of float32's weights, gradients and moments), ``"float16"``
            or ``"auto"``: bf16 where the device multiplies it natively, else
            float32 (:func:`~tlt_lightning.models.resolve_dtype`; resolved in :meth:`configure_model`).
        rollout_dtype: sample on a mirror of the policy in this dtype, refreshed after every optimizer
            step; ``"auto"``: bf16 where the device multiplies it natively
            (:func:`~tlt_lightning.models.resolve_dtype`), else, like ``None``, the policy itself.
        weight_layout: the rollout model's linear weights (:mod:`tlt_lightning.models.layout`):
            ``"packed"`` (oneDNN-packed copies on a CPU), ``"out_in"`` or ``"in_out"``.
        rollout_decode: the rollouts' decode and verify forwards (``HFTarget(decode=)``): ``"auto"``
            (``"compiled"`` where it pays, :func:`~tlt_lightning.models.resolve_decode`, else
            ``"hf"``), ``"compiled"``, ``"lean"`` or ``"hf"``. Graphs compile once, before the
            first rollout (:func:`~tlt_lightning.rl.rollout_models.compile_rollouts`), and serve every
            step as the weights change.
        task: the reasoning-gym task (a :class:`~tlt_lightning.rl.tasks.TaskConfig` or its fields
            as a dict; default ``TaskConfig()``). Ignored when a ``prompt_source`` is given.
        rollout: how responses are sampled, a :class:`~tlt_lightning.rollout.RolloutConfig`
            (``max_new_tokens``, ``temperature`` ``> 0``: GRPO needs different samples per group,
            ``top_p``, ``top_k``); its ``feature_layers`` are joined by ``rollout_feature_layers``.
        optim: the GRPO loss and optimizer step, an :class:`~tlt_lightning.rl.OptimConfig`
            (``group_size``, ``prompts_per_step``, ``lr``, ``kl_coef``, ``micro_batch_size``, ...).
        speculative: speculative rollouts, a :class:`~tlt_lightning.rl.SpeculativeConfig`
            (``enabled``, ``drafter_kind`` or ``drafter_path``, ``sd_steps``, ``threshold``).
        check_logprobs: check that the rollout's log-probabilities agree with the training
            forward's (when ``top_p == 1`` and ``top_k == 0``, where they describe the same
            distribution); a mean absolute difference above ``logprob_tolerance`` stops the run.
        logprob_tolerance: in nats; ``None``: 0.01 for float32, 0.2 where weights, rollouts or training
            are 16-bit (bf16 drifts a little between the cached decode and the full forward; a token
            misalignment costs several nats).
        rollout_progress: show a progress bar of finished requests during rollouts (rank 0).
        seed: seeds rollouts, the tiny models' weights and a fresh drafter.
        prompt_source: prompts and rewards; default: the task's, built at setup from the model's
            tokenizer. Tiny models have none: pass a :class:`~tlt_lightning.rl.TokenPromptSource`.
        rollout_backend: ``"engine"`` (ours) or ``"vllm"``
            (:class:`~tlt_lightning.rl.vllm_rollouts.VLLMRollouts`: the policy, and its drafter as
            EAGLE speculator, served by vLLM and refreshed in place every step).
        vllm: :class:`~tlt_lightning.vllm.VLLMBackendConfig` fields for the vLLM engine.
        max_abs_reward: a reward beyond ``+-max_abs_reward`` stops the run like a non-finite one
            (:class:`RewardError`; float32 sums of rewards near ``3e38`` overflow).

    Hooks and attributes for callbacks and subclasses:
        :meth:`configure_policy` and :meth:`make_target` (the trained model and its adapter),
        :meth:`configure_reference`, :meth:`reference_logprobs`, :meth:`rollout`,
        :meth:`compute_rewards`, :meth:`policy_logprobs`, :meth:`policy_loss`; ``draft_strategy``
        (a :class:`~tlt_lightning.speculative.DraftStrategy`), ``drafter`` (not a submodule: it has its
        own trainer and checkpoints), ``rollout_target`` and ``policy_target`` (the adapters of the
        rollout model and of the policy), ``rollout_feature_layers`` (extra layers the rollouts return),
        ``last_rollout``, :meth:`add_rollout_listener`. ``training_step`` returns ``{"loss", "rollout",
        "rewards", "advantages", "forward_tokens", "times"}`` (``forward_tokens``: the padded tokens
        this rank's training forwards ran on; ``times``: its ``rollout_s``, ``reward_s``, ``train_s``,
        ``compile_s``).

    Example:
        >>> source = TokenPromptSource([[5, 6, 7], [8, 9], [3], [4, 2]], reward_fn)  # doctest: +SKIP
        >>> module = GRPOModule(model="tiny-llama", prompt_source=source)  # doctest: +SKIP
        >>> Trainer(max_steps=2, accelerator="cpu").fit(module)  # doctest: +SKIP
    """

    # Used, not owned: the drafter is trained by its own callback and saved as its own artifact;
    # the reference is frozen and rebuilt from `model`; the rollout target wraps the policy's own
    # modules (or a mirror refreshed from them). Registered, they would sit in DDP's gradient buckets
    # and in every checkpoint.
    _UNREGISTERED = frozenset(
        {"drafter", "reference", "rollout_target", "policy_target", "rollout_policy", "vllm_rollouts"}
    )

    def __init__(
        self,
        model: str = "smollm2-135m",
        dtype: str = "float32",
        rollout_dtype: str | None = None,
        weight_layout: str = "packed",
        rollout_decode: str = "auto",
        task: TaskConfig | None = None,
        rollout: RolloutConfig = _DEFAULT_ROLLOUT,
        optim: OptimConfig = _DEFAULT_OPTIM,
        speculative: SpeculativeConfig = _DEFAULT_SPECULATIVE,
        check_logprobs: bool = True,
        logprob_tolerance: float | None = None,
        rollout_progress: bool = False,
        seed: int = 0,
        prompt_source: PromptSource | None = None,
        rollout_backend: str = "engine",
        vllm: dict[str, Any] | None = None,
        max_abs_reward: float = 1e6,
    ) -> None:
        super().__init__()
        groups = config_groups(task, rollout, optim, speculative)
        self.task_config, self.rollout_settings, self.optim_config, self.speculative_config = groups
        self.save_hyperparameters(ignore=["prompt_source"])
        check_settings(self.rollout_settings, self.hparams, prompt_source)
        self.vllm_rollouts = VLLMRollouts(vllm) if rollout_backend == "vllm" else None  # validates `vllm`
        for hparams in (self.hparams, self._hparams_initial):  # also the initial copy Lightning logs
            hparams.update(group_hparams(**groups._asdict()))
        # LightningCLI's: how load_from_checkpoint rebuilds the module (kept in the checkpoint), no setting.
        self._hparams_initial.pop("_instantiator", None)
        self.automatic_optimization = False
        self.prompt_source: PromptSource | None = prompt_source
        self.resume_overrides = "refuse"  # a resumed fit's other prompt source: refused, or "apply" it
        self.draft_strategy: DraftStrategy = DraftSpec(self.speculative_config.sd_steps)
        self.drafter: Drafter | None = None
        self.rollout_feature_layers: tuple[int, ...] = ()
        self.last_rollout: RolloutResult | None = None
        self._rollout_listeners = RolloutListeners()
        self.policy: nn.Module | None = None  # built in configure_model (no I/O here)
        self.reference: nn.Module | None = None
        self.policy_dtype: str = dtype  # "auto" resolves in configure_model
        self.rollout_dtype: str | None = rollout_dtype  # "auto" resolves in configure_model
        self.rollout_policy: nn.Module | None = None  # the rollout_dtype mirror, when there is one
        self.rollout_target: TargetModel | None = None
        self.rollout_decode: str = rollout_decode  # "auto" resolves in configure_model
        self.compile_seconds: float | None = None  # compile_rollouts(), at the first rollout
        self.policy_target: TargetModel | None = None
        self.tokenizer = None
        self.accept_length = MeanAcceptLength()
        self.rollout_tokens_per_s = RolloutTokensPerSecond()
        self._step_check: StepCheck | None = None  # set while optimize()'s opt.step() runs

    def __setattr__(self, name: str, value: Any) -> None:
        if name in GRPOModule._UNREGISTERED:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    # ------------------------------------------------------------------------------ setup
    def configure_model(self) -> None:
        """Load the policy (and the reference, the prompt source, a drafter). Idempotent."""
        if self.policy is not None:
            return
        hp = self.hparams
        device = self.trainer.strategy.root_device if self._trainer is not None else self.device
        self.policy_dtype = resolve_dtype(hp.dtype, device)
        self.policy, self.tokenizer, self.policy_target = self.configure_policy()
        self.rollout_dtype = resolve_dtype(hp.rollout_dtype, device)
        self.rollout_policy, self.rollout_target = rollout_models(
            self.policy,
            self.policy_target,
            self.rollout_dtype,
            self.policy_dtype,
            hp.weight_layout,
            self.make_target,
        )
        size = sum(p.numel() for p in self.policy.parameters())
        self.rollout_decode = apply_decode(
            self.rollout_target, resolve_decode(hp.rollout_decode, device, size)
        )
        if self.optim_config.kl_coef > 0:
            self.reference = self.configure_reference().eval().requires_grad_(False)
        if self.prompt_source is None:
            self.prompt_source = self.configure_prompt_source()
        if self.drafter is None:
            self.drafter = module_drafter(self.speculative_config, self.rollout_target, hp.seed)

    def configure_policy(self) -> tuple[nn.Module, Any, TargetModel]:
        """Build the trained policy: ``(module in train mode, tokenizer or None, its target adapter)``.

        Called once by :meth:`configure_model`. The default loads ``model`` in ``policy_dtype`` with
        :func:`~tlt_lightning.models.load_model` (a transformers causal LM) and wraps it with
        :meth:`make_target`. A subclass that builds another kind of model overrides this,
        :meth:`make_target` and :meth:`policy_logprobs` together (see
        :class:`~tlt_lightning.rl.TorchtuneGRPOModule`).
        """
        hp = self.hparams
        loaded = load_model(hp.model, dtype=self.policy_dtype, seed=hp.seed)
        policy = loaded.model.train()
        if self.optim_config.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        return policy, loaded.tokenizer, self.make_target(policy)

    def configure_reference(self) -> nn.Module:
        """The KL reference (``kl_coef > 0``): the initial policy, rebuilt from ``model``; frozen by the
        caller."""
        return load_model(self.hparams.model, dtype=self.policy_dtype, seed=self.hparams.seed).model

    def make_target(self, module: nn.Module) -> TargetModel:
        """The target adapter rollouts and drafters use for ``module`` (the policy or its ``rollout_dtype``
        mirror, a ``copy.deepcopy`` of the policy); default :class:`~tlt_lightning.models.HFTarget`."""
        return HFTarget(module)

    def configure_prompt_source(self) -> PromptSource:
        """The default prompt source: the task's prompts, rendered with the model's tokenizer."""
        if self.tokenizer is None:
            raise ValueError(
                f"model {self.hparams.model!r} has no tokenizer, so the task's text prompts cannot be used: "
                "pass prompt_source=TokenPromptSource(prompts, reward_fn) with token-id prompts"
            )
        return TaskPromptSource(TaskDataset(self.task_config, self.tokenizer))

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        # Weights can arrive before Lightning configured the module (ddp_spawn hands rank 0's weights
        # back to the main process; load_from_checkpoint): build the model first.
        self.configure_model()
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def on_fit_start(self) -> None:
        for module in (self.reference, self.drafter, self.rollout_policy):
            if module is not None:
                module.to(self.device)
        self.sync_rollout_policy()  # after a checkpoint restore too

    def on_fit_end(self) -> None:
        if self.vllm_rollouts is not None:
            self.vllm_rollouts.close()

    def sync_rollout_policy(self) -> None:
        """Copy the policy's weights into the ``rollout_dtype`` mirror (no-op without one)."""
        if self.rollout_policy is not None:
            sync_mirror(self.policy, self.rollout_policy)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return build_optimizer(self.policy.parameters(), self.optim_config, self.device, self.hparams.seed)

    def train_dataloader(self) -> PromptIndexLoader:
        # Sequential order (reasoning-gym already draws its problems at random); under DDP Lightning
        # swaps in a DistributedSampler that shuffles with a fixed seed per epoch. Either order is a
        # function of the epoch alone, so the loader's state makes mid-epoch resume exact.
        P, n = self.optim_config.prompts_per_step, len(self.prompt_source)
        if n < P:
            raise ValueError(
                f"prompts_per_step={P} is more than the {n} prompts of task {self.prompt_source.name!r}"
            )
        return PromptIndexLoader(IndexDataset(n), batch_size=P, shuffle=False, drop_last=True)

    # ------------------------------------------------------------------------------ hooks
    def rollout_config(self) -> RolloutConfig:
        """The step's :class:`RolloutConfig`: ``rollout`` with the layers ``rollout_feature_layers`` asks
        for too."""
        layers = dict.fromkeys((*self.rollout_settings.feature_layers, *self.rollout_feature_layers))
        return replace(self.rollout_settings, feature_layers=tuple(layers))

    def add_rollout_listener(self, listener: RolloutListener) -> None:
        """Tell ``listener`` about every training step (:mod:`~tlt_lightning.rl.listeners`: ``begin_step``,
        ``before_rollout``, ``after_rollout``, ``end_step``; not about other :meth:`rollout` calls),
        after the listeners added before it."""
        self._rollout_listeners.add(listener)

    def remove_rollout_listener(self, listener: RolloutListener) -> None:
        """Stop calling ``listener``; one that was not added is ignored."""
        self._rollout_listeners.remove(listener)

    def rollout_generator(self) -> torch.Generator:
        """The random source of this step's rollouts: a function of (seed, global_step, rank)."""
        seed = rollout_seed(self.hparams.seed, self.global_step, self.global_rank)
        return torch.Generator(device=self.device).manual_seed(seed)

    def rollout(
        self, prompts: Sequence[Sequence[int]], generator: torch.Generator | None = None
    ) -> RolloutResult:
        """Sample one response per prompt on the current policy (speculatively when a drafter is
        attached), on the module's rollout backend (:func:`~tlt_lightning.rl.rollout_models.generate`)."""
        return generate(self, prompts, generator)

    def compute_rewards(self, indices: torch.Tensor, result: RolloutResult) -> RewardBatch:
        """Score every rollout; ``indices`` ``[N]`` are their prompts' dataset indices.

        Raises:
            RewardError: the prompt source raised; the message names the task and prompt index.
        """
        return score_rollouts(
            self.prompt_source, indices, result, self.optim_config.group_size, self.hparams.max_abs_reward
        )

    def policy_logprobs(self, batch: PolicyBatch) -> torch.Tensor:
        """``[B, T]`` the policy's log-probabilities of the completion tokens (with grad)."""
        return completion_logprobs(self.policy, batch, self.rollout_settings.temperature)

    def reference_logprobs(self, batch: PolicyBatch) -> torch.Tensor:
        """``[B, T]`` the KL reference's log-probabilities of the completion tokens (called without grad)."""
        return completion_logprobs(self.reference, batch, self.rollout_settings.temperature)

    def policy_loss(
        self, batch: PolicyBatch, logprobs: torch.Tensor, num_items: torch.Tensor
    ) -> GRPOLossOutput:
        """The GRPO loss of one micro-batch; ``num_items`` normalises it over the whole step.

        ``old_logprobs`` are ``logprobs`` detached: one optimizer step per rollout batch, so the
        sampling policy is the current one (see the module docstring).
        """
        optim, ref = self.optim_config, None
        if self.reference is not None:
            with torch.no_grad():
                ref = self.reference_logprobs(batch)
        return grpo_loss(
            logprobs,
            logprobs.detach(),
            batch.advantages,
            batch.mask,
            clip_eps=optim.clip_eps,
            clip_eps_high=optim.clip_eps_high,
            kl_coef=optim.kl_coef,
            ref_logprobs=ref,
            aggregation=optim.aggregation,
            num_items=num_items,
        )

    # ------------------------------------------------------------------------------ the step
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, Any]:
        G = self.optim_config.group_size
        indices = torch.as_tensor(batch).cpu().long().repeat_interleave(G)  # [N], groups contiguous
        prompts = [self.prompt_source.prompt_ids(int(i)) for i in indices]
        listeners = self._rollout_listeners
        listeners.begin_step(self)
        compile_s = compile_rollouts(self)
        listeners.before_rollout()
        result = self.rollout(prompts, self.rollout_generator())
        self.last_rollout = result
        listeners.after_rollout(result)
        if isinstance(self.rollout_target, HFTarget):  # stale after the update: not held while training
            self.rollout_target.release_weight_copies()

        start = time.perf_counter()
        rewards = agreed_rewards(
            lambda: self.compute_rewards(indices, result),
            indices,
            self.prompt_source,
            G,
            self.hparams.max_abs_reward,
            lambda failed: any_rank(self, failed),
        )
        reward_time = time.perf_counter() - start
        advantages = group_advantages(rewards.total, G, scale=self.optim_config.scale_advantages)

        start = time.perf_counter()
        parts = optimize(self, policy_batch(result, advantages, self.device))
        train_time = time.perf_counter() - start

        log_step(self, result, rewards, parts, reward_time, train_time)
        listeners.end_step(self, result)
        times = {"rollout_s": result.stats.total_time, "reward_s": reward_time, "train_s": train_time}
        out = {"loss": parts["loss"], "rollout": result, "rewards": rewards, "advantages": advantages,
               "forward_tokens": int(parts["forward_tokens"])}  # fmt: skip
        return {**out, "times": {**times, "compile_s": compile_s}}

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Clip and check the step's accumulated gradient, right before the update, after every
        callback's ``on_before_optimizer_step`` (:func:`~tlt_lightning.rl.optimize.clip_and_check`).
        A subclass overriding this hook must call ``super()``."""
        clip_and_check(self, optimizer)

    # ------------------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["grpo"] = grpo_state(self.hparams.seed, self.prompt_source)
        pack_optimizer_states(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        unpack_optimizer_states(checkpoint)
        hp = self.hparams
        restore_grpo_state(checkpoint, hp.seed, self.prompt_source, self.optim_config, self.resume_overrides)
