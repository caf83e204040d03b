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
   A non-finite loss or gradient norm is caught before the optimizer step, on every rank.

Old log-probabilities. The ratio in the clipped loss compares the policy with the policy that
sampled. Here each rollout batch gets exactly one optimizer step (the micro-batches accumulate
into it), so that policy *is* the current one, before the step: ``old_logprobs`` are the training
forward's own log-probabilities, detached (as TRL does for one iteration per generation). That is
exact, and it saves the no-grad forward that a separate recomputation would cost. They are taken at
the sampling temperature (logits / T), the distribution the rollout sampled from. The rollout's own
log-probabilities (from the KV-cached, possibly speculative decode) are not used in the loss; they
serve as a consistency check: when they describe the full tempered distribution (``top_p == 1``,
``top_k == 0``), their mean absolute difference to the training forward's must stay below
``logprob_tolerance``, which catches misaligned tokens, stale weights or a lossy rollout at once.

Rollout precision. ``rollout_dtype="bfloat16"`` samples on a bf16 mirror of the fp32 policy
(about 2.5x faster decoding on CPUs with AMX, and what vLLM does on GPUs), refreshed after every
optimizer step; the loss is still computed by the fp32 policy. The sampling policy is then the
bf16 rounding of the trained one: ``old_logprobs`` stay the fp32 forward's (the usual
training/inference mismatch of RL stacks; the log-probability check bounds it, with the 16-bit
tolerance). Speculative decoding is lossless with respect to the bf16 mirror it verifies on.

Resume. A run resumed from a Lightning checkpoint (``Trainer.fit(ckpt_path=...)``, ``tlt-lightning fit
--ckpt_path``) continues bit for bit like the uninterrupted run, by default, whenever that run is
itself reproducible (same seed, machine, thread count and settings). The checkpoint holds everything
the next steps depend on: the policy and optimizer (Lightning), the prompt loader's position
(:class:`~tlt_lightning.rl.PromptIndexLoader`), this module's seed and the global torch / Python /
NumPy RNG states (``checkpoint["grpo"]``, 15 KB; rollout generators are a function of ``(seed,
global_step, rank)``), and the callbacks' states: the spot drafter's weights, optimizer and rollout
buffer (:class:`~tlt_lightning.callbacks.SpotDrafterCallback` ``save_buffer=True``, the default)
and the bandit's statistics and RNG (:class:`~tlt_lightning.callbacks.BanditCallback`, 9 KB). The
buffer is the only part that grows: the bf16 hidden-state features of recent responses (1.1 KB per
response token on SmolLM2-135M), at most ``buffer_mb`` (256 MiB). Measured: 2.2 MiB after 2 steps of
``configs/grpo_smollm2.yaml`` (64 responses of ~22 tokens; the whole checkpoint, policy and AdamW
included, is 1.67 GB), 0.18 MiB on tiny-llama after 4 steps of 16 x 16 tokens. What a
checkpoint cannot hold is the clock: a bandit that learns from wall time (the default;
``BanditCallback(reproducible=True)`` learns from a modelled cost) or drafter training bounded by
seconds (``SpotDrafterCallback(max_seconds_per_rollout=...)`` when the step bound is not reached
first) makes the uninterrupted run and the resumed one differ as two uninterrupted runs would.
Resuming with other settings (``seed``, ``lr``, ...) is refused by ``tlt-lightning fit`` unless
``--resume_overrides=apply``; a changed seed then warns here.

