"""The TRL side of :mod:`.trl_peer`: the task's prompts as TRL's dataset, the ``GRPOConfig`` of our
module's defaults, the training with a step timer, and the step records."""

from __future__ import annotations

import dataclasses
import math
import random
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tlt_lightning.rl.tasks import TaskConfig

__all__ = ["grpo_config", "step_records", "step_timer", "task_dataset", "train"]


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def task_dataset(task: TaskConfig, tokenizer: Any) -> tuple[Any, Any]:
    """``(TaskDataset, TRL's train dataset of its rendered prompts and their indices)``.

    TRL tokenizes text prompts with ``tokenizer(text=...)`` (special tokens added by default): it must
    give exactly the token ids our module trains on, or the peer would run on other prompts.
    """
    from datasets import Dataset

    from tlt_lightning.rl.tasks import TaskDataset

    dataset = TaskDataset(task, tokenizer)
    prompts = [dataset[i] for i in range(len(dataset))]
    trl_ids = tokenizer(text=[p.text for p in prompts])["input_ids"]
    for prompt, ids in zip(prompts, trl_ids):
        if list(ids) != prompt.input_ids:
            raise RuntimeError(
                f"TRL would tokenize prompt {prompt.index} of task {task.name!r} differently from "
                f"TaskDataset ({len(ids)} vs {len(prompt.input_ids)} tokens): the tokenizer adds special "
                "tokens to the rendered chat text"
            )
    train_dataset = Dataset.from_dict(
        {"prompt": [p.text for p in prompts], "index": [p.index for p in prompts]}
    )
    return dataset, train_dataset


def step_timer(records: dict[int, dict[str, Any]]) -> Any:
    """A ``TrainerCallback`` that writes each optimizer step's times and logged metrics to ``records``."""
    from transformers import TrainerCallback

    class _StepTimer(TrainerCallback):
        # From one optimizer step's end to the next (the first from the start of training): with
        # gradient accumulation a step spans several micro-steps, and the generation before them.
        def on_train_begin(self, args, state, control, **kwargs):
            self._wall, self._cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            wall, cpu = time.perf_counter() - self._wall, time.process_time() - self._cpu
            records[state.global_step] = {"step": state.global_step, "wall_s": wall, "cpu_s": cpu}
            self._wall, self._cpu = time.perf_counter(), time.process_time()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:  # the end-of-training summary has no metrics
                return
            record = records.setdefault(state.global_step, {"step": state.global_step})
            record.update(
                reward_mean=_finite(logs.get("reward")),
                reward_std=_finite(logs.get("reward_std")),
                frac_reward_zero_std=_finite(logs.get("frac_reward_zero_std")),
                correctness_mean=_finite(logs.get("correctness_mean")),
                completion_length_mean=_finite(logs.get("completions/mean_length")),
            )

    return _StepTimer()


def grpo_config(
    trl: Any, settings: dict[str, Any], output_dir: str | Path, micro: int, accumulation: int
) -> Any:
    """TRL's ``GRPOConfig`` of our module's defaults for ``settings`` (see the module docstring)."""
    # TRL turns activation (gradient) checkpointing on by default; ours is off. transformers >= 5.2x
    # renamed the argument and warns on the old name.
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    checkpointing = (
        "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    )
    return trl.GRPOConfig(
        **{checkpointing: False},
        output_dir=str(output_dir),
        use_cpu=True,
        seed=settings["seed"],
        max_steps=settings["steps"],
        # One optimizer step = one generation batch of prompts_per_step prompts x group_size completions.
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        num_generations=settings["group_size"],
        num_iterations=1,
        shuffle_dataset=False,
        remove_unused_columns=False,
        max_completion_length=settings["max_new_tokens"],
        temperature=float(settings["temperature"]),
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=float(settings["lr"]),
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=1.0,
        bf16=settings["bf16_mixed"],
        fp16=False,
        logging_strategy="steps",
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def train(
    trl: Any, policy: torch.nn.Module, tokenizer: Any, datasets: tuple[Any, Any], config: Any
) -> dict[int, Any]:
    """Train with TRL's ``GRPOTrainer`` on the task's prompts and rewards (``datasets``: from
    :func:`task_dataset`): the step records by step.

    Python's and NumPy's global random states are restored afterwards (torch's is forked).
    """
    from transformers.trainer_callback import PrinterCallback

    dataset, train_dataset = datasets

    def task_reward(completions: list[str], index: list[int], log_metric=None, **_: Any) -> list[float]:
        scores = [dataset.score(int(i), text) for i, text in zip(index, completions)]
        if log_metric is not None:
            log_metric("correctness_mean", float(np.mean([s.correctness for s in scores])))
        return [s.total for s in scores]

    records: dict[int, dict[str, Any]] = {}
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # TRL 1.16 still reads the deprecated `is_gradient_checkpointing` of transformers 5.2x.
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning
        )
        try:
            trainer = trl.GRPOTrainer(
                model=policy,
                reward_funcs=task_reward,
                args=config,
                train_dataset=train_dataset,
                processing_class=tokenizer,
                callbacks=[step_timer(records)],
            )
            # It prints every step's log dict on stdout; the step records already hold them.
            trainer.remove_callback(PrinterCallback)
            trainer.train()
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
    return records


def step_records(records: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The step records in step order, every metric present (``None`` where TRL logged none)."""
    step_records = [records[k] for k in sorted(records)]
    for record in step_records:
        for key in (
            "wall_s",
            "cpu_s",
            "reward_mean",
            "reward_std",
            "frac_reward_zero_std",
            "correctness_mean",
            "completion_length_mean",
        ):
            record.setdefault(key, None)
    return step_records
