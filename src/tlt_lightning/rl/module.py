"""GRPOModule: GRPO training of a causal LM as a LightningModule, with speculative rollouts.

One training step (one optimizer step) on a batch of ``P`` prompt indices:

1. **Rollouts** (:meth:`GRPOModule.rollout`): every prompt ``G`` times through a
   :class:`~tlt_lightning.rollout.SpeculativeRolloutLoop` when a drafter is attached, else a plain
   :class:`~tlt_lightning.rollout.RolloutEngine`, on the current policy weights, with a
   ``torch.Generator`` seeded from ``(seed, global_step, rank)`` (see *Resume* below).
2. **Rewards** (:meth:`GRPOModule.compute_rewards`): the prompt source scores each completion. A
   reward that raises or is not finite stops the run, naming the task and the prompt index.
3. **Advantages**: :func:`~tlt_lightning.rl.grpo.group_advantages` within each group of ``G``.
4. **Policy update** over micro-batches of sequences (gradient accumulation with
   ``manual_backward``): :meth:`GRPOModule.policy_logprobs` then :meth:`GRPOModule.policy_loss`.
   A non-finite loss or gradient norm is caught before the optimizer step, on every rank
   (:mod:`tlt_lightning.rl.optimize`: old log-probabilities, the log-probability check, DDP).

Rollout precision. ``rollout_dtype="bfloat16"`` samples on a bf16 mirror of the fp32 policy
(about 2.5x faster decoding on CPUs with AMX, and what vLLM does on GPUs), refreshed after every
optimizer step; the loss is still computed by the fp32 policy. The sampling policy is then the
bf16 rounding of the trained one: ``old_logprobs`` stay the fp32 forward's (the usual
training/inference mismatch of RL stacks; the log-probability check bounds it, with the 16-bit
tolerance). Speculative decoding is lossless with respect to the bf16 mirror it verifies on.

Resume. A run resumed from a Lightning checkpoint continues bit for bit like the uninterrupted run
whenever that run is itself reproducible (:mod:`tlt_lightning.rl.run_state` says what is saved).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any, Protocol

import lightning as L
import torch
from torch import nn

from tlt_lightning.drafter import Drafter, DrafterConfig, load_drafter
from tlt_lightning.models import (
    WEIGHT_LAYOUTS,
    HFTarget,
    TargetModel,
    load_model,
    resolve_dtype,
    set_weight_layout,
)
from tlt_lightning.rl.batch import PolicyBatch, completion_logprobs, policy_batch
from tlt_lightning.rl.config import OptimConfig, SpeculativeConfig, as_config, check, is_int
from tlt_lightning.rl.grpo import GRPOLossOutput, group_advantages, grpo_loss
from tlt_lightning.rl.optimize import StepCheck, clip_and_check, optimize
from tlt_lightning.rl.run_state import grpo_state, restore_grpo_state, rollout_seed
from tlt_lightning.rl.scoring import (
    NonFiniteLossError,
    RewardBatch,
    RewardError,
    check_rewards,
    score_rollouts,
)
from tlt_lightning.rl.sources import IndexDataset, PromptIndexLoader, PromptSource, TaskPromptSource
from tlt_lightning.rl.tasks import TaskConfig, TaskDataset
from tlt_lightning.rl.vllm_rollouts import VLLMRollouts
from tlt_lightning.rollout import RolloutConfig, RolloutEngine, RolloutResult
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.speculative import DraftSpec, DraftStrategy
from tlt_lightning.tracking import MeanAcceptLength, RolloutTokensPerSecond
from tlt_lightning.vllm.backend import VLLMRolloutStats

__all__ = ["ROLLOUT_BACKENDS", "GRPOModule", "NonFiniteLossError", "RewardBatch", "RewardError", "RolloutListener"]

ROLLOUT_BACKENDS = ("engine", "vllm")

# The groups' defaults (frozen dataclasses: one shared instance is safe).
_DEFAULT_ROLLOUT, _DEFAULT_OPTIM, _DEFAULT_SPECULATIVE = RolloutConfig(), OptimConfig(), SpeculativeConfig()


class RolloutListener(Protocol):
    """Told about the rollout of each training step (:meth:`GRPOModule.add_rollout_listener`)."""

    def before_rollout(self) -> None: ...

    def after_rollout(self, result: RolloutResult) -> None: ...


class GRPOModule(L.LightningModule):
    """GRPO on a causal LM, rollouts with lossless speculative decoding when a drafter is attached.

    Args:
        model: registry name (``"smollm2-135m"``, ``"tiny-llama"``, ...) or a local HF directory.
        dtype: parameter dtype, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        rollout_dtype: sample the rollouts on a copy of the policy in this dtype, refreshed after
            every optimizer step (``"bfloat16"``: fast CPU/GPU decoding with fp32 training);
            ``"auto"``: bf16 where the device multiplies it natively, else the policy itself
            (:func:`~tlt_lightning.models.resolve_dtype`; resolved in ``configure_model`` as
            ``self.rollout_dtype``); ``None``: on the policy itself.
        weight_layout: how the rollout model lays out its linear weights (:mod:`tlt_lightning.models.layout`;
            values unchanged): ``"packed"`` (default: on a CPU, rollouts multiply by oneDNN-packed
            copies, 1.0-1.3x faster in bf16 and more in fp32; training is untouched),
            ``"out_in"`` (PyTorch's) or ``"in_out"`` (cheaper fp32 verification of 4+ drafted
            tokens on some CPUs, dearer plain decoding of large batches).
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
        logprob_tolerance: in nats; ``None``: 0.01 for float32, 0.2 for 16-bit weights, rollouts or
            training precision (``Trainer(precision="bf16-mixed")``, the default where bf16 is native; bf16
            drifts ~0.04 between the KV-cached decode and the full forward on SmolLM2; a token
            misalignment costs several nats).
        rollout_progress: show a progress bar of finished requests during rollouts (rank 0).
        seed: seeds rollouts, the tiny models' weights and a fresh drafter.
        prompt_source: prompts and rewards; default: the task's, built at setup from the model's
            tokenizer. Tiny models have none: pass a :class:`~tlt_lightning.rl.TokenPromptSource`.
        rollout_backend: ``"engine"`` (ours: :class:`RolloutEngine` / :class:`SpeculativeRolloutLoop`)
            or ``"vllm"`` (:class:`~tlt_lightning.rl.vllm_rollouts.VLLMRollouts`: vLLM serves the
            policy, and with ``speculative`` the drafter as its EAGLE speculator, both refreshed in
            place every step; needs vLLM in this environment).
        vllm: settings of the vLLM engine, :class:`~tlt_lightning.vllm.VLLMBackendConfig` fields
            (``num_speculative_tokens``, ``dtype``, ``gpu_memory_utilization``, ``enforce_eager``, ...).
        max_abs_reward: a reward or correctness beyond ``+-max_abs_reward`` stops the run with a
            :class:`RewardError` naming the task, like a non-finite one (float32 sums of rewards near
            ``3e38`` overflow and the mean reward becomes NaN).

    Hooks and attributes for callbacks and subclasses:
        :meth:`configure_policy` and :meth:`make_target` (which model is trained, and its adapter),
        :meth:`configure_reference` and :meth:`reference_logprobs` (the KL reference),
        :meth:`rollout`, :meth:`compute_rewards`, :meth:`policy_logprobs`, :meth:`policy_loss`;
        ``draft_strategy`` (any :class:`~tlt_lightning.speculative.DraftStrategy`, e.g. the
        bandit), ``drafter`` (``None`` or a :class:`~tlt_lightning.drafter.Drafter` on
        ``rollout_target``; not a submodule: it has its own trainer and checkpoints),
        ``rollout_target`` (the adapter rollouts run on: the policy or its ``rollout_dtype``
        mirror), ``policy_target`` (the policy's own adapter, e.g. to train a drafter in the
        policy's precision), ``rollout_feature_layers`` (extra target
        layers the rollouts return, e.g. drafter training data), ``last_rollout``. ``training_step``
        returns ``{"loss", "rollout", "rewards", "advantages"}`` to ``on_train_batch_end``.

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
        self.task_config = as_config(task, TaskConfig, "task")
        self.rollout_settings = as_config(rollout, RolloutConfig, "rollout")
        self.optim_config = as_config(optim, OptimConfig, "optim")
        self.speculative_config = as_config(speculative, SpeculativeConfig, "speculative")
        check(0 < self.rollout_settings.temperature < math.inf, "rollout.temperature",
              self.rollout_settings.temperature, "finite and > 0 (greedy rollouts give every sample of a group the "
              "same reward)")
        check(isinstance(max_abs_reward, (int, float)) and not isinstance(max_abs_reward, bool)
              and 0 < max_abs_reward < math.inf, "max_abs_reward", max_abs_reward, "a finite number > 0")
        check(is_int(seed) and seed >= 0, "seed", seed, "an int >= 0")
        check(logprob_tolerance is None or logprob_tolerance > 0, "logprob_tolerance", logprob_tolerance,
              "> 0 or None")
        check(rollout_dtype in (None, "auto", "float32", "bfloat16", "float16"), "rollout_dtype", rollout_dtype,
              "'auto', 'float32', 'bfloat16', 'float16' or None")
        check(weight_layout in WEIGHT_LAYOUTS, "weight_layout", weight_layout, f"one of {WEIGHT_LAYOUTS}")
        check(prompt_source is None or isinstance(prompt_source, PromptSource), "prompt_source",
              prompt_source, "a PromptSource (name, __len__, prompt_ids, score) or None")
        check(rollout_backend in ROLLOUT_BACKENDS, "rollout_backend", rollout_backend, f"one of {ROLLOUT_BACKENDS}")
        self.vllm_rollouts = VLLMRollouts(vllm) if rollout_backend == "vllm" else None  # validates `vllm`
        self.save_hyperparameters(ignore=["prompt_source"])
        # The groups are saved as plain dicts of all their fields, which a checkpoint reads back without our
        # classes, and logged as such (`optim/lr`): also in the initial copy that Lightning logs.
        groups = {name: {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}
                  for name, config in (("task", self.task_config), ("rollout", self.rollout_settings),
                                       ("optim", self.optim_config), ("speculative", self.speculative_config))}
        for hparams in (self.hparams, self._hparams_initial):
            hparams.update(groups)
        self.automatic_optimization = False

        self.prompt_source: PromptSource | None = prompt_source
        self.draft_strategy: DraftStrategy = DraftSpec(self.speculative_config.sd_steps)
        self.drafter: Drafter | None = None
        self.rollout_feature_layers: tuple[int, ...] = ()
        self.last_rollout: RolloutResult | None = None
        self._rollout_listeners: list[RolloutListener] = []
        self.policy: nn.Module | None = None  # built in configure_model (no I/O here)
        self.reference: nn.Module | None = None
        self.rollout_dtype: str | None = rollout_dtype  # "auto" resolves in configure_model
        self.rollout_policy: nn.Module | None = None  # the rollout_dtype mirror, when there is one
        self.rollout_target: TargetModel | None = None
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
        self.policy, self.tokenizer, self.policy_target = self.configure_policy()
        self.rollout_target = self.policy_target
        device = self.trainer.strategy.root_device if self._trainer is not None else self.device
        self.rollout_dtype = resolve_dtype(hp.rollout_dtype, device)
        if self.rollout_dtype not in (None, hp.dtype):
            mirror = copy.deepcopy(self.policy).to(getattr(torch, self.rollout_dtype))
            self.rollout_policy = mirror.eval().requires_grad_(False)
            self.rollout_target = self.make_target(self.rollout_policy)
        if hp.weight_layout != "out_in" and isinstance(self.rollout_target, HFTarget):
            self.rollout_target.set_weight_layout(hp.weight_layout)  # a tied LM head gets a column-major copy
        elif hp.weight_layout != "out_in":
            rollout_model = self.policy if self.rollout_policy is None else self.rollout_policy
            set_weight_layout(rollout_model, hp.weight_layout)
        if self.optim_config.kl_coef > 0:
            self.reference = self.configure_reference().eval().requires_grad_(False)
        if self.prompt_source is None:
            self.prompt_source = self.configure_prompt_source()
        spec = self.speculative_config
        if self.drafter is None and spec.drafter_path is not None:
            self.drafter = load_drafter(spec.drafter_path, self.rollout_target)
        elif self.drafter is None and spec.drafter_kind is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(hp.seed)
                self.drafter = Drafter(DrafterConfig.from_target(self.rollout_target, kind=spec.drafter_kind),
                                       self.rollout_target)

    def configure_policy(self) -> tuple[nn.Module, Any, TargetModel]:
        """Build the trained policy: ``(module in train mode, tokenizer or None, its target adapter)``.

        Called once by :meth:`configure_model`. The default loads ``model`` in ``dtype`` with
        :func:`~tlt_lightning.models.load_model` (a transformers causal LM) and wraps it with
        :meth:`make_target`. A subclass that builds another kind of model overrides this,
        :meth:`make_target` and :meth:`policy_logprobs` together (see
        :class:`~tlt_lightning.rl.TorchtuneGRPOModule`).
        """
        hp = self.hparams
        loaded = load_model(hp.model, dtype=hp.dtype, seed=hp.seed)
        policy = loaded.model.train()
        if self.optim_config.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        return policy, loaded.tokenizer, self.make_target(policy)

    def configure_reference(self) -> nn.Module:
        """The KL reference (``kl_coef > 0``): the initial policy, rebuilt from ``model``; frozen by the caller."""
        hp = self.hparams
        return load_model(hp.model, dtype=hp.dtype, seed=hp.seed).model

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

    @torch.no_grad()
    def sync_rollout_policy(self) -> None:
        """Copy the policy's weights into the ``rollout_dtype`` mirror (no-op without one)."""
        if self.rollout_policy is None:
            return
        mirror = dict(self.rollout_policy.named_parameters())
        params = dict(self.policy.named_parameters())
        if params.keys() != mirror.keys():
            extra = sorted(params.keys() - mirror.keys())[:3]
            raise ValueError(
                f"the policy's parameters no longer match its rollout_dtype mirror (e.g. {extra}): the policy "
                "was changed after configure_model (such as apply_dora(module.policy)); make the change in an "
                "overridden configure_policy() instead, so the mirror is built from the changed policy"
            )
        for name, param in params.items():
            mirror[name].copy_(param)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optim = self.optim_config
        return torch.optim.AdamW(self.policy.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)

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
        """The step's :class:`RolloutConfig`: ``rollout`` with the layers ``rollout_feature_layers`` asks for too."""
        layers = dict.fromkeys((*self.rollout_settings.feature_layers, *self.rollout_feature_layers))
        return replace(self.rollout_settings, feature_layers=tuple(layers))

    def add_rollout_listener(self, listener: RolloutListener) -> None:
        """Call ``listener.before_rollout()`` / ``listener.after_rollout(result)`` around the rollout of
        every training step (not around other :meth:`rollout` calls), in the order added."""
        self._rollout_listeners.append(listener)

    def remove_rollout_listener(self, listener: RolloutListener) -> None:
        """Stop calling ``listener``; one that was not added is ignored."""
        self._rollout_listeners = [x for x in self._rollout_listeners if x is not listener]

    def rollout_generator(self) -> torch.Generator:
        """The random source of this step's rollouts: a function of (seed, global_step, rank)."""
        seed = rollout_seed(self.hparams.seed, self.global_step, self.global_rank)
        return torch.Generator(device=self.device).manual_seed(seed)

    def rollout(
        self, prompts: Sequence[Sequence[int]], generator: torch.Generator | None = None
    ) -> RolloutResult:
        """Sample one response per prompt on the current policy (speculatively when a drafter is attached)."""
        hp, spec, config = self.hparams, self.speculative_config, self.rollout_config()
        progress = hp.rollout_progress and self.global_rank == 0
        was_training = self.policy.training
        self.policy.eval()
        try:
            if self.vllm_rollouts is not None:
                policy = self.rollout_policy if self.rollout_policy is not None else self.policy
                return self.vllm_rollouts.generate(
                    prompts, config, policy=policy, drafter=self.drafter if spec.enabled else None,
                    target=self.rollout_target, step=self.global_step, generator=generator, progress=progress,
                )
            if self.drafter is not None and spec.enabled:
                backend = SpeculativeRolloutLoop(
                    self.rollout_target, self.drafter, config, self.draft_strategy, threshold=spec.threshold
                )
            else:
                backend = RolloutEngine(self.rollout_target, config)
            return backend.generate(prompts, generator=generator, progress=progress)
        finally:
            self.policy.train(was_training)

    def compute_rewards(self, indices: torch.Tensor, result: RolloutResult) -> RewardBatch:
        """Score every rollout; ``indices`` ``[N]`` are their prompts' dataset indices.

        Raises:
            RewardError: the prompt source raised; the message names the task and prompt index.
        """
        return score_rollouts(self.prompt_source, indices, result, self.optim_config.group_size,
                              self.hparams.max_abs_reward)

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
            logprobs, logprobs.detach(), batch.advantages, batch.mask, clip_eps=optim.clip_eps,
            clip_eps_high=optim.clip_eps_high, kl_coef=optim.kl_coef, ref_logprobs=ref, aggregation=optim.aggregation,
            num_items=num_items,
        )

    # ------------------------------------------------------------------------------ the step
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, Any]:
        G = self.optim_config.group_size
        indices = torch.as_tensor(batch).cpu().long().repeat_interleave(G)  # [N], groups contiguous
        prompts = [self.prompt_source.prompt_ids(int(i)) for i in indices]
        for listener in self._rollout_listeners:
            listener.before_rollout()
        result = self.rollout(prompts, self.rollout_generator())
        self.last_rollout = result
        for listener in self._rollout_listeners:
            listener.after_rollout(result)

        start = time.perf_counter()
        rewards = self._rewards(indices, result)
        reward_time = time.perf_counter() - start
        advantages = group_advantages(rewards.total, G, scale=self.optim_config.scale_advantages)

        start = time.perf_counter()
        parts = optimize(self, policy_batch(result, advantages, self.device))
        train_time = time.perf_counter() - start

        self._log_step(result, rewards, parts, reward_time, train_time)
        return {"loss": parts["loss"], "rollout": result, "rewards": rewards, "advantages": advantages}

    def _any_rank(self, flag: bool) -> bool:
        return self.trainer.strategy.reduce_boolean_decision(flag, all=False)

    def _rewards(self, indices: torch.Tensor, result: RolloutResult) -> RewardBatch:
        """:meth:`compute_rewards`, checked, with every rank stopping if any rank's rewards failed."""
        error: Exception | None = None
        rewards = None
        try:
            rewards = check_rewards(self.compute_rewards(indices, result), indices, self.prompt_source,
                                    self.optim_config.group_size, self.hparams.max_abs_reward)
        except Exception as err:  # held until every rank knows, so that none hangs in a collective
            error = err
        if self._any_rank(error is not None):
            if error is None:
                raise RewardError("stopping: the reward function failed on another rank (see its error)")
            raise error
        return rewards

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Clip and check the step's accumulated gradient, right before the update (:func:`clip_and_check`).

        Lightning calls this inside ``opt.step()`` of :func:`~tlt_lightning.rl.optimize.optimize`, after
        every callback's ``on_before_optimizer_step`` (the order of automatic optimization, where
        Lightning clips at this point too). So a callback that rescales the gradients in its own hook,
        such as :class:`~tlt_lightning.efficiency.LayerwisePrecisionCallback` unscaling its per-group
        fp16 gradients, does so before they are clipped and checked; one that drops every gradient (a
        skipped fp16 step) leaves a zero norm and an optimizer step that changes nothing.

        Raises (on every rank, before the update, the gradients zeroed) when the loss, the gradient
        norm or the log-probability check failed on any rank. A subclass overriding this hook must
        call ``super()``.
        """
        clip_and_check(self, optimizer)

    def _log_step(self, result: RolloutResult, rewards: RewardBatch, parts: dict[str, torch.Tensor],
                  reward_time: float, train_time: float) -> None:
        stats, lengths = result.stats, result.lengths.float()
        self.accept_length.update(stats)
        self.rollout_tokens_per_s.update(stats)
        # Metrics sync across ranks in compute(); reset: these are per-step values.
        self.log("rollout/accept_length", self.accept_length.compute(), prog_bar=True)
        self.log("rollout/tokens_per_s", self.rollout_tokens_per_s.compute(), prog_bar=True)
        self.accept_length.reset()
        self.rollout_tokens_per_s.reset()
        log = lambda name, value, **kw: self.log(name, value, sync_dist=True, **kw)
        log("reward/mean", rewards.total.mean(), prog_bar=True)
        log("reward/std", rewards.total.std() if rewards.total.numel() > 1 else torch.tensor(0.0))
        log("reward/accuracy", (rewards.correctness >= 1).float().mean())
        log("response/length_mean", lengths.mean())
        log("response/length_max", lengths.max(), reduce_fx="max")
        log("time/rollout_s", stats.total_time)
        if isinstance(stats, VLLMRolloutStats):  # the policy version vLLM served (one refresh per step)
            log("rollout/weights_version", float(stats.weights_version))
        log("time/reward_s", reward_time)
        log("time/train_s", train_time)
        for name in ("loss", "pg_loss", "kl", "clip_fraction", "ratio_mean", "grad_norm", "logprob_drift"):
            log(f"train/{name}", parts[name])

    # ------------------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["grpo"] = grpo_state(self.hparams.seed, self.prompt_source)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        restore_grpo_state(checkpoint, self.hparams.seed, self.prompt_source, self.optim_config)
