"""GRPOModule's settings beside its config groups: checked, and the groups as saved hyper-parameters."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any, NamedTuple

from tlt_lightning.models import DECODE_PATHS, WEIGHT_LAYOUTS
from tlt_lightning.models.registry import DTYPES
from tlt_lightning.rl.config import OptimConfig, SpeculativeConfig, as_config
from tlt_lightning.rl.sources import PromptSource
from tlt_lightning.rl.tasks import TaskConfig
from tlt_lightning.rollout import RolloutConfig
from tlt_lightning.validation import check, is_int

__all__ = [
    "ROLLOUT_BACKENDS",
    "ROLLOUT_DECODES",
    "ConfigGroups",
    "check_settings",
    "config_groups",
    "group_hparams",
]

ROLLOUT_BACKENDS = ("engine", "vllm")
ROLLOUT_DECODES = ("auto", *DECODE_PATHS)


class ConfigGroups(NamedTuple):
    """:class:`~tlt_lightning.rl.GRPOModule`'s config groups, as their dataclasses."""

    task: TaskConfig
    rollout: RolloutConfig
    optim: OptimConfig
    speculative: SpeculativeConfig


def config_groups(task: Any, rollout: Any, optim: Any, speculative: Any) -> ConfigGroups:
    """The groups from their dataclasses, dicts of their fields or (task) ``None``
    (:func:`~tlt_lightning.rl.config.as_config`)."""
    return ConfigGroups(
        as_config(task, TaskConfig, "task"),
        as_config(rollout, RolloutConfig, "rollout"),
        as_config(optim, OptimConfig, "optim"),
        as_config(speculative, SpeculativeConfig, "speculative"),
    )


def check_settings(rollout: RolloutConfig, hparams: Mapping[str, Any], prompt_source: Any) -> None:
    """Check :class:`~tlt_lightning.rl.GRPOModule`'s arguments beside its groups: the rollout
    temperature, ``prompt_source`` and, from ``hparams`` (its saved arguments), ``max_abs_reward``,
    ``seed``, ``logprob_tolerance``, ``dtype``, ``rollout_dtype``, ``weight_layout``, ``rollout_backend`` and
    ``rollout_decode``.

    Raises:
        ValueError: one is out of range; the message names it, the value and what is allowed.
    """
    max_abs_reward, seed = hparams["max_abs_reward"], hparams["seed"]
    logprob_tolerance, rollout_dtype = hparams["logprob_tolerance"], hparams["rollout_dtype"]
    weight_layout, rollout_backend = hparams["weight_layout"], hparams["rollout_backend"]
    check(
        0 < rollout.temperature < math.inf,
        "rollout.temperature",
        rollout.temperature,
        "finite and > 0 (greedy rollouts give every sample of a group the same reward)",
    )
    check(
        isinstance(max_abs_reward, (int, float))
        and not isinstance(max_abs_reward, bool)
        and 0 < max_abs_reward < math.inf,
        "max_abs_reward",
        max_abs_reward,
        "a finite number > 0",
    )
    check(is_int(seed) and seed >= 0, "seed", seed, "an int >= 0")
    check(
        logprob_tolerance is None or logprob_tolerance > 0,
        "logprob_tolerance",
        logprob_tolerance,
        "> 0 or None",
    )
    dtype = hparams["dtype"]
    check(dtype in ("auto", *DTYPES), "dtype", dtype, f"'auto' or one of {tuple(DTYPES)}")
    check(
        rollout_dtype in (None, "auto", "float32", "bfloat16", "float16"),
        "rollout_dtype",
        rollout_dtype,
        "'auto', 'float32', 'bfloat16', 'float16' or None",
    )
    check(weight_layout in WEIGHT_LAYOUTS, "weight_layout", weight_layout, f"one of {WEIGHT_LAYOUTS}")
    check(
        prompt_source is None or isinstance(prompt_source, PromptSource),
        "prompt_source",
        prompt_source,
        "a PromptSource (name, __len__, prompt_ids, score) or None",
    )
    check(
        rollout_backend in ROLLOUT_BACKENDS, "rollout_backend", rollout_backend, f"one of {ROLLOUT_BACKENDS}"
    )
    decode = hparams["rollout_decode"]
    check(decode in ROLLOUT_DECODES, "rollout_decode", decode, f"one of {ROLLOUT_DECODES}")


def group_hparams(**groups: Any) -> dict[str, dict[str, Any]]:
    """The config groups (dataclasses) as plain dicts of all their fields (tuples as lists).

    Saved so, a checkpoint reads them back without our classes, and loggers log them as such
    (``optim/lr``).
    """
    return {
        name: {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}
        for name, config in groups.items()
    }
