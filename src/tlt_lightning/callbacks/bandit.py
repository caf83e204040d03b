"""BanditCallback: the speculative-decoding strategy of every decode step, learned by a bandit.

The strategy (default :class:`~tlt_lightning.scheduling.BEGMABStrategy`) becomes the module's
``draft_strategy`` at fit start. :class:`~tlt_lightning.rollout.SpeculativeRolloutLoop` then
consults it at every decode step below the module's ``threshold`` with the active batch size and
reports the reward (tokens/s) back; this callback only logs what it decided after each rollout,
checkpoints its state with the Lightning checkpoint and draws the heat map at the end of fit.

DDP: every rank has its own strategy, fed by its own rollouts (decisions need no communication).
Lightning checkpoints hold rank 0's state, which every rank resumes from.

``reproducible=True`` makes the strategy learn from a modelled step cost
(:class:`~tlt_lightning.scheduling.StepCostModel`) instead of wall time: its decisions, and with
them the rollouts, are then the same in every run with the same seed, and a resumed run continues
exactly where the checkpointed one was (the strategy's statistics and its own seeded RNG are in the
checkpoint). In a config: ``init_args: {reproducible: true}``.
"""

from __future__ import annotations

import inspect
import json
from collections import Counter
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import lightning as L
from typing_extensions import override

from tlt_lightning.reports import draw_or_skip
from tlt_lightning.rl.module import GRPOModule
from tlt_lightning.scheduling import BEGMABStrategy, BucketedStrategy, StepCostModel
from tlt_lightning.speculative import arm_key
from tlt_lightning.tracking import log_artifact, run_dir
from tlt_lightning.validation import check_resumed_settings

__all__ = ["BanditCallback", "bucket_table"]


_NONE = object()  # "no observation yet" (an arm can be None: SD off)
_FIXED = {  # settings a resumed run cannot change
    "strategy": "the checkpoint's statistics are another strategy's",
    "strategy/arms": "the checkpoint's statistics are of other arms",
    "strategy/seed": "the strategy's random state is the checkpoint's",
    "reproducible": "the checkpoint's statistics are in other units",
}


def _metric_key(arm: Any) -> str:
    return arm_key(arm).replace("/", "_")  # "tree5x4/15" would read as a nested metric path


def bucket_table(values: dict[str, dict[str, float | None]]) -> dict[str, dict[str, Any]]:
    """Per bucket, plain decoding against the best speculative arm, from a strategy's ``values()``.

    Returns ``{bucket: {"plain", "speculative_arm", "speculative", "ratio", "chosen"}}``: the rated tokens/s
    of the ``"off"`` arm and of the best-rated speculative arm (``None`` where not tried), their ratio,
    and the arm the bucket now rates best (``None``: nothing tried).

    Example:
        >>> bucket_table({"1": {"off": 80.0, "chain4": 120.0, "chain2": None}})["1"]["ratio"]
        1.5
    """
    table = {}
    for bucket, rated in values.items():
        plain = rated.get("off")
        tried = {arm: v for arm, v in rated.items() if arm != "off" and v is not None}
        arm = max(tried, key=tried.__getitem__) if tried else None
        speculative = tried.get(arm)
        every = {a: v for a, v in rated.items() if v is not None}
        table[bucket] = {
            "plain": plain,
            "speculative_arm": arm,
            "speculative": speculative,
            "ratio": speculative / plain if plain and speculative is not None else None,
            "chosen": max(every, key=every.__getitem__) if every else None,
        }
    return table


class BanditCallback(L.Callback):
    """Plugs a bucketed strategy into a :class:`~tlt_lightning.rl.GRPOModule`; logs and saves it.

    Logged after each rollout, per batch-size bucket ``b`` that had decisions in it:
    ``bandit/{b}/decisions``, ``bandit/{b}/reward`` (mean tokens/s of those steps; modelled with
    ``reproducible=True``),
    ``bandit/{b}/best_arm`` (index into the bucket's arms of the arm it currently rates best) and,
    with ``log_arm_counts``, ``bandit/{b}/count/{arm}`` (how often each arm ran in this rollout).
    With step costs (:mod:`tlt_lightning.rl.crossover`) also ``bandit/accept_estimate``.
    At the end of fit: ``bandit/heatmap.png`` (arm choice per bucket over time) and
    ``bandit/best_arms.json`` (with :func:`bucket_table`: plain against the best speculative arm per
    bucket; :meth:`crossover`: the arms tried at each measured batch size) under the run's own
    directory (:func:`~tlt_lightning.tracking.run_dir`;
    also as MLflow artifacts with an :class:`~lightning.pytorch.loggers.MLFlowLogger`).

    Args:
        strategy: a :class:`~tlt_lightning.scheduling.BucketedStrategy` (``BEGMABStrategy``,
            ``UCBStrategy``, ``FixedStrategy``); default ``BEGMABStrategy()``. ``BEGMABStrategy``
            is a bandit strategy, not a Lightning ``Strategy``: pass it here, never as
            ``Trainer(strategy=...)``.
        heatmap_bins: time bins of the heat map (``>= 1``).
        log_arm_counts: also log per-arm choice counts of each rollout.
        reproducible: learn from ``cost_model``'s modelled step cost instead of the measured wall
            time, so that runs with the same seed (and a resumed run) decide, and sample, identically.
            Costs some speed-up: the model ranks arms by an average machine, not the measured one.
        cost_model: the modelled cost in reproducible mode; ``None``: ``StepCostModel()`` (only with
            ``reproducible=True``).

    Example:
        >>> # L.Trainer(callbacks=[SpotDrafterCallback(), BanditCallback(BEGMABStrategy(epsilon=0.1))])
    """

    def __init__(
        self,
        strategy: BucketedStrategy | None = None,
        heatmap_bins: int = 20,
        log_arm_counts: bool = True,
        reproducible: bool = False,
        cost_model: StepCostModel | None = None,
    ) -> None:
        super().__init__()
        if strategy is not None and not isinstance(strategy, BucketedStrategy):
            raise TypeError(
                "strategy must be a BucketedStrategy (BEGMABStrategy, UCBStrategy, FixedStrategy), "
                f"got {type(strategy).__name__}"
            )
        if isinstance(heatmap_bins, bool) or not isinstance(heatmap_bins, int) or heatmap_bins < 1:
            raise ValueError(f"heatmap_bins must be an int >= 1, got {heatmap_bins!r}")
        if not isinstance(reproducible, bool):
            raise TypeError(f"reproducible must be a bool, got {reproducible!r}")
        if cost_model is not None and not isinstance(cost_model, StepCostModel):
            raise TypeError(f"cost_model must be a StepCostModel or None, got {type(cost_model).__name__}")
        if cost_model is not None and not reproducible:
            raise ValueError(
                f"cost_model={cost_model} is only used with reproducible=True: set reproducible=True "
                "(or drop cost_model to learn from wall time)"
            )
        self.strategy: BucketedStrategy = strategy if strategy is not None else BEGMABStrategy()
        if reproducible:
            self.strategy.use_cost_model(cost_model or self.strategy.cost_model or StepCostModel())
        self.reproducible = self.strategy.reproducible
        self.heatmap_bins, self.log_arm_counts = heatmap_bins, bool(log_arm_counts)
        self._last = -1  # index of the last decision already logged
        self.run_dir: Path | None = None  # the run's own directory, set at setup
        self.resume_overrides = "refuse"  # resumed with other settings: refused, or "apply" them

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not isinstance(pl_module, GRPOModule):
            raise TypeError(f"BanditCallback needs a GRPOModule, got {type(pl_module).__name__}")
        pl_module.draft_strategy = self.strategy
        self.run_dir = run_dir(trainer)  # on every rank: rank 0's directory, broadcast
        for logger in trainer.loggers:  # run parameters (MLflow params, CSV hparams.yaml); rank 0 only
            logger.log_hyperparams(self.params())

    def params(self) -> dict[str, Any]:
        """The settings of this callback and of its strategy, as run parameters ``bandit/<name>``.

        ``bandit/strategy`` is the strategy's class, ``bandit/strategy/<name>`` its constructor
        arguments as the strategy holds them (``arms``: each bucket's, ``"1: off chain2 ...; 2-4: ..."``).
        Logged at setup through every logger's ``log_hyperparams``.

        Example:
            >>> BanditCallback().params()["bandit/strategy"]
            'BEGMABStrategy'
        """
        strategy = self.strategy
        names = inspect.signature(type(strategy)).parameters
        settings = {
            "strategy": type(strategy).__name__,
            # A cost model as its fields: loggers copy params, and a frozen dataclass cannot be copied.
            **{
                f"strategy/{k}": asdict(v) if is_dataclass(v) else v
                for k, v in vars(strategy).items()
                if k in names
            },
            # One string: bucket labels such as "21+" are no valid MLflow parameter names.
            "strategy/arms": "; ".join(
                f"{label}: {' '.join(map(arm_key, arms))}"
                for label, arms in zip(strategy.bucket_labels, strategy.arms)
            ),
            "heatmap_bins": self.heatmap_bins,
            "log_arm_counts": self.log_arm_counts,
            "reproducible": self.reproducible,
        }
        return {f"bandit/{name}": value for name, value in settings.items()}

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.draft_strategy = self.strategy  # again: a subclass' configure_model may have set one

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        new = [d for d in self.strategy.history if d.step > self._last]
        if not new:
            return
        self._last = new[-1].step
        best = self._best_per_bucket()
        if self.strategy.step_costs is not None:
            pl_module.log(
                "bandit/accept_estimate", self.strategy.accept_estimate, on_step=True, on_epoch=False
            )
        for b, label in enumerate(self.strategy.bucket_labels):
            mine = [d for d in new if d.bucket == label]
            if not mine:
                continue
            values = {
                f"bandit/{label}/decisions": float(len(mine)),
                f"bandit/{label}/reward": sum(d.reward for d in mine) / len(mine),
            }
            if best[b] is not _NONE:
                values[f"bandit/{label}/best_arm"] = float(self.strategy.arms[b].index(best[b]))
            if self.log_arm_counts:
                counts = Counter(arm_key(d.arm) for d in mine)
                for arm in self.strategy.arms[b]:
                    values[f"bandit/{label}/count/{_metric_key(arm)}"] = float(counts[arm_key(arm)])
            for name, value in values.items():  # rank-local: each rank has its own bandit
                pl_module.log(name, value, on_step=True, on_epoch=False)

    def _best_per_bucket(self) -> list[Any]:
        best = self.strategy.best_arms()
        return [best.get(label, _NONE) for label in self.strategy.bucket_labels]

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rank = trainer.global_rank
        suffix = "" if rank == 0 else f"-rank{rank}"
        directory = self.run_dir / "bandit"
        heatmap = draw_or_skip(
            self.strategy.plot_heatmap, directory / f"heatmap{suffix}.png", self.heatmap_bins
        )
        best = {}
        for b, (label, arm) in enumerate(zip(self.strategy.bucket_labels, self._best_per_bucket())):
            if arm is not _NONE:
                best[label] = {"arm": arm_key(arm), "index": self.strategy.arms[b].index(arm)}
        summary = directory / f"best_arms{suffix}.json"
        summary.parent.mkdir(parents=True, exist_ok=True)  # without matplotlib, no heat map made it
        summary.write_text(
            json.dumps(
                {
                    "best_arms": best,
                    "counts": self.strategy.counts,
                    "buckets": bucket_table(self.strategy.values()),
                    "crossover": self.crossover(),
                },
                indent=2,
            )
            + "\n"
        )
        for path in (heatmap, summary):
            if path is not None:  # no heat map without matplotlib (warned once)
                log_artifact(trainer, path, "bandit")

    def crossover(self) -> dict[str, Any] | None:
        """With step costs (:meth:`~tlt_lightning.scheduling.BucketedStrategy.use_step_costs`): the acceptance
        estimate and, at each measured batch size, the arms the strategy may try; ``None`` without."""
        costs = self.strategy.step_costs
        if costs is None:
            return None
        return {
            "accept_estimate": self.strategy.accept_estimate,
            "arms_tried": {str(b): [arm_key(a) for a in self.strategy.candidates(b)] for b in costs.seconds},
        }

    def settings(self) -> dict[str, Any]:
        """What shapes the strategy's decisions, saved in every checkpoint and compared on resume
        (:func:`~tlt_lightning.validation.check_resumed_settings`): :meth:`params` without the ``bandit/``
        prefix, the display settings or objects (a cost model is compared by the strategy itself)."""
        params = {name.removeprefix("bandit/"): value for name, value in self.params().items()}
        return {
            name: value
            for name, value in params.items()
            if name not in ("heatmap_bins", "log_arm_counts")
            and (value is None or isinstance(value, (bool, int, float, str)))
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**self.strategy.state_dict(), "settings": self.settings()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Delegates to the strategy's (missing keys keep theirs); decisions made before are not re-logged.

        Raises:
            ValueError: the checkpoint's :meth:`settings` differ and ``resume_overrides`` is not
                ``"apply"``, or the strategy's class, arms, seed or ``reproducible`` differ (its
                statistics and RNG state are the checkpoint's).
        """
        saved = state_dict.get("settings")
        check_resumed_settings("BanditCallback", saved, self.settings(), self.resume_overrides, _FIXED)
        self.strategy.load_state_dict(state_dict)
        last = self.strategy.last_decision
        self._last = last.step if last is not None else -1