Distributed. Each rank rolls out its own share of prompts (Lightning's ``DistributedSampler``);
DDP all-reduces the gradients. Token-level aggregation divides by the token count of *all* ranks
(all-reduced), so the averaged gradient is exactly the global token mean. Micro-batches other than
the last skip DDP's gradient sync (``block_backward_sync``); the last one syncs the accumulated
gradients. Cross-rank decisions (a failing reward, a non-finite loss) go through
``trainer.strategy`` so that every rank stops together instead of hanging in a collective.
"""

from __future__ import annotations

import copy
import hashlib
import math
import random
import time
import warnings
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict
from typing import Any, NamedTuple, Protocol

import lightning as L
import torch
from lightning.pytorch.strategies import ParallelStrategy
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
from tlt_lightning.rl.grpo import AGGREGATIONS, GRPOLossOutput, group_advantages, grpo_loss
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


class RewardError(RuntimeError):
    """A reward function raised or returned a non-finite value; the message names task and prompt."""


class NonFiniteLossError(FloatingPointError):
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


def _global_rng_state() -> dict[str, Any]:
    """The global random states (torch CPU and CUDA, Python, NumPy) in checkpointable form."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        return state
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    return state


def _set_global_rng_state(state: Mapping[str, Any]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _rollout_seed(seed: int, step: int, rank: int) -> int:
    digest = hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


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


def _check(condition: bool, name: str, value: Any, allowed: str) -> None:
    if not condition:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _StepCheck(NamedTuple):
    """What :meth:`GRPOModule._optimize` hands its ``on_before_optimizer_step`` (clip and check there)."""

    finite: bool  # every micro-batch loss was finite
    drift: torch.Tensor  # mean |policy - rollout| log-probability per completion token
    tolerance: float | None  # None: the log-probability check is off
    loss: torch.Tensor
    grad_norm: torch.Tensor | None = None  # set by the hook: the norm before clipping


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
        group_size: ``G``, rollouts per prompt.
        prompts_per_step: ``P``, prompts per optimizer step *per rank*.
        max_new_tokens: longest response.
        temperature: sampling temperature (``> 0``: GRPO needs different samples per group).
        top_p: nucleus mass.
        top_k: top-k filter (``0`` = off).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        clip_eps: lower clip range of the importance ratio.
        clip_eps_high: upper clip range (DAPO clip-higher); default ``clip_eps``.
        kl_coef: weight of the k3 KL to a frozen copy of the initial policy; ``0`` loads no copy.
        scale_advantages: divide advantages by the group std (``False``: Dr. GRPO).
        aggregation: ``"token"`` (DAPO) or ``"sequence"`` loss aggregation.
        micro_batch_size: sequences per forward/backward (gradient accumulation inside the
            optimizer step); ``None``: all at once. The forward holds ``[B, T, vocab]`` fp32 logits
            and their log-softmax: SmolLM2 (49k vocabulary), 32 sequences of 384 tokens, is ~5 GB.
        max_grad_norm: gradient clipping norm; ``None``: no clipping.
        gradient_checkpointing: recompute activations in backward (less memory, ~30% slower).
        speculative: use speculative decoding whenever a drafter is attached (``False``: always
            plain decoding, e.g. for a baseline run).
        drafter_kind: ``"eagle1"``/``"eagle3"``: create a fresh drafter of that kind at setup
            when none is attached; ``None``: none (a callback may attach one).
        drafter_path: load the drafter from this :func:`~tlt_lightning.drafter.save_drafter`
            directory instead (e.g. a warmed-up one), or from a ``models:/`` or ``runs:/`` MLflow URI
            of one (:func:`~tlt_lightning.drafter.load_drafter`).
        sd_steps: draft depth of the default strategy (always a chain).
        threshold: speculate only while fewer requests than this are active.
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
        task: TaskConfig | dict[str, Any] | None = None,
        group_size: int = 4,
        prompts_per_step: int = 4,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        kl_coef: float = 0.0,
        scale_advantages: bool = True,
        aggregation: str = "token",
        micro_batch_size: int | None = 8,
        max_grad_norm: float | None = 1.0,
        gradient_checkpointing: bool = False,
        speculative: bool = True,
        drafter_kind: str | None = None,
        drafter_path: str | None = None,
        sd_steps: int = 4,
        threshold: int = 32,
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
        if isinstance(task, Mapping):
            task = TaskConfig(**task)
        if task is not None and not isinstance(task, TaskConfig):
            raise TypeError(
                f"task must be a TaskConfig, a dict of its fields or None, got {type(task).__name__}"
            )
        _check(_is_int(group_size) and group_size >= 2, "group_size", group_size,
               "an int >= 2 (GRPO's advantage is a reward minus its group's mean: a group of 1 has "
               "advantage 0 everywhere and trains nothing; use 4-16)")
        for name, value in (("prompts_per_step", prompts_per_step), ("sd_steps", sd_steps),
                            ("threshold", threshold)):
            _check(_is_int(value) and value >= 1, name, value, "an int >= 1")
        _check(isinstance(max_abs_reward, (int, float)) and not isinstance(max_abs_reward, bool)
               and 0 < max_abs_reward < math.inf, "max_abs_reward", max_abs_reward, "a finite number > 0")
        _check(micro_batch_size is None or (_is_int(micro_batch_size) and micro_batch_size >= 1),
               "micro_batch_size", micro_batch_size, "an int >= 1 or None")
        _check(_is_int(seed) and seed >= 0, "seed", seed, "an int >= 0")
        _check(0 < temperature < math.inf, "temperature", temperature,
               "finite and > 0 (greedy rollouts give every sample of a group the same reward)")
        _check(lr > 0, "lr", lr, "> 0")
        _check(weight_decay >= 0, "weight_decay", weight_decay, ">= 0")
        _check(kl_coef >= 0, "kl_coef", kl_coef, ">= 0")
        _check(aggregation in AGGREGATIONS, "aggregation", aggregation, f"one of {AGGREGATIONS}")
        _check(max_grad_norm is None or max_grad_norm > 0, "max_grad_norm", max_grad_norm, "> 0 or None")
        _check(logprob_tolerance is None or logprob_tolerance > 0, "logprob_tolerance", logprob_tolerance,
               "> 0 or None")
        _check(rollout_dtype in (None, "auto", "float32", "bfloat16", "float16"), "rollout_dtype", rollout_dtype,
               "'auto', 'float32', 'bfloat16', 'float16' or None")
        _check(weight_layout in WEIGHT_LAYOUTS, "weight_layout", weight_layout, f"one of {WEIGHT_LAYOUTS}")
        _check(drafter_kind in (None, "eagle1", "eagle3"), "drafter_kind", drafter_kind,
               "'eagle1', 'eagle3' or None")
        _check(prompt_source is None or isinstance(prompt_source, PromptSource), "prompt_source",
               prompt_source, "a PromptSource (name, __len__, prompt_ids, score) or None")
        _check(rollout_backend in ROLLOUT_BACKENDS, "rollout_backend", rollout_backend, f"one of {ROLLOUT_BACKENDS}")
        self.vllm_rollouts = VLLMRollouts(vllm) if rollout_backend == "vllm" else None  # validates `vllm`
        # Also validates max_new_tokens / top_p / top_k, naming the field.
        RolloutConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
        self.save_hyperparameters(ignore=["prompt_source", "task"])
        self.task_config = task or TaskConfig()
        self.hparams["task"] = asdict(self.task_config)
        self.automatic_optimization = False

        self.prompt_source: PromptSource | None = prompt_source
        self.draft_strategy: DraftStrategy = DraftSpec(sd_steps)
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
        self._step_check: _StepCheck | None = None  # set while _optimize's opt.step() runs

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
        if hp.kl_coef > 0:
            self.reference = self.configure_reference().eval().requires_grad_(False)
        if self.prompt_source is None:
            self.prompt_source = self.configure_prompt_source()
        if self.drafter is None and hp.drafter_path is not None:
            self.drafter = load_drafter(hp.drafter_path, self.rollout_target)
        elif self.drafter is None and hp.drafter_kind is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(hp.seed)
                self.drafter = Drafter(DrafterConfig.from_target(self.rollout_target, kind=hp.drafter_kind),
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
        if hp.gradient_checkpointing:
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
        hp = self.hparams
        return torch.optim.AdamW(self.policy.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)

    def train_dataloader(self) -> PromptIndexLoader:
        # Sequential order (reasoning-gym already draws its problems at random); under DDP Lightning
        # swaps in a DistributedSampler that shuffles with a fixed seed per epoch. Either order is a
        # function of the epoch alone, so the loader's state makes mid-epoch resume exact.
        P, n = self.hparams.prompts_per_step, len(self.prompt_source)
        if n < P:
            raise ValueError(
                f"prompts_per_step={P} is more than the {n} prompts of task {self.prompt_source.name!r}"
            )
        return PromptIndexLoader(IndexDataset(n), batch_size=P, shuffle=False, drop_last=True)

    # ------------------------------------------------------------------------------ hooks
    def rollout_config(self) -> RolloutConfig:
        hp = self.hparams
        return RolloutConfig(max_new_tokens=hp.max_new_tokens, temperature=hp.temperature, top_p=hp.top_p,
                             top_k=hp.top_k, feature_layers=tuple(self.rollout_feature_layers))

    def add_rollout_listener(self, listener: RolloutListener) -> None:
        """Call ``listener.before_rollout()`` / ``listener.after_rollout(result)`` around the rollout of
        every training step (not around other :meth:`rollout` calls), in the order added."""
        self._rollout_listeners.append(listener)

    def remove_rollout_listener(self, listener: RolloutListener) -> None:
        """Stop calling ``listener``; one that was not added is ignored."""
        self._rollout_listeners = [x for x in self._rollout_listeners if x is not listener]

    def rollout_generator(self) -> torch.Generator:
        """The random source of this step's rollouts: a function of (seed, global_step, rank)."""
        seed = _rollout_seed(self.hparams.seed, self.global_step, self.global_rank)
        return torch.Generator(device=self.device).manual_seed(seed)

    def rollout(
        self, prompts: Sequence[Sequence[int]], generator: torch.Generator | None = None
    ) -> RolloutResult:
        """Sample one response per prompt on the current policy (speculatively when a drafter is attached)."""
        hp, config = self.hparams, self.rollout_config()
        progress = hp.rollout_progress and self.global_rank == 0
        was_training = self.policy.training
        self.policy.eval()
        try:
            if self.vllm_rollouts is not None:
                policy = self.rollout_policy if self.rollout_policy is not None else self.policy
                return self.vllm_rollouts.generate(
                    prompts, config, policy=policy, drafter=self.drafter if hp.speculative else None,
                    target=self.rollout_target, step=self.global_step, generator=generator, progress=progress,
                )
            if self.drafter is not None and hp.speculative:
                backend = SpeculativeRolloutLoop(
                    self.rollout_target, self.drafter, config, self.draft_strategy, threshold=hp.threshold
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
        source, G = self.prompt_source, self.hparams.group_size
        total, correct = [], []
        for j, (index, r) in enumerate(zip(indices.tolist(), result.rollouts)):
            where = (f"task {source.name!r}{_reward_fn_name(source)} on prompt index {index} "
                     f"(sample {j % G} of its group)")
            try:
                reward = source.score(index, r.prompt_ids, r.token_ids)
            except Exception as err:  # user reward code: re-raise with where it failed
                raise RewardError(f"the reward of {where} failed: {type(err).__name__}: {err}") from err
            total.append(_reward_value(reward, "total", where, self.hparams.max_abs_reward))
            correct.append(_reward_value(reward, "correctness", where, self.hparams.max_abs_reward))
        return RewardBatch(torch.tensor(total, dtype=torch.float32),
                           torch.tensor(correct, dtype=torch.float32))

    def policy_logprobs(self, batch: PolicyBatch) -> torch.Tensor:
        """``[B, T]`` the policy's log-probabilities of the completion tokens (with grad)."""
        return completion_logprobs(self.policy, batch, self.hparams.temperature)

    def reference_logprobs(self, batch: PolicyBatch) -> torch.Tensor:
        """``[B, T]`` the KL reference's log-probabilities of the completion tokens (called without grad)."""
        return completion_logprobs(self.reference, batch, self.hparams.temperature)

    def policy_loss(
        self, batch: PolicyBatch, logprobs: torch.Tensor, num_items: torch.Tensor
    ) -> GRPOLossOutput:
        """The GRPO loss of one micro-batch; ``num_items`` normalises it over the whole step.

        ``old_logprobs`` are ``logprobs`` detached: one optimizer step per rollout batch, so the
        sampling policy is the current one (see the module docstring).
        """
        hp, ref = self.hparams, None
        if self.reference is not None:
            with torch.no_grad():
                ref = self.reference_logprobs(batch)
        return grpo_loss(
            logprobs, logprobs.detach(), batch.advantages, batch.mask, clip_eps=hp.clip_eps,
            clip_eps_high=hp.clip_eps_high, kl_coef=hp.kl_coef, ref_logprobs=ref, aggregation=hp.aggregation,
            num_items=num_items,
        )

    # ------------------------------------------------------------------------------ the step
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, Any]:
        hp, G = self.hparams, self.hparams.group_size
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
        advantages = group_advantages(rewards.total, G, scale=hp.scale_advantages)

        start = time.perf_counter()
        parts = self._optimize(policy_batch(result, advantages, self.device))
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
            rewards = self.compute_rewards(indices, result)
            if not isinstance(rewards, RewardBatch):
                raise TypeError(f"compute_rewards must return a RewardBatch, got {type(rewards).__name__}")
            if rewards.total.shape != indices.shape or rewards.correctness.shape != indices.shape:
                raise ValueError(
                    f"compute_rewards must return [{indices.numel()}] rewards (one per rollout), got "
                    f"total {list(rewards.total.shape)} and correctness {list(rewards.correctness.shape)}"
                )
            limit = self.hparams.max_abs_reward
            for field in ("total", "correctness"):  # also for an overridden compute_rewards
                values = getattr(rewards, field)
                bad = (~torch.isfinite(values) | (values.abs() > limit)).nonzero()
                if bad.numel():
                    j = int(bad[0])
                    raise RewardError(
                        f"the reward {field} of task {self.prompt_source.name!r} is {float(values[j])} on "
                        f"prompt index {int(indices[j])} (sample {j % self.hparams.group_size} of its "
                        "group): "
                        f"rewards must be finite and within +-max_abs_reward={limit:g}"
                    )
        except Exception as err:  # held until every rank knows, so that none hangs in a collective
            error = err
        if self._any_rank(error is not None):
            if error is None:
                raise RewardError("stopping: the reward function failed on another rank (see its error)")
            raise error
        return rewards

    def _optimize(self, data: PolicyBatch) -> dict[str, torch.Tensor]:
        """Accumulate the gradient over micro-batches, then the optimizer step (clipped and checked in
        :meth:`on_before_optimizer_step`)."""
        hp, strategy = self.hparams, self.trainer.strategy
        opt = self.optimizers()
        N = data.advantages.shape[0]
        if hp.aggregation == "token":
            count = data.mask.sum().float()
        else:
            count = torch.tensor(float(N), device=self.device)
        # Per-rank denominator such that DDP's gradient average is the global token (sequence) mean.
        num_items = strategy.reduce(count.clone(), reduce_op="sum") / self.trainer.world_size
        # Zero-advantage sequences have zero gradient without a KL term: skip their forward.
        rows = torch.arange(N, device=self.device)
        if hp.kl_coef == 0:
            rows = rows[data.advantages != 0]
            if rows.numel() == 0:  # still one backward, so DDP syncs (zero) gradients on every rank
                rows = torch.zeros(1, dtype=torch.long, device=self.device)
        chunks = rows.split(hp.micro_batch_size or rows.numel())
        check_logprobs = hp.check_logprobs and hp.top_p == 1 and hp.top_k == 0
        sixteen_bit_training = str(self.trainer.precision).startswith(("16", "bf16"))  # e.g. "bf16-mixed"
        full = hp.dtype == "float32" and self.rollout_dtype in (None, "float32") and not sixteen_bit_training
        tolerance = hp.logprob_tolerance or (0.01 if full else 0.2)
        sums = dict.fromkeys(("loss", "pg_loss", "kl", "clip", "ratio", "tokens", "drift"), 0.0)
        finite = True
        opt.zero_grad()
        for k, idx in enumerate(chunks):
            mb = data.select(idx)
            sync = k == len(chunks) - 1
            local = not sync and isinstance(strategy, ParallelStrategy)
            with strategy.block_backward_sync() if local else nullcontext():
                logprobs = self.policy_logprobs(mb)
                out = self.policy_loss(mb, logprobs, num_items)
                finite &= bool(torch.isfinite(out.loss))
                self.manual_backward(out.loss)
            tokens = mb.mask.sum().float()
            for key, value in (("loss", out.loss), ("pg_loss", out.pg_loss), ("kl", out.kl)):
                sums[key] += value.detach()
            sums["clip"] += out.clip_fraction * tokens
            sums["ratio"] += out.ratio_mean * tokens
            sums["tokens"] += tokens
            sums["drift"] += ((logprobs.detach() - mb.rollout_logprobs).abs() * mb.mask).sum()
        drift = sums["drift"] / max(float(sums["tokens"]), 1.0)
        self._step_check = _StepCheck(finite, drift, tolerance if check_logprobs else None, sums["loss"])
        # Inside opt.step(): the callbacks' on_before_optimizer_step, ours (clip and check), the update.
        try:
            opt.step()
            grad_norm = self._step_check.grad_norm
        finally:
            self._step_check = None
        assert grad_norm is not None, "the optimizer step ran without Lightning's on_before_optimizer_step"
        self.sync_rollout_policy()
        tokens = max(float(sums["tokens"]), 1.0)
        return {
            "loss": sums["loss"], "pg_loss": sums["pg_loss"], "kl": sums["kl"],
            "clip_fraction": sums["clip"] / tokens, "ratio_mean": sums["ratio"] / tokens,
            "grad_norm": grad_norm.detach(), "logprob_drift": drift,
        }

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Clip and check the step's accumulated gradient, right before the update.

        Lightning calls this inside ``opt.step()`` of :meth:`_optimize`, after every callback's
        ``on_before_optimizer_step`` (the order of automatic optimization, where Lightning clips at
        this point too). So a callback that rescales the gradients in its own hook, such as
        :class:`~tlt_lightning.efficiency.LayerwisePrecisionCallback` unscaling its per-group fp16
        gradients, does so before they are clipped and checked; one that drops every gradient (a
        skipped fp16 step) leaves a zero norm and an optimizer step that changes nothing.

        Raises (on every rank, before the update, the gradients zeroed) when the loss, the gradient
        norm or the log-probability check failed on any rank. A subclass overriding this hook must
        call ``super()``.
        """
        check = self._step_check
        if check is None:  # not a step of _optimize: nothing to check
            return
        hp = self.hparams
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), hp.max_grad_norm or math.inf)
        finite = check.finite and bool(torch.isfinite(grad_norm))
        drifted = check.tolerance is not None and bool(check.drift > check.tolerance)
        self._step_check = check._replace(grad_norm=grad_norm)
        if self._any_rank(not finite or drifted):
            optimizer.zero_grad()
            where = f"step {self.global_step} (rank {self.global_rank})"
            if not finite:
                raise NonFiniteLossError(
                    f"non-finite loss or gradient at {where}: loss {float(check.loss)}, grad norm "
                    f"{float(grad_norm)}; the optimizer step was skipped and the weights are unchanged"
                )
            if drifted:
                raise RuntimeError(
                    f"at {where} the policy's log-probabilities of the rollout tokens differ from the "
                    f"rollout's by {float(check.drift):.4g} nats on average (logprob_tolerance={check.tolerance}): "
                    "the rollout and the training forward disagree (misaligned tokens, stale weights or a lossy "
                    "rollout); the optimizer step was skipped"
                )
            raise NonFiniteLossError(
                f"stopping at {where}: another rank's loss, gradient or log-probabilities failed their check"
            )

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
        # Rollout generators derive from (seed, global_step, rank) and the prompt order from the
        # loader state Lightning saves. The global RNGs (torch, Python, NumPy; ~7 KB) are saved too,
        # so that anything drawing from them (a callback, user reward code) continues identically.
        source = self.prompt_source
        checkpoint["grpo"] = {
            "version": 2, "seed": self.hparams.seed, "rng": _global_rng_state(),
            "prompt_source": None if source is None else {"name": str(source.name), "size": len(source)},
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        grpo = checkpoint.get("grpo", {})
        saved = grpo.get("seed")
        if saved is not None and saved != self.hparams.seed:
            warnings.warn(
                f"resuming with seed={self.hparams.seed} from a checkpoint trained with seed={saved}: "
                "rollouts will differ from the uninterrupted run",
                stacklevel=2,
            )
        trained_on, source = grpo.get("prompt_source"), self.prompt_source
        if trained_on is not None and source is not None:
            now = {"name": str(source.name), "size": len(source)}
            if now != trained_on:
                warnings.warn(
                    f"resuming on prompt source {now['name']!r} ({now['size']} prompts) from a checkpoint "
                    f"trained on {trained_on['name']!r} ({trained_on['size']} prompts): the prompts, and the "
                    "run, will differ from the uninterrupted one",
                    stacklevel=2,
                )
        if "rng" in grpo:
            _set_global_rng_state(grpo["rng"])
        # The optimizer's moments are restored; its lr / weight decay are the module's settings (they
        # differ from the checkpoint's only when resumed with `--resume_overrides=apply`).
        for state in checkpoint.get("optimizer_states", []):
            for group in state.get("param_groups", []):
                group["lr"], group["weight_decay"] = self.hparams.lr, self.hparams.weight_decay
