"""DrafterDriftProbe: does the spot-trained drafter keep up with the moving policy, and a frozen one?

As RL moves the policy, a drafter trained on the initial policy drafts for a model that no longer
exists: its accept length decays. :class:`~tlt_lightning.callbacks.SpotDrafterCallback` keeps
training the drafter on the newest rollouts to hold it. This probe measures both, on the same
footing: every ``every_n_steps`` RL steps (and once before the first), it runs one speculative
rollout of fixed probe prompts on the *current* policy with

* ``spot``: the newest published drafter of the ``SpotDrafterCallback``, and
* ``frozen``: a copy of that callback's drafter as it was at fit start, never trained,

with the same chain arm, the same random seed and speculation at every step, and logs their
mean accept lengths (``drift/accept_length_spot``, ``drift/accept_length_frozen``) and the probe's
cost (``drift/probe_seconds``: measurement time, not part of the method's overhead). At the end of
fit it writes ``drift/drift.json`` and ``drift/drift.png`` under the run's own directory
(:func:`~tlt_lightning.tracking.run_dir`).

Probe prompts are the last ``num_prompts`` prompts of the module's prompt source, which a short run
does not train on.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from tlt_lightning.callbacks.spot_drafter import SpotDrafterCallback
from tlt_lightning.drafter import Drafter
from tlt_lightning.rl.module import GRPOModule
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.speculative import DraftSpec
from tlt_lightning.tracking import log_artifact, run_dir

__all__ = ["DrafterDriftProbe"]


class DrafterDriftProbe(L.Callback):
    """Accept length of the spot-trained drafter vs a frozen copy over RL steps (a measurement).

    Place it after the :class:`~tlt_lightning.callbacks.SpotDrafterCallback` in the callback list
    (it reads what that callback published at the end of the step).

    Args:
        num_prompts: probe prompts (the last ones of the module's prompt source).
        max_new_tokens: response length cap of the probe rollouts.
        every_n_steps: probe after every this many RL steps (and once before the first).
        arm: the :class:`~tlt_lightning.speculative.DraftSpec` of both probes (default a 4-token chain).
        seed: the probes' sampling seed (the same for both drafters and every probe).

    Attributes:
        history: one dict per probe: ``step``, ``spot``, ``frozen`` (mean accept lengths),
            ``seconds``.
    """

    def __init__(
        self,
        num_prompts: int = 8,
        max_new_tokens: int = 128,
        every_n_steps: int = 1,
        arm: DraftSpec | None = None,
        seed: int = 0,
    ) -> None:
        for name, value in (
            ("num_prompts", num_prompts),
            ("max_new_tokens", max_new_tokens),
            ("every_n_steps", every_n_steps),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.num_prompts, self.max_new_tokens, self.every_n_steps = num_prompts, max_new_tokens, every_n_steps
        self.arm, self.seed = arm or DraftSpec(4), seed
        self.history: list[dict[str, float]] = []
        self._spot: SpotDrafterCallback | None = None
        self._frozen: Drafter | None = None
        self.run_dir: Path | None = None  # the run's own directory, set at train start

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        spots = [cb for cb in trainer.callbacks if isinstance(cb, SpotDrafterCallback)]
        if not isinstance(pl_module, GRPOModule) or not spots:
            raise TypeError("DrafterDriftProbe needs a GRPOModule and a SpotDrafterCallback in the trainer")
        if len(pl_module.prompt_source) < self.num_prompts:
            raise ValueError(
                f"num_prompts={self.num_prompts} is more than the {len(pl_module.prompt_source)} prompts of "
                f"task {pl_module.prompt_source.name!r}"
            )
        self._spot = spots[0]
        self.run_dir = run_dir(trainer)  # on every rank: rank 0's directory, broadcast
        self._frozen = (
            self._spot.spot.drafter.for_target(pl_module.rollout_target).eval().requires_grad_(False)
        )
        self._probe(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self._probe(trainer, pl_module)

    def _accept_length(self, module: GRPOModule, drafter: Drafter, prompts: list[list[int]]) -> float:
        config = replace(module.rollout_settings, max_new_tokens=self.max_new_tokens, feature_layers=())
        loop = SpeculativeRolloutLoop(
            module.rollout_target, drafter, config, self.arm, threshold=len(prompts) + 1
        )
        generator = torch.Generator(device=module.device).manual_seed(self.seed)
        return loop.generate(prompts, generator=generator).stats.mean_accept_length

    @torch.no_grad()
    def _probe(self, trainer: L.Trainer, module: GRPOModule) -> None:
        source = module.prompt_source
        prompts = [source.prompt_ids(i) for i in range(len(source) - self.num_prompts, len(source))]
        start = time.perf_counter()
        was_training = module.policy.training
        module.policy.eval()
        try:
            with self._spot.spot.publisher.acquire() as lease:
                spot = self._accept_length(module, lease.drafter, prompts)
            frozen = self._accept_length(module, self._frozen, prompts)
        finally:
            module.policy.train(was_training)
        seconds = time.perf_counter() - start
        self.history.append({"step": trainer.global_step, "spot": spot, "frozen": frozen, "seconds": seconds})
        if trainer.global_step > 0:  # Lightning logs from the training hooks only
            for key, value in (
                ("accept_length_spot", spot),
                ("accept_length_frozen", frozen),
                ("probe_seconds", seconds),
            ):
                module.log(f"drift/{key}", value)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or not self.history:
            return
        from tlt_lightning.reports import draw_or_skip, write_json

        directory = self.run_dir / "drift"
        path = write_json(directory / "drift.json", {"arm": str(self.arm), "history": self.history})
        figure = draw_or_skip(plot_drift, self.history, directory / "drift.png", str(self.arm))
        log_artifact(trainer, path, "drift")
        if figure is not None:  # None: no matplotlib (warned once)
            log_artifact(trainer, figure, "drift")


def plot_drift(history: list[dict[str, float]], path: str | Path, arm: str = "") -> Path:
    """Accept length over RL steps, spot-trained vs frozen drafter."""
    from tlt_lightning.reports import new_figure, save_figure

    fig, ax = new_figure(figsize=(6.5, 4))
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["spot"] for h in history], marker="o", label="spot-trained drafter")
    ax.plot(steps, [h["frozen"] for h in history], marker="s", label="frozen drafter")
    ax.set(
        xlabel="RL step (policy updates)",
        ylabel=f"mean accept length ({arm})",
        title="Drafter drift as the policy trains",
    )
    ax.legend()
    return save_figure(fig, path)
