"""Whether spot training slows the tail it hides in (``python -m benchmarks spot --parts contention``).

A rank in its tail decodes a few requests, each step bound by reading the weights; the other ranks,
done with their share, train the drafter meanwhile. On GPUs each rank has its own device. On a CPU
the ranks' processes share the memory system and caches, so the training can slow the decode it is
meant to be hidden behind. This part times the same greedy batch-1 decode (identical tokens every
time) alone and with a drafter training in another process, alternating the two, and reports the
median step of each.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from tlt_lightning.drafter import Drafter, DrafterConfig, drafter_train_step, load_drafter, make_batches
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.reports import machine_info, median
from tlt_lightning.rl.rollout_models import rollout_mirror
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.rollout.types import Rollout
from tlt_lightning.speculative.arms import parse_arm

__all__ = ["benchmark_contention"]


def _target(model: str, dtype: str) -> HFTarget:
    """``model`` as rollouts run it: a frozen mirror in ``dtype`` (the loaded fp32 model itself for fp32)."""
    loaded = load_model(model).model
    return HFTarget(loaded.eval() if dtype == "float32" else rollout_mirror(loaded, dtype))


def _drafter(drafter_dir: str | None, target: HFTarget) -> Drafter:
    """The drafter in ``drafter_dir`` on ``target``, else a fresh one."""
    if drafter_dir is None:
        return Drafter(DrafterConfig.from_target(target), target)
    return load_drafter(drafter_dir, target)


def drafter_step(
    model: str, drafter_dir: str | None, dtype: str, length: int, batch_size: int, seed: int
) -> Callable[[], Any]:
    """One drafter training step on ``model``: ``batch_size`` sequences of ``length`` tokens with random
    tokens and features (the arithmetic and memory traffic of spot training, not its data)."""
    target = _target(model, dtype)
    torch.manual_seed(seed)
    drafter = _drafter(drafter_dir, target)
    g = torch.Generator().manual_seed(seed)
    info, n = target.info, length + 1
    features = (n, len(drafter.config.feature_layers), info.hidden_size)
    rollouts = [
        Rollout(torch.zeros(8, dtype=torch.long), torch.randint(0, info.vocab_size, (n,), generator=g),
                torch.zeros(n), "length", 0.0, 0.0, torch.randn(features, generator=g))
        for _ in range(batch_size)
    ]  # fmt: skip
    (batch,) = make_batches(rollouts, drafter.config, batch_size=batch_size)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    return lambda: drafter_train_step(drafter, target, batch, optimizer)


def _trainer(step_args: tuple, paused: Any, go: Any, stop: Any, steps: Any) -> None:
    """The other rank: trains while ``go`` is set, counting its steps, until ``stop``; keeps setting
    ``paused`` while it waits between steps (from the end of its warm-up step on)."""
    torch.set_num_threads(1)
    step = drafter_step(*step_args)
    step()  # warm-up
    while not stop.is_set():
        if go.wait(0.01):
            step()
            steps.value += 1  # the only writer
        else:
            paused.set()


def benchmark_contention(
    prompt: Sequence[int],
    model: str = "smollm2-135m",
    drafter_dir: str | None = None,
    dtype: str = "bfloat16",
    tokens: int = 128,
    decode: str = "hf",
    repeats: int = 5,
    arm: str | None = None,
    train_dtype: str = "float32",
    train_length: int = 1024,
    train_batch: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """Median batch-1 decode step of ``model`` alone vs with a drafter training in another process.

    Args:
        prompt: the one request decoded (token ids), greedily: the same ``tokens`` steps every time.
        drafter_dir: the drafter the other process trains (default: a fresh one).
        dtype: the decoding mirror's dtype.
        train_dtype: the dtype of the trainer's target and drafter: ``float32`` as the spot trainer's
            (an fp32 drafter on the fp32 policy).
        decode: the decode path (:meth:`~tlt_lightning.models.HFTarget.set_decode`); other than
            ``"hf"``, on packed weights, as the main job's rollouts run.
        repeats: alone / beside pairs, alternating.
        arm: decode speculatively at every step with this arm (``"chain4"``, ...; see
            :func:`~tlt_lightning.speculative.parse_arm`) and the drafter (``drafter_dir``, else a fresh
            one); ``None``: plain decoding.
        train_length, train_batch: the shape of the trainer's batches (default: one packed row of
            1024 tokens, the spot trainer's ``packing_budget``).

    Returns:
        ``{"alone_ms", "beside_ms", "slowdown", "trainer_steps_per_s", ...}`` (medians; ``*_all``: every
        repeat).

    Raises:
        RuntimeError: the training process died before its first step.
    """
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    paused, go, stop, steps = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Value("i", 0, lock=False)
    step_args = (model, drafter_dir, train_dtype, train_length, train_batch, seed)
    trainer = ctx.Process(target=_trainer, args=(step_args, paused, go, stop, steps), daemon=True)
    trainer.start()
    target = _target(model, dtype)
    if decode != "hf":
        target.set_weight_layout("packed")
        target.set_decode(decode)
    config = RolloutConfig(max_new_tokens=tokens, temperature=0)
    if arm is None:
        engine = RolloutEngine(target, config)
    else:
        drafter = _drafter(drafter_dir, target)
        engine = SpeculativeRolloutLoop(target, drafter, config, strategy=parse_arm(arm), threshold=2)
    prompts = [list(prompt)]
    alone, beside, rates = [], [], []
    try:
        engine.generate(prompts)  # warm-up
        while not paused.wait(1.0):  # warmed up
            if not trainer.is_alive():
                raise RuntimeError(f"the drafter training process died (exit code {trainer.exitcode})")
        for _ in range(repeats):
            alone.append(1e3 * median(engine.generate(prompts).stats.step_times))
            first, start = steps.value, time.perf_counter()
            go.set()
            time.sleep(0.2)  # the trainer is in its steps
            beside.append(1e3 * median(engine.generate(prompts).stats.step_times))
            rates.append((steps.value - first) / (time.perf_counter() - start))
            go.clear()
            paused.clear()
            paused.wait(120)  # its last step is over: the next decode runs alone
    finally:
        stop.set()
        trainer.join(timeout=60)
        if trainer.is_alive():
            trainer.terminate()
    return {
        "alone_ms": median(alone),
        "beside_ms": median(beside),
        "slowdown": median(beside) / median(alone),
        "trainer_steps_per_s": median(rates),
        "alone_ms_all": alone,
        "beside_ms_all": beside,
        "settings": {
            "model": model,
            "drafter": drafter_dir,
            "dtype": dtype,
            "train_dtype": train_dtype,
            "tokens": tokens,
            "decode": decode,
            "arm": arm,
            "repeats": repeats,
            "train_length": train_length,
            "train_batch": train_batch,
            "cpu_count": os.cpu_count(),
        },  # fmt: skip
        "machine": machine_info(),
    }
