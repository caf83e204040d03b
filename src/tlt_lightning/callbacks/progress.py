"""The progress bar of ``tlt-lightning fit``: one bar over the run's optimizer steps, with GRPO's numbers."""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar

__all__ = ["GRPOProgressBar"]


class GRPOProgressBar(TQDMProgressBar):
    """One bar over the optimizer steps of the run, showing the GRPO numbers of the last step.

    ``step 7/16 [..] reward=0.412, acc=0.31, len=38, accept=2.10, tok/s=212``: mean reward,
    accuracy (share of completions the task scores fully correct), mean response length, mean accept
    length of speculative decoding (``off`` when no speculative step ran: no drafter) and rollout
    tokens per second. The module's own rollout bar (``rollout_progress``) shows below it while a
    rollout runs. Counts steps up to ``trainer.max_steps`` across epochs when it is set, else
    Lightning's per-epoch batches. ``tlt-lightning fit`` adds it unless the config lists a bar.

    Example:
        >>> trainer = Trainer(callbacks=[GRPOProgressBar()], max_steps=16)  # doctest: +SKIP
    """

    # Lightning's, with tqdm's own rate (``48.2s/it`` for GRPO steps, not ``0.02it/s``).
    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"

    # (label, logged metric, format)
    SHOWN = (
        ("reward", "reward/mean", "{:.3f}"),
        ("acc", "reward/accuracy", "{:.2f}"),
        ("len", "response/length_mean", "{:.0f}"),
        ("accept", "rollout/accept_length", "{:.2f}"),
        ("tok/s", "rollout/tokens_per_s", "{:.0f}"),
    )

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, str]:
        metrics = trainer.callback_metrics
        shown = {label: fmt.format(float(metrics[key])) for label, key, fmt in self.SHOWN if key in metrics}
        if "accept" in shown and math.isnan(float(metrics["rollout/accept_length"])):
            shown["accept"] = "off"  # the metric is NaN when no speculative step ran (no drafter)
        return shown

    def on_train_epoch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.max_steps <= 0:  # no step budget: Lightning's per-epoch bar
            super().on_train_epoch_start(trainer, *args)
            return
        bar = self.train_progress_bar
        if bar.total != trainer.max_steps:  # first epoch of this fit: one bar for all of them
            bar.reset(total=trainer.max_steps)
            bar.n = trainer.global_step  # a resumed run starts where it left off
            bar.set_description("step")
            bar.refresh()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.max_steps <= 0:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar = self.train_progress_bar
        if not bar.disable:
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes
