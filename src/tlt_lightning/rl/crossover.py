"""Measure where speculation pays on this machine, once, and keep it: the step costs a bandit weighs with.

:func:`measure_step_costs` times decode steps of plain decoding and of every arm at the batch sizes
speculation may run at (:func:`calibration_sizes`), on the rollout's own target, drafter and settings,
at a context typical of the rollout's tail. :func:`calibrate_crossover` does it for a
:class:`~tlt_lightning.rl.GRPOModule` right after its graphs compile (outside any timed step), stores
the table under :func:`step_costs_path` (keyed by the machine and the settings it depends on, so a second
run reads it back) and hands it to the module's strategy
(:meth:`~tlt_lightning.scheduling.BucketedStrategy.use_step_costs`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from tlt_lightning.models.registry import cache_dir
from tlt_lightning.reports import machine_info, median
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
from tlt_lightning.rollout.drafting import DraftModel
from tlt_lightning.rollout.engine import ActiveBatch, DecodeStep, Emission, PlainStep
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.scheduling import BucketedStrategy, StepCosts
from tlt_lightning.speculative import DraftSpec, arm_key

if TYPE_CHECKING:
    from tlt_lightning.models import TargetModel
    from tlt_lightning.rl.module import GRPOModule

__all__ = ["calibrate_crossover", "calibration_sizes", "measure_step_costs", "step_costs_path"]

STEP_COSTS_VERSION = 3
"""Part of a stored table's key: raised when the engine's speed changes (2: few_rows_linear verifies, 3: and
decode steps of 2-8 rows, one- and two-row packed linears)."""
WARM_STEPS = 2  # steps of each rollout left out of the median (caches and allocator settle)
MAX_ROLLOUTS = 4  # rollouts a measurement may take when rows end early


def calibration_sizes(threshold: int) -> list[int]:
    """Batch sizes measured below ``threshold`` (speculation's range): 1-4, then about 1.5x apart, and
    ``threshold - 1``; costs in between are interpolated.

    Example:
        >>> calibration_sizes(8), calibration_sizes(32)
        ([1, 2, 3, 4, 6, 7], [1, 2, 3, 4, 6, 9, 13, 19, 28, 31])
    """
    sizes, b = [], 1
    while b < threshold:
        sizes.append(b)
        b = b + 1 if b < 4 else int(b * 1.5)
    return sorted({*sizes, threshold - 1}) if threshold > 1 else []


class _Enough(Exception):
    """Raised by :class:`_StepTimer` to end a rollout once it has timed what it needs."""


class _StepTimer:
    """Wraps a decode step: times those run with all ``B`` rows active (skipping the first
    :data:`WARM_STEPS`), and ends the rollout once it has ``wanted`` times or a row has ended."""

    def __init__(self, step: DecodeStep, B: int, wanted: int, times: list[float]) -> None:
        self.step, self.B, self.wanted, self.times, self.seen = step, B, wanted, times, 0

    def start(self, batch: ActiveBatch) -> None:
        self.step.start(batch)

    def __call__(self, batch: ActiveBatch, generator: torch.Generator | None) -> Emission:
        if batch.n < self.B or len(self.times) >= self.wanted:
            raise _Enough
        start = time.perf_counter()
        emission = self.step(batch, generator)
        self.seen += 1
        if self.seen > WARM_STEPS:
            self.times.append(time.perf_counter() - start)
        return emission


def _median_step(
    engine: RolloutEngine, new_step: Callable[[], DecodeStep], rows: list[list[int]], steps: int
) -> float | None:
    """Median seconds of ``steps`` decode steps (``new_step()``'s) with all rows active, over rollouts of
    ``rows`` (up to :data:`MAX_ROLLOUTS`: one ends where its first row does). ``None``: fewer than 3."""
    times: list[float] = []
    for attempt in range(MAX_ROLLOUTS):
        generator = torch.Generator().manual_seed(len(rows) * MAX_ROLLOUTS + attempt)
        try:
            engine.generate(rows, generator=generator, step=_StepTimer(new_step(), len(rows), steps, times))
        except _Enough:
            pass
        if len(times) >= steps:
            break
    return median(times) if len(times) >= 3 else None


def measure_step_costs(
    target: TargetModel,
    drafter: DraftModel,
    config: RolloutConfig,
    prompt: Sequence[int],
    batch_sizes: Sequence[int],
    arms: Sequence[DraftSpec],
    *,
    context: int,
    steps: int = 10,
    progress: Callable[[str], None] | None = None,
) -> StepCosts:
    """Median seconds of one decode step, plain and with each arm, at each of ``batch_sizes``.

    Each measurement decodes ``B`` copies of ``prompt`` (repeated to ``context`` tokens) with ``config``'s
    sampling and feature layers, from a generator of its own, and times ``steps`` steps with all ``B`` rows
    active (after :data:`WARM_STEPS`); where rows end early (EOS) it tries again, and an arm with fewer
    than three such steps at ``B`` is left out there.

    Args:
        target: the rollout's target (compiled graphs already built, or they compile here).
        drafter: the drafter speculative steps draft with.
        config: the rollout's settings (``max_new_tokens`` is replaced).
        prompt: token ids the context is made of.
        batch_sizes: active requests to measure at.
        arms: speculative arms to measure (plain decoding always is).
        context: cached positions per row when the steps run.
        steps: timed steps per measurement.
        progress: called with a line per batch size (e.g. ``print``).
    """
    if not prompt or context < 1 or steps < 1:
        raise ValueError(
            f"need a non-empty prompt, context >= 1 and steps >= 1, got {len(prompt)}, {context}, {steps}"
        )
    ids = (list(prompt) * (context // len(prompt) + 1))[:context]
    depth = max((arm.num_steps for arm in arms), default=0)
    config = replace(config, max_new_tokens=(steps + WARM_STEPS + 1) * (depth + 1))  # no row ends at its cap
    table: dict[int, dict[str, float]] = {}
    for B in batch_sizes:
        start, rows = time.perf_counter(), [ids] * B
        engine = RolloutEngine(target, config)
        row = {"off": _median_step(engine, lambda: PlainStep(target, config), rows, steps)}
        for arm in arms:
            loop = SpeculativeRolloutLoop(target, drafter, config, arm, threshold=B + 1)
            row[arm_key(arm)] = _median_step(loop.engine, loop.decode_step, rows, steps)
        table[B] = {key: s for key, s in row.items() if s is not None}
        if progress is not None:
            progress(
                f"step costs at {B} rows: "
                + ", ".join(f"{key} {s * 1e3:.1f} ms" for key, s in table[B].items())
                + f" ({time.perf_counter() - start:.0f} s)"
            )
    return StepCosts({B: row for B, row in table.items() if "off" in row}, context, {})


def step_costs_path(key: dict[str, Any]) -> Path:
    """Where the step costs measured under ``key`` (machine and settings) are stored: the library's cache
    (:func:`~tlt_lightning.models.registry.cache_dir`), ``step_costs/``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return cache_dir() / "step_costs" / f"{digest}.json"


def _costs_key(
    module: GRPOModule, sizes: list[int], arms: Sequence[DraftSpec], context: int
) -> dict[str, Any]:
    """What a stored table must match: the machine, the model, its rollout settings, the drafter's shape."""
    machine = {k: v for k, v in machine_info().items() if k != "python"}
    hp = module.hparams
    drafter_config = getattr(module.drafter, "config", None)
    compile_config = getattr(module.rollout_target, "compile_config", None)
    key = {
        "version": STEP_COSTS_VERSION,
        "machine": machine,
        "compile_config": None if compile_config is None else repr(compile_config),
        "model": str(hp.model),
        "rollout_dtype": module.rollout_dtype,
        "decode": module.rollout_decode,
        "weight_layout": hp.weight_layout,
        "drafter": asdict(drafter_config) if drafter_config is not None else None,
        "feature_layers": list(module.rollout_config().feature_layers),
        "sizes": sizes,
        "arms": [arm_key(a) for a in arms],
        "context": context,
    }
    return json.loads(json.dumps(key, default=str))  # as stored: tuples become lists


def calibrate_crossover(
    module: GRPOModule, arms: Sequence[DraftSpec], threshold: int | None = None
) -> StepCosts | None:
    """Give ``module``'s strategy the step costs of this machine (stored ones, else measured now and stored).

    Runs where ``module.speculative_config.crossover`` asks for it (``"auto"``: with compiled rollouts,
    whose compile already costs minutes; ``"measure"``: always; ``"off"``: never), with a drafter, a
    :class:`~tlt_lightning.scheduling.BucketedStrategy` that learns from wall time and ``arms``.
    ``threshold``: speculation's range (default: the module's ``speculative.threshold``).
    Returns the costs, or ``None`` where it did not run.
    """
    strategy, mode = module.draft_strategy, module.speculative_config.crossover
    wanted = mode == "measure" or (mode == "auto" and module.rollout_decode == "compiled")
    if not (wanted and arms and module.drafter is not None and module.speculative_config.enabled):
        return None
    if not isinstance(strategy, BucketedStrategy) or strategy.reproducible:
        return None
    config = module.rollout_config()
    prompt = module.prompt_source.prompt_ids(0)
    context = len(prompt) + config.max_new_tokens // 2
    sizes = calibration_sizes(threshold or module.speculative_config.threshold)
    key = _costs_key(module, sizes, arms, context)
    path = step_costs_path(key)
    if path.exists():
        costs = StepCosts.load(path)
        rank_zero_info(f"Step costs of this machine read from {path}")
    else:
        start = time.perf_counter()
        rank_zero_info(f"Measuring step costs at {sizes} rows, plain and {len(arms)} arms (once per machine)")
        costs = measure_step_costs(
            module.rollout_target,
            module.drafter,
            config,
            prompt,
            sizes,
            arms,
            context=context,
            progress=rank_zero_info,
        )
        costs = replace(costs, machine=key)
        costs.save(path)
        rank_zero_info(f"Step costs measured in {time.perf_counter() - start:.0f} s, stored in {path}")
    strategy.use_step_costs(costs, strategy.accept_prior, strategy.margin)
    return costs
