"""BucketedStrategy: what every bucketed speculative-decoding strategy shares.

Bucketing by batch size, arm validation, the decision log, state (``state_dict``) and the heat map;
subclasses (:class:`~tlt_lightning.scheduling.BEGMABStrategy`, the baselines of
:mod:`tlt_lightning.scheduling.baselines`) add the rule that picks an arm. Reproducible mode (a
``cost_model``) is described in :mod:`tlt_lightning.scheduling.step_cost`.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tlt_lightning.scheduling.checks import (
    arm_from_dict,
    arm_to_dict,
    check_arms,
    check_batch_size,
    check_cost_model,
    check_thresholds,
    finite,
)
from tlt_lightning.scheduling.crossover import StepCosts, estimate_accept, paying_arms, predicted_speedup
from tlt_lightning.scheduling.heatmap import save_heatmaps
from tlt_lightning.scheduling.step_cost import StepCostModel
from tlt_lightning.speculative import Arm, DraftSpec, arm_key

__all__ = ["DEFAULT_BUCKET_THRESHOLDS", "BucketedStrategy", "Decision", "default_arms"]

DEFAULT_BUCKET_THRESHOLDS: tuple[int, ...] = (1, 2, 5, 21)
ACCEPT_WINDOW = 512
"""Speculative steps the acceptance estimate of :meth:`BucketedStrategy.use_step_costs` looks back on."""
ACCEPT_PRIOR_REQUESTS = 32
"""Request-steps the prior acceptance counts for in that estimate (a few early steps cannot swing it)."""
ACCEPT_REFRESH = 16
"""Speculative steps between two refreshes of that estimate (a refresh is a bisection over the arms)."""
PROBE_EVERY = 32
"""Selections without a speculative step after which one runs anyway where every speculative arm is
pruned (a probe): without them an estimate fallen below every crossover would never see a step again."""


def default_arms() -> tuple[Arm, ...]:
    """Candidate arms for every bucket: SD off, chains of depth 1/2/4 and two trees.

    Off and the short chains win at large batch, deep trees at batch 1 with a greedy target; every
    bucket gets all six so that each one really explores (one arm per bucket would make the bandit a
    lookup table). At temperature 1 (acceptance ~0.6 per draft) a chain of one pays best on a CPU
    core, where every verified token costs compute: SmolLM2 rollouts at batch 1 (Zen 4, benchmark
    ``few_rows_verify``) chain 1 1.47x plain, chain 2 1.36x. Every verify is at most 16 tokens per
    row (the larger tree drafts 15), the largest query bucket of the compiled graphs.
    """
    return (None, DraftSpec(1), DraftSpec(2), DraftSpec(4), DraftSpec(4, 2, 8), DraftSpec(5, 4, 15))


class Decision(NamedTuple):
    """One logged update: which arm ran in which bucket, its reward, and why it was chosen.

    ``mode`` is ``"untried"`` (first try of the arm in the bucket), ``"explore"``, ``"exploit"``,
    ``"probe"`` (see :meth:`BucketedStrategy.use_step_costs`), or ``"unpaired"`` when ``update`` did
    not follow a ``select`` of the same arm in the same bucket.
    """

    step: int
    bucket: str
    arm: Arm
    reward: float
    mode: str


class BucketedStrategy:
    """Base of the bucketed strategies: buckets, arms, validation, log, state, heat map.

    Subclasses implement ``_choose`` (which arm, and why), ``_observe`` (learn a reward) and
    ``_value`` (the statistic ``best_arms`` ranks by), plus ``_extra_state``/``_load_extra_state``.

    Args:
        arms: one sequence of arms for every bucket, or one sequence per bucket; ``None`` uses
            :func:`default_arms` everywhere. An arm is a :class:`DraftSpec` or ``None`` (SD off).
        bucket_thresholds: strictly increasing ints starting at 1; bucket ``i`` holds batch sizes
            from ``bucket_thresholds[i]`` up to the next threshold, the last one is open-ended.
        max_history: how many decisions ``history`` keeps (oldest dropped first).
        per_request: learn from the reward divided by the batch size (tokens per second per
            request) instead of the reward. Within a bucket the reward grows with the batch size
            (a memory-bound step costs about the same at batch 6 and 16), and a rollout's batch
            only shrinks, so each arm's statistics depend on *when* it ran: an arm exploited
            while the batch shrinks looks worse than a rival last tried at the top of the bucket.
            Per request, arms compare at matched cost. The logged reward is unchanged.
        cost_model: reproducible mode: the reward divides by this model's cost of the step instead
            of the measured ``step_time`` (which is then ignored), so decisions do not depend on
            timing; ``None``: wall time (the paper's reward). See the module docstring.
    """

    def __init__(
        self,
        arms: Sequence[Arm] | Sequence[Sequence[Arm]] | None = None,
        bucket_thresholds: Sequence[int] = DEFAULT_BUCKET_THRESHOLDS,
        *,
        max_history: int = 20_000,
        per_request: bool = False,
        cost_model: StepCostModel | None = None,
    ) -> None:
        self.bucket_thresholds = check_thresholds(bucket_thresholds)
        self.bucket_labels: tuple[str, ...] = tuple(
            str(lo) if hi == lo + 1 else (f"{lo}-{hi - 1}" if hi else f"{lo}+")
            for lo, hi in zip(self.bucket_thresholds, (*self.bucket_thresholds[1:], None))
        )
        self.arms: tuple[tuple[Arm, ...], ...] = (
            (default_arms(),) * len(self.bucket_thresholds)
            if arms is None
            else check_arms(arms, len(self.bucket_thresholds))
        )
        if isinstance(max_history, bool) or not isinstance(max_history, int) or max_history < 0:
            raise ValueError(f"max_history must be an int >= 0, got {max_history!r}")
        self._index = [{arm: i for i, arm in enumerate(bucket)} for bucket in self.arms]
        self._counts = [[0] * len(bucket) for bucket in self.arms]
        self._history: deque[Decision] = deque(maxlen=max_history)
        self._num_updates = 0
        self._pending: dict[int, tuple[int, str]] = {}  # bucket -> (arm index, mode) of the last select
        self.per_request = bool(per_request)
        self.cost_model = check_cost_model(cost_model)
        self.use_step_costs(None)

    @property
    def reproducible(self) -> bool:
        """Whether rewards use the modelled step cost (``cost_model``) instead of wall time."""
        return self.cost_model is not None

    def use_cost_model(self, cost_model: StepCostModel | None) -> None:
        """Switch reproducible mode on (a :class:`StepCostModel`) or off (``None``) before any update.

        Raises:
            ValueError: the strategy already learned from rewards of the other kind.
        """
        cost_model = check_cost_model(cost_model)
        if self._num_updates and cost_model != self.cost_model:
            raise ValueError(
                f"cannot change cost_model after {self._num_updates} updates (its statistics are rewards "
                "of the other kind): set it when the strategy is built"
            )
        self.cost_model = cost_model

    def use_step_costs(self, costs: StepCosts | None, accept: float = 0.6, margin: float = 1.0) -> None:
        """Try only arms predicted to pay at the batch size at hand (see :mod:`.crossover`).

        From then on :meth:`select` leaves out every arm whose tokens/s, predicted from ``costs`` (measured
        on this machine) and the acceptance per draft token, are below ``margin`` times plain decoding's
        at that batch size; plain decoding and arms ``costs`` lack stay in. The acceptance starts at
        ``accept`` and follows the speculative steps ``update`` sees (their last :data:`ACCEPT_WINDOW`,
        the prior counting as :data:`ACCEPT_PRIOR_REQUESTS` request-steps). So that it keeps following
        the drafter when every arm is pruned, after :data:`PROBE_EVERY` selections without a speculative
        step the next one runs the arm predicted fastest (mode ``"probe"``). ``None`` tries every arm
        again. Statistics are untouched: a bucket's pruned arms keep what they learned.

        Args:
            costs: step costs measured on this machine, or ``None``.
            accept: the prior acceptance per draft token, in ``(0, 1)``.
            margin: the predicted speed-up over plain decoding an arm needs (``> 0``).
        """
        if costs is not None and not isinstance(costs, StepCosts):
            raise TypeError(f"costs must be StepCosts or None, got {type(costs).__name__}")
        if not 0.0 < finite("accept", accept) < 1.0:
            raise ValueError(f"accept must be a probability in (0, 1), got {accept!r}")
        if not finite("margin", margin) > 0:
            raise ValueError(f"margin must be > 0, got {margin!r}")
        self.step_costs, self.accept_prior, self.margin = costs, float(accept), float(margin)
        self._spec_steps: deque[tuple[Arm, float, int]] = deque(maxlen=ACCEPT_WINDOW)
        self._spec_sums: dict[Arm, list[float]] = {}  # arm -> [tokens, request-steps] in the window
        self._spec_seen = 0
        self._since_spec = 0  # selections since the last speculative step
        self.accept_estimate = self.accept_prior
        """The acceptance per draft token the step costs are weighed with (see :meth:`use_step_costs`)."""
        self._candidates_cache: dict[tuple[int, float], tuple[int, ...]] = {}

    def _observe_acceptance(self, arm: Arm, tokens: float, batch_size: int) -> None:
        """Add a speculative step to the window of :attr:`accept_estimate`; refresh it now and then."""
        if len(self._spec_steps) == self._spec_steps.maxlen:
            old, t, n = self._spec_steps[0]
            self._spec_sums[old][0] -= t * n
            self._spec_sums[old][1] -= n
        self._spec_steps.append((arm, tokens, batch_size))
        sums = self._spec_sums.setdefault(arm, [0.0, 0.0])
        sums[0] += tokens * batch_size
        sums[1] += batch_size
        self._spec_seen += 1
        if self._spec_seen % ACCEPT_REFRESH == 0:
            prior = (DraftSpec(1), 1.0 + self.accept_prior, ACCEPT_PRIOR_REQUESTS)  # E = 1 + alpha
            observed = ((a, t / n, n) for a, (t, n) in self._spec_sums.items() if n)
            self.accept_estimate = estimate_accept([prior, *observed])

    def candidates(self, batch_size: int) -> tuple[Arm, ...]:
        """The arms :meth:`select` picks from at ``batch_size`` (all its bucket's without step costs)."""
        b = self.bucket_of(batch_size)
        return tuple(self.arms[b][i] for i in self._candidates(b, batch_size))

    def _candidates(self, b: int, batch_size: int) -> tuple[int, ...]:
        every = tuple(range(len(self.arms[b])))
        if self.step_costs is None:
            return every
        key = (batch_size, round(self.accept_estimate, 2))
        if key not in self._candidates_cache:
            kept = paying_arms(self.step_costs, self.arms[b], batch_size, key[1], self.margin)
            self._candidates_cache[key] = tuple(i for i in every if self.arms[b][i] in kept) or every
        return self._candidates_cache[key]

    def _probe(self, b: int, batch_size: int, candidates: tuple[int, ...]) -> int | None:
        """The arm to probe with at ``batch_size`` (see :meth:`use_step_costs`), or ``None``."""
        if self.step_costs is None or self._since_spec < PROBE_EVERY:
            return None
        if any(self.arms[b][i] is not None for i in candidates):
            return None  # the bandit may run a speculative arm here itself
        costs, accept = self.step_costs, self.accept_estimate
        rates = {  # predicted speed-ups of the measured speculative arms
            i: rate
            for i, arm in enumerate(self.arms[b])
            if arm is not None and (rate := predicted_speedup(costs, batch_size, arm, accept)) is not None
        }
        return max(rates, key=rates.__getitem__, default=None)

    def _check_update(self, batch_size: int, arm: Arm, accepted_tokens: float, step_time: float):
        b = self.bucket_of(batch_size)
        i = self._index[b].get(arm) if (arm is None or isinstance(arm, DraftSpec)) else None
        if i is None:
            raise ValueError(
                f"unknown arm {arm!r} for bucket {self.bucket_labels[b]!r}; "
                f"configured arms: {[arm_key(a) for a in self.arms[b]]}"
            )
        tokens = finite("accepted_tokens", accepted_tokens)
        if tokens < 0:
            raise ValueError(f"accepted_tokens must be >= 0, got {accepted_tokens!r}")
        seconds = finite("step_time", step_time)
        if seconds <= 0:
            raise ValueError(f"step_time must be finite and > 0 seconds, got {step_time!r}")
        if self.cost_model is not None:  # reproducible: the model's cost, not the clock's
            seconds = self.cost_model.step_time(batch_size, arm)
        return b, i, tokens * batch_size / seconds

    # ----------------------------------------------------------------------------- public API
    def bucket_of(self, batch_size: int) -> int:
        """Index of the bucket holding ``batch_size`` (an int >= 1)."""
        return bisect.bisect_right(self.bucket_thresholds, check_batch_size(batch_size)) - 1

    def select(self, batch_size: int) -> Arm:
        """The arm for a decode step of ``batch_size`` active requests; untried arms go first."""
        b = self.bucket_of(batch_size)
        candidates = self._candidates(b, batch_size)
        untried = next((i for i in candidates if self._counts[b][i] == 0), None)
        if untried is not None:
            i, mode = untried, "untried"
        elif (probe := self._probe(b, batch_size, candidates)) is not None:
            i, mode = probe, "probe"
        else:
            i, mode = self._choose(b, candidates)
        self._since_spec += 1
        self._pending[b] = (i, mode)
        return self.arms[b][i]

    def update(self, batch_size: int, arm: Arm, accepted_tokens: float, step_time: float) -> None:
        """Learn from one step: reward = ``accepted_tokens * batch_size / step_time`` (tokens/s).

        Args:
            batch_size: active requests in the step (same as passed to ``select``).
            arm: the arm that ran; it must be one of the bucket's arms.
            accepted_tokens: mean tokens each request emitted in the step (``>= 0``).
            step_time: the step's wall time in seconds (finite, ``> 0``); with a ``cost_model`` the
                modelled cost replaces it.
        """
        b, i, reward = self._check_update(batch_size, arm, accepted_tokens, step_time)
        pending = self._pending.pop(b, None)
        mode = pending[1] if pending is not None and pending[0] == i else "unpaired"
        self._counts[b][i] += 1
        if arm is not None and self.step_costs is not None:
            self._since_spec = 0
            self._observe_acceptance(arm, float(accepted_tokens), batch_size)
        self._observe(b, i, reward / batch_size if self.per_request else reward)
        self._history.append(Decision(self._num_updates, self.bucket_labels[b], arm, reward, mode))
        self._num_updates += 1

    @property
    def history(self) -> list[Decision]:
        """The logged decisions (bucket, arm, reward, mode), oldest first, at most ``max_history``."""
        return list(self._history)

    choices_log = history

    @property
    def last_decision(self) -> Decision | None:
        """The latest logged decision, or ``None`` before the first update (or with ``max_history=0``)."""
        return self._history[-1] if self._history else None

    @property
    def counts(self) -> dict[str, dict[str, int]]:
        """How often each arm ran in each bucket: ``{bucket_label: {arm_key: n}}``."""
        return {
            label: {arm_key(a): n for a, n in zip(arms, counts)}
            for label, arms, counts in zip(self.bucket_labels, self.arms, self._counts)
        }

    def values(self) -> dict[str, dict[str, float | None]]:
        """How each bucket currently rates each arm (tokens per second, per request with
        ``per_request``; ``None``: not tried yet):
        ``{bucket_label: {arm_key: value}}``, the statistic the exploit decision compares."""
        return {
            label: {arm_key(a): self._value(b, i) for i, a in enumerate(self.arms[b])}
            for b, label in enumerate(self.bucket_labels)
        }

    def best_arms(self) -> dict[str, Arm]:
        """The arm each bucket currently rates best; buckets with no observation are left out."""
        out: dict[str, Arm] = {}
        for b, label in enumerate(self.bucket_labels):
            values = [(v, i) for i in range(len(self.arms[b])) if (v := self._value(b, i)) is not None]
            if values:
                out[label] = self.arms[b][max(values, key=lambda vi: (vi[0], -vi[1]))[1]]
        return out

    # ----------------------------------------------------------------------------- subclass hooks
    def _choose(self, b: int, candidates: Sequence[int]) -> tuple[int, str]:
        """The index of the arm to run in bucket ``b``, among ``candidates`` (indices), and why."""
        raise NotImplementedError

    def _observe(self, b: int, i: int, reward: float) -> None:
        raise NotImplementedError

    def _value(self, b: int, i: int) -> float | None:
        raise NotImplementedError

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Validate and apply the subclass's keys of ``state`` (missing keys leave things as they are)."""

    # ----------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (lists, dicts, numbers, strings): arms, counts, statistics, RNG, log."""
        return {
            "bucket_thresholds": list(self.bucket_thresholds),
            "arms": [[arm_to_dict(a) for a in bucket] for bucket in self.arms],
            "per_request": self.per_request,
            "cost_model": None if self.cost_model is None else dataclasses.asdict(self.cost_model),
            "counts": self.counts,
            "num_updates": self._num_updates,
            "history": [[d.step, d.bucket, arm_key(d.arm), d.reward, d.mode] for d in self._history],
            **self._extra_state(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; missing keys keep their current values.

        Raises:
            ValueError: the saved thresholds, arms or ``per_request`` differ from the configured
                ones, or a key names an unknown bucket or arm.
        """
        if "per_request" in state_dict and bool(state_dict["per_request"]) != self.per_request:
            raise ValueError(
                f"state_dict per_request={state_dict['per_request']} does not match the configured "
                f"per_request={self.per_request}: its statistics are in other units"
            )
        if "cost_model" in state_dict:
            saved = state_dict["cost_model"]
            mine = None if self.cost_model is None else dataclasses.asdict(self.cost_model)
            if saved != mine:

                def describe(cost: Any) -> str:
                    return "wall time" if cost is None else f"modelled cost {cost}"

                raise ValueError(
                    f"state_dict was learned with {describe(saved)} but this strategy uses "
                    f"{describe(mine)}: its statistics are in other units; resume with the same "
                    "reproducible / cost_model setting"
                )
        if "bucket_thresholds" in state_dict and list(state_dict["bucket_thresholds"]) != list(
            self.bucket_thresholds
        ):
            raise ValueError(
                f"state_dict bucket_thresholds {list(state_dict['bucket_thresholds'])} do not match "
                f"the configured bucket_thresholds {list(self.bucket_thresholds)}"
            )
        if "arms" in state_dict:
            saved = [[arm_key(arm_from_dict(a)) for a in bucket] for bucket in state_dict["arms"]]
            configured = [[arm_key(a) for a in bucket] for bucket in self.arms]
            if saved != configured:
                raise ValueError(f"state_dict arms {saved} do not match the configured arms {configured}")
        counts = self._counts
        if "counts" in state_dict:
            counts = [[0] * len(bucket) for bucket in self.arms]
            for b, i, n in self._iter_arm_table(state_dict["counts"], "counts"):
                counts[b][i] = int(n)
        history = self._history
        if "history" in state_dict:
            history = deque(maxlen=self._history.maxlen)
            for step, label, key, reward, mode in state_dict["history"]:
                b = self._bucket_index(label, "history")
                history.append(
                    Decision(int(step), label, self._arm_by_key(b, key, "history"), float(reward), mode)
                )
        self._load_extra_state(state_dict)
        self._counts, self._history = counts, history
        self._num_updates = int(state_dict.get("num_updates", self._num_updates))
        self._pending.clear()

    def _bucket_index(self, label: str, where: str) -> int:
        if label not in self.bucket_labels:
            raise ValueError(
                f"state_dict {where} names unknown bucket {label!r}; buckets: {self.bucket_labels}"
            )
        return self.bucket_labels.index(label)

    def _arm_by_key(self, b: int, key: str, where: str) -> Arm:
        for arm in self.arms[b]:
            if arm_key(arm) == key:
                return arm
        raise ValueError(f"state_dict {where} names unknown arm {key!r} in bucket {self.bucket_labels[b]!r}")

    def _iter_arm_table(self, table: Mapping[str, Mapping[str, Any]], where: str):
        """Yield ``(bucket index, arm index, value)`` from a ``{bucket_label: {arm_key: value}}`` table."""
        for label, row in table.items():
            b = self._bucket_index(label, where)
            for key, value in row.items():
                yield b, self._index[b][self._arm_by_key(b, key, where)], value

    # ----------------------------------------------------------------------------- heat map
    def heatmap_data(
        self, num_bins: int = 20
    ) -> tuple[list[float], list[tuple[str, list[str], list[list[float]]]]]:
        """Arm choice frequency per bucket over time, from ``history``.

        Returns:
            ``(edges, rows)``: ``num_bins + 1`` step edges, and per bucket ``(label, arm keys,
            matrix [num_arms][num_bins])`` of the fraction of that bucket's updates in each time bin
            that chose each arm (``nan`` where the bucket had no update in the bin).
        """
        if num_bins < 1:
            raise ValueError(f"num_bins must be >= 1, got {num_bins!r}")
        first = self._history[0].step if self._history else 0
        last = self._history[-1].step + 1 if self._history else 1
        width = max(1, math.ceil((last - first) / num_bins))
        edges = [float(first + k * width) for k in range(num_bins + 1)]
        rows = []
        for b, label in enumerate(self.bucket_labels):
            tally = [[0] * num_bins for _ in self.arms[b]]
            for d in self._history:
                if d.bucket == label:
                    tally[self._index[b][d.arm]][min((d.step - first) // width, num_bins - 1)] += 1
            totals = [sum(col) for col in zip(*tally)]
            matrix = [[n / t if t else math.nan for n, t in zip(row, totals)] for row in tally]
            rows.append((label, [arm_key(a) for a in self.arms[b]], matrix))
        return edges, rows

    def plot_heatmap(self, path: str | Path, num_bins: int = 20) -> Path:
        """Save a PNG heat map of arm choice frequency per bucket over time; returns the path."""
        edges, rows = self.heatmap_data(num_bins)
        return save_heatmaps(edges, rows, f"{type(self).__name__}: arm choice frequency per bucket", path)
