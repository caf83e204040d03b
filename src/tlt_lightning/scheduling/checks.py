"""Checks of a bucketed strategy's settings, updates and saved arms (:class:`BucketedStrategy`)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tlt_lightning.scheduling.step_cost import StepCostModel
from tlt_lightning.speculative import Arm, DraftSpec, arm_key

__all__ = [
    "arm_from_dict",
    "arm_to_dict",
    "check_arms",
    "check_batch_size",
    "check_cost_model",
    "check_thresholds",
    "finite",
]


def arm_to_dict(arm: Arm) -> dict[str, Any] | None:
    """An arm as ``state_dict`` stores it: the :class:`DraftSpec` fields, or ``None`` for SD off."""
    return None if arm is None else dataclasses.asdict(arm)


def arm_from_dict(data: Any) -> Arm:
    """The arm :func:`arm_to_dict` stored; ``TypeError``/``ValueError`` name what is wrong."""
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise TypeError(f"state_dict arms must be dicts of DraftSpec fields or None, got {data!r}")
    try:
        return DraftSpec(**data)
    except TypeError as err:  # unknown or missing fields
        raise ValueError(f"state_dict arm {dict(data)!r} is not a valid DraftSpec: {err}") from err


def check_batch_size(batch_size: Any) -> int:
    """``batch_size`` if it is an int >= 1, else ``ValueError``."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    return batch_size


def finite(name: str, value: Any) -> float:
    """``value`` as a finite float; ``TypeError`` if it is no number, ``ValueError`` if not finite."""
    try:
        out = float(value)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name} must be a real number, got {value!r}") from err
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return out


def check_cost_model(cost_model: Any) -> StepCostModel | None:
    """``cost_model`` if it is a :class:`StepCostModel` or ``None`` (wall time), else ``TypeError``."""
    if cost_model is not None and not isinstance(cost_model, StepCostModel):
        raise TypeError(
            f"cost_model must be a StepCostModel or None (wall time), got {type(cost_model).__name__}"
        )
    return cost_model


def check_thresholds(thresholds: Sequence[int]) -> tuple[int, ...]:
    """``bucket_thresholds`` as a tuple: strictly increasing ints starting at 1, else ``ValueError``."""
    values = tuple(thresholds) if isinstance(thresholds, Sequence) else ()
    ok = (
        len(values) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) for t in values)
        and values[0] == 1
        and all(a < b for a, b in itertools.pairwise(values))
    )
    if not ok:
        raise ValueError(
            f"bucket_thresholds must be strictly increasing ints starting at 1, got {thresholds!r}"
        )
    return values


def check_arms(arms: Any, num_buckets: int) -> tuple[tuple[Arm, ...], ...]:
    """One tuple of arms per bucket from one sequence for all buckets or one per bucket.

    Raises:
        TypeError: not a sequence, a mix of arms and lists, or an arm that is no :class:`DraftSpec`/``None``.
        ValueError: no arms, a bucket without arms or with duplicates, or a list per bucket whose count
            is not ``num_buckets``.
    """
    if isinstance(arms, (str, bytes)) or not isinstance(arms, Sequence):
        raise TypeError(f"arms must be a sequence of DraftSpec/None or of such sequences, got {arms!r}")
    if len(arms) == 0:
        raise ValueError("arms must not be empty: give at least one DraftSpec or None")
    nested = [isinstance(a, (list, tuple)) for a in arms]
    if all(nested):
        if len(arms) != num_buckets:
            raise ValueError(
                f"arms has {len(arms)} per-bucket lists but bucket_thresholds defines {num_buckets} buckets"
            )
        per_bucket = [tuple(bucket) for bucket in arms]
    elif not any(nested):
        per_bucket = [tuple(arms)] * num_buckets
    else:
        raise TypeError(f"arms must be all arms or all per-bucket lists, not a mix: {arms!r}")
    for i, bucket in enumerate(per_bucket):
        if not bucket:
            raise ValueError(f"arms for bucket {i} is empty: every bucket needs at least one arm")
        for arm in bucket:
            if arm is not None and not isinstance(arm, DraftSpec):
                raise TypeError(f"arms must hold DraftSpec instances or None, got {arm!r}")
        if len(set(bucket)) != len(bucket):
            raise ValueError(f"arms for bucket {i} has duplicates: {[arm_key(a) for a in bucket]}")
    return tuple(per_bucket)
