"""A TRL ``GRPOTrainer`` peer for the end-to-end GRPO benchmark: the same training on TRL.

:func:`run_trl_grpo` trains ``steps`` GRPO optimizer steps with TRL's ``GRPOTrainer`` on the CPU and
times every one of them, so that the seconds per optimizer step of our :class:`~tlt_lightning.rl.GRPOModule`
can be set against a widely used implementation of the same algorithm on the same problem.

What one measured step is: everything between the ``Trainer``'s ``on_step_begin`` and ``on_step_end``
callbacks, i.e. sampling ``prompts_per_step x group_size`` completions (HF ``generate``), scoring them
with the task's reward, the group advantages, the policy forward/backward and the AdamW step (with
gradient clipping and the learning-rate scheduler step). Logging, which TRL does after ``on_step_end``,
is outside. Wall clock (``time.perf_counter``) and this process's CPU time (``time.process_time``)
are both reported: on a shared machine the wall clock also counts waiting for a core.

How the setup matches ``GRPOModule``'s (with its defaults):

* same model and dtype (:func:`~tlt_lightning.models.load_model`), trained in that dtype without
  autocast (``bf16=False``, ``fp16=False``), no gradient checkpointing;
* same prompts in the same order: the rendered chat-template text of
  :class:`~tlt_lightning.rl.tasks.TaskDataset`, passed as plain text so TRL does not apply the chat
  template again (checked: TRL's tokenization of each text gives exactly ``dataset[i].input_ids``),
  sequential without shuffling (``shuffle_dataset=False``), ``prompts_per_step`` prompts per step,
  incomplete last batches dropped, the epoch restarting at prompt 0, like our ``PromptIndexLoader``;
* same reward: ``dataset.score(index, completion_text).total`` on the completion decoded with the
  special tokens skipped (TRL forwards the ``index`` column to the reward function);
* same sampling: ``temperature``, ``top_p=1``, ``top_k=0``, at most ``max_new_tokens`` new tokens,
  stopping at the model's EOS tokens;
* same loss: one optimizer step per generation batch (``num_iterations=1``, one gradient-accumulation
  step), advantages normalised by the group's standard deviation (``scale_rewards="group"``), the PPO
  clip at ``epsilon=0.2``, token-level aggregation over the whole batch (``loss_type="dapo"``, our
  ``aggregation="token"``), no KL term (``beta=0``, no reference model), and old log-probabilities
  equal to the current detached ones (exact for one iteration, as in ours);
* same optimizer: ``torch.optim.AdamW`` (``optim="adamw_torch"``), weight decay 0, constant learning
  rate ``lr`` (no warm-up or decay), gradient norm clipped at 1.

What differs (and is part of what the comparison measures):

* TRL samples with HF ``generate`` on a static, left-padded batch: every sequence runs until the
  longest one finishes, and padding tokens are computed; our rollout engine drops finished
  requests, shares one KV cache layout across the batch, and can decode speculatively with a drafter;
* TRL computes the log-probabilities with its fused, chunked LM head (no full logits tensor); ours
  computes them from the logits with ``logsumexp``;
* the random streams differ (TRL seeds the global generators; ours seeds a generator per step), so
  the completions, rewards and weights are not the same sample for sample;
* the advantage's standard-deviation epsilon is ``1e-4`` in TRL and ``1e-6`` in ours.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.trl_peer_trainer import grpo_config, task_dataset, train
from benchmarks.trl_peer_trainer import step_records as trainer_step_records
from tlt_lightning.rl.tasks import TaskConfig
from tlt_lightning.validation import is_int

__all__ = ["TRL_EXTRA", "run_trl_grpo"]

# The optional dependency group of pyproject.toml that installs the pinned TRL.
TRL_EXTRA = "peers"
_DTYPES = ("float32", "bfloat16", "float16")


def _import_trl() -> Any:
    try:
        import trl
    except ImportError as err:
        raise ImportError(
            f"the TRL peer needs the 'trl' package: install the '{TRL_EXTRA}' extra "
            f"(pip install 'tlt-lightning[{TRL_EXTRA}]'), which pins a TRL release that leaves torch and "
            "transformers as they are"
        ) from err
    return trl


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _validate(
    model: Any,
    task: Any,
    steps: Any,
    prompts_per_step: Any,
    group_size: Any,
    max_new_tokens: Any,
    lr: Any,
    temperature: Any,
    seed: Any,
    dtype: Any,
    output_dir: Any,
) -> None:
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty registry name or model directory, got {model!r}")
    if not isinstance(task, TaskConfig):
        # ValueError for every bad argument, type or value, so callers catch one kind.
        raise ValueError(f"task must be a TaskConfig, got {type(task).__name__}")  # noqa: TRY004
    for name, value, low in (
        ("steps", steps, 1),
        ("prompts_per_step", prompts_per_step, 1),
        ("group_size", group_size, 2),
        ("max_new_tokens", max_new_tokens, 1),
        ("seed", seed, 0),
    ):
        if not is_int(value) or value < low:
            extra = " (GRPO needs 2 completions per prompt for an advantage)" if name == "group_size" else ""
            raise ValueError(f"{name} must be an int >= {low}{extra}, got {value!r}")
    if prompts_per_step > task.size:
        raise ValueError(
            f"prompts_per_step={prompts_per_step} is more than the {task.size} prompts of task {task.name!r} "
            "(task.size)"
        )
    if not _is_real(lr) or lr <= 0:
        raise ValueError(f"lr must be a finite float > 0, got {lr!r}")
    if not _is_real(temperature) or temperature <= 0:
        raise ValueError(
            f"temperature must be a finite float > 0 (greedy rollouts give every sample of a group the same "
            f"reward), got {temperature!r}"
        )
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype!r}")
    if not isinstance(output_dir, (str, Path)) or not str(output_dir):
        raise ValueError(f"output_dir must be a non-empty str or Path, got {output_dir!r}")


def _probe_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the parameters of the deepest decoder block (all of them when there are no blocks):
    every parameter gets a gradient, so these change whenever an optimizer step moved the policy."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    layer_ids = {int(part) for n, _ in named for part in n.split(".") if part.isdigit()}
    if layer_ids:
        last = str(max(layer_ids))
        named = [(n, p) for n, p in named if last in n.split(".")]
    return {n: p.detach().clone() for n, p in named}


def run_trl_grpo(
    model: str,
    task: TaskConfig,
    steps: int,
    prompts_per_step: int,
    group_size: int,
    max_new_tokens: int,
    lr: float,
    temperature: float = 1.0,
    seed: int = 0,
    dtype: str = "float32",
    output_dir: str | Path = "runs/bench/trl",
    bf16_mixed: bool = False,
    micro_batch_size: int | None = None,
) -> dict[str, Any]:
    """Train ``steps`` GRPO optimizer steps with TRL's ``GRPOTrainer`` on the CPU and time each one.

    The setup mirrors :class:`~tlt_lightning.rl.GRPOModule`'s defaults (see the module docstring for
    what matches and what differs): same model and dtype, same task prompts in the same order, same
    reward, one optimizer step per ``prompts_per_step x group_size`` completions, no KL, AdamW at a
    constant ``lr``.

    Args:
        model: registry name (``"smollm2-135m"``) or local HF directory; it needs a tokenizer with a
            chat template (the tiny random models have none).
        task: the reasoning-gym task whose prompts and rewards are used.
        steps: optimizer steps to train and time.
        prompts_per_step: distinct prompts per optimizer step (``<= task.size``).
        group_size: completions per prompt (``>= 2``).
        max_new_tokens: longest completion.
        lr: learning rate.
        temperature: sampling temperature (``> 0``).
        seed: TRL's seed (model sampling; the prompts are the task's, fixed by ``task.seed``).
        dtype: parameter dtype, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        output_dir: the ``Trainer``'s output directory (nothing is saved there: no checkpoints, no
            reports).
        bf16_mixed: train with bf16 autocast (TRL's ``bf16=True``), as our module under Lightning's
            ``precision="bf16-mixed"``.
        micro_batch_size: completions per forward/backward, as ``OptimConfig(micro_batch_size=)`` of
            ``GRPOModule`` (TRL's ``per_device_train_batch_size`` with gradient accumulation over the
            rest; one generation per optimizer step either way); ``None``: all at once. It must
            divide ``prompts_per_step * group_size``.

    Returns:
        ``{"peer": "trl", "trl_version", "steps": [...], "median_step_s", "median_step_cpu_s",
        "weights_changed", "config"}``. Each step record has ``step`` (1-based), ``wall_s``,
        ``cpu_s``, ``reward_mean`` (TRL's logged mean total reward), ``reward_std``,
        ``frac_reward_zero_std`` (share of groups without reward variance, hence without gradient),
        ``correctness_mean`` (the task score alone) and ``completion_length_mean`` (tokens);
        a metric TRL did not log is ``None``. ``weights_changed`` tells whether training moved the
        policy (the last decoder block's parameters compared before and after; ``False`` when every
        group had equal rewards, which gives no gradient).

    Raises:
        ValueError: an argument is invalid; the message names it.
        ImportError: TRL is not installed (the ``peers`` extra).
        RuntimeError: TRL's tokenization of the rendered prompts differs from ours.

    Side effects: TRL seeds Python's, NumPy's and torch's global random generators; their states
    are restored when the run ends.
    """
    _validate(
        model,
        task,
        steps,
        prompts_per_step,
        group_size,
        max_new_tokens,
        lr,
        temperature,
        seed,
        dtype,
        output_dir,
    )
    batch = prompts_per_step * group_size
    micro = _micro_batch(batch, micro_batch_size)
    trl = _import_trl()
    loaded = _load_policy(model, dtype, seed)
    datasets = task_dataset(task, loaded.tokenizer)  # checks TRL's tokenization of the prompts
    settings = {
        "model": model,
        "task": task.name,
        "task_size": task.size,
        "steps": steps,
        "prompts_per_step": prompts_per_step,
        "group_size": group_size,
        "max_new_tokens": max_new_tokens,
        "lr": lr,
        "temperature": temperature,
        "seed": seed,
        "dtype": dtype,
        "bf16_mixed": bool(bf16_mixed),
    }
    config = grpo_config(trl, settings, output_dir, micro, batch // micro)
    before = _probe_parameters(loaded.model)
    records = train(trl, loaded.model, loaded.tokenizer, datasets, config)
    after = dict(loaded.model.named_parameters())
    weights_changed = any(not torch.equal(value, after[name].detach()) for name, value in before.items())
    return _result(trl, trainer_step_records(records), weights_changed, settings, config)


def _micro_batch(batch: int, micro_batch_size: Any) -> int:
    """Completions per forward/backward: ``micro_batch_size``, ``None`` for the whole ``batch``."""
    micro = batch if micro_batch_size is None else micro_batch_size
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1 or batch % micro:
        raise ValueError(
            f"micro_batch_size must be an int >= 1 dividing prompts_per_step * group_size = {batch} "
            f"(or None), got {micro_batch_size!r}"
        )
    return micro


def _load_policy(model: str, dtype: str, seed: int) -> Any:
    """The policy and its tokenizer (:func:`~tlt_lightning.models.load_model`); it must have one."""
    from tlt_lightning.models import load_model

    loaded = load_model(model, dtype=dtype, seed=seed)
    if loaded.tokenizer is None:
        raise ValueError(
            f"model {model!r} has no tokenizer, so the task's text prompts cannot be used: pass a model "
            "with a tokenizer and a chat template (e.g. 'smollm2-135m')"
        )
    return loaded


def _result(
    trl: Any, steps: list[dict[str, Any]], weights_changed: bool, settings: dict[str, Any], config: Any
) -> dict[str, Any]:
    """:func:`run_trl_grpo`'s result: the step records, their medians and the whole configuration."""
    walls = [r["wall_s"] for r in steps if r["wall_s"] is not None]
    cpus = [r["cpu_s"] for r in steps if r["cpu_s"] is not None]
    return {
        "peer": "trl",
        "trl_version": trl.__version__,
        "steps": steps,
        "median_step_s": float(statistics.median(walls)) if walls else float("nan"),
        "median_step_cpu_s": float(statistics.median(cpus)) if cpus else float("nan"),
        "weights_changed": weights_changed,
        "config": {
            **settings,
            "per_device_train_batch_size": config.per_device_train_batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "torch_threads": torch.get_num_threads(),
        },
    }
