"""Training the drafter on the target's own rollouts: batches, one optimisation step, warm-up.

Data: :meth:`RolloutEngine.generate` with ``RolloutConfig.feature_layers =
drafter.config.rollout_feature_layers`` (the drafter's inputs, then the final state ``L``). For a
rollout of ``T`` tokens, ``features[i]`` is the target's state at the position that predicted
``token_ids[i]``. Sample ``i`` (``0 <= i <= T - 2``) is::

    input  : token_ids[i], lift(features[i, :C])      (C = drafter inputs)
    targets: final = features[i + 1, -1]              (EAGLE-1 feature loss)
             softmax(lm_head(final))                  (the target's distribution of token i + 2)

With ``unroll_steps = K > 1`` step ``k`` feeds sample ``i`` the drafter's step ``k-1`` output at
sample ``i - 1`` instead of the true feature, exactly as the ``k``-th draft token at decode time,
and predicts the same targets. Step ``k`` attends the true-feature keys up to sample ``i-k+1``
and its own chain of drafted keys (EAGLE-3's "training-time test" mask), so training matches what
the drafter sees with its KV cache while decoding.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from tlt_lightning.drafter.batches import DrafterBatch, make_batches, unroll_mask
from tlt_lightning.drafter.config import DrafterConfig
from tlt_lightning.drafter.losses import DrafterLoss, draft_vocab_mass
from tlt_lightning.drafter.model import Drafter
from tlt_lightning.models.target import TargetModel
from tlt_lightning.rollout.types import Rollout
from tlt_lightning.validation import check, positive_int

__all__ = [
    "ConcatCache",
    "drafter_losses",
    "drafter_train_step",
    "evaluate_drafter",
    "warmup_drafter",
]


class ConcatCache:
    """An autograd-safe drafter cache for unrolled training: each forward appends its keys/values.

    Unlike :class:`~tlt_lightning.models.KVCache` it never writes in place (so gradients flow
    through every step) and ignores positions: key slots are simply the concatenation of the
    steps, as :func:`~tlt_lightning.drafter.batches.unroll_mask` expects.
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def begin_step(self, rows: int, positions: torch.Tensor) -> int:
        return (0 if self.keys is None else self.keys.shape[2]) + positions.shape[1]

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys, self.values = key_states, value_states
        else:
            self.keys = torch.cat([self.keys, key_states], dim=2)
            self.values = torch.cat([self.values, value_states], dim=2)
        return self.keys, self.values


def drafter_losses(
    drafter: Drafter,
    target: TargetModel,
    batch: DrafterBatch,
    loss_cfg: DrafterLoss | None = None,
    full_vocab: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The (differentiable) loss of a batch and detached metrics (step 1's, and top-1 / acceptance per step).

    Args:
        full_vocab: measure acceptance against the target's distribution on its whole vocabulary,
            so that the mass outside a reduced draft vocabulary counts as rejected, as in
            speculative sampling (one full LM-head pass more), and add ``vocab_mass``, the target's
            mean probability on the draft vocabulary. Default: renormalised on the draft
            vocabulary (the training objective).

    Returns:
        ``(loss, metrics)``; metrics hold ``feature_loss``, ``ce_loss``, ``top1``, ``accept``
        (step 1; ``accept`` is :func:`~tlt_lightning.drafter.acceptance_rate`) and ``top1_step{k}``,
        ``accept_step{k}`` for ``k >= 2``. The loss is the ``step_decay``-weighted mean over steps.

    Memory: the target's logits of the ``N`` real samples on the draft vocabulary, ``[N, V_draft]``,
    are computed here (no_grad); bound ``N`` with ``batch_size`` / ``max_len``.
    """
    cfg = loss_cfg or DrafterLoss.for_kind(drafter.config.kind)
    batch = batch.to(drafter.device, drafter.dtype)  # features may be stored in the rollout dtype
    valid = batch.mask
    target_hidden = batch.target_hidden[valid]
    # The target's next-token distribution on the draft vocabulary, on real samples only: the soft
    # cross-entropy renormalises over the draft vocabulary anyway, and top-1 agreement is then
    # measured within it (a target argmax outside the draft vocabulary is rare and not counted).
    target_logits = drafter.target_logits(target_hidden)
    d2t = t2d = vocab_mass = None
    metrics: dict[str, torch.Tensor] = {}
    if full_vocab:
        with torch.no_grad():
            reduced = drafter.t2d if drafter.config.reduced_vocab else None
            vocab_mass = draft_vocab_mass(target.lm_head(target_hidden.to(target.dtype)), reduced)
        metrics["vocab_mass"] = vocab_mass.mean()
    steps = cfg.unroll_steps
    cache = ConcatCache() if steps > 1 else None
    hidden_in = drafter.lift(batch.features)
    sample_idx = batch.sample_index()
    total, weight_sum = 0.0, 0.0
    for k in range(1, steps + 1):
        mask = unroll_mask(valid, k, batch.doc_ids)
        hidden_out = drafter(batch.tokens, hidden_in, batch.positions, mask, cache)
        # Step k needs k - 1 earlier samples to draft from: samples i < k - 1 do not exist at decode time.
        # (In packed rows the shift below feeds a document's first sample the previous document's
        # output: such samples are out of step and no in-step sample attends them.)
        in_step = (sample_idx >= k - 1)[valid]
        pred = hidden_out[valid]
        out = cfg(pred, drafter.logits(pred), target_hidden, target_logits, in_step, d2t, t2d, vocab_mass)
        w = cfg.step_decay ** (k - 1)
        total, weight_sum = total + w * out.loss, weight_sum + w
        if k == 1:
            metrics.update(
                feature_loss=out.feature_loss, ce_loss=out.ce_loss, top1=out.top1, accept=out.accept
            )
        else:
            metrics[f"top1_step{k}"], metrics[f"accept_step{k}"] = out.top1, out.accept
        # The next draft token at sample i starts from this step's output at sample i - 1.
        hidden_in = torch.cat([torch.zeros_like(hidden_out[:, :1]), hidden_out[:, :-1]], dim=1)
    loss = total / weight_sum
    metrics["loss"] = loss.detach()
    return loss, metrics


def drafter_train_step(
    drafter: Drafter,
    target: TargetModel,
    batch: DrafterBatch,
    optimizer: torch.optim.Optimizer,
    loss_cfg: DrafterLoss | None = None,
    max_grad_norm: float | None = 1.0,
) -> dict[str, float]:
    """One optimisation step of the drafter on ``batch`` (the target is read, never updated).

    Returns:
        ``{"loss", "feature_loss", "ce_loss", "top1", ...}`` as floats (one sync per step).
    """
    drafter.train()
    optimizer.zero_grad(set_to_none=True)
    loss, metrics = drafter_losses(drafter, target, batch, loss_cfg)
    loss.backward()
    if max_grad_norm is not None:
        metrics["grad_norm"] = torch.nn.utils.clip_grad_norm_(drafter.parameters(), max_grad_norm)
    optimizer.step()
    values = torch.stack([v.float() for v in metrics.values()]).tolist()
    return dict(zip(metrics, values))


@torch.no_grad()
def evaluate_drafter(
    drafter: Drafter,
    target: TargetModel,
    batches: Sequence[DrafterBatch],
    loss_cfg: DrafterLoss | None = None,
    full_vocab: bool = False,
) -> dict[str, float]:
    """Sample-weighted mean of :func:`drafter_losses`' metrics over ``batches`` (no update;
    ``full_vocab`` as there)."""
    if not batches:
        raise ValueError("batches is empty: nothing to evaluate")
    sums: dict[str, float] = {}
    total = 0
    for batch in batches:
        _, metrics = drafter_losses(drafter, target, batch, loss_cfg, full_vocab)
        n = batch.num_samples
        total += n
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value) * n
    return {key: value / total for key, value in sums.items()}


def warmup_drafter(
    drafter: Drafter,
    target: TargetModel,
    rollouts: Sequence[Rollout],
    steps: int,
    lr: float = 1e-3,
    batch_size: int = 8,
    progress: bool = True,
    loss_cfg: DrafterLoss | None = None,
    seed: int = 0,
    weight_decay: float = 0.0,
    max_grad_norm: float | None = 1.0,
    max_len: int | None = None,
    lr_warmup: int = 0,
    pack_budget: int | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> list[dict[str, float]]:
    """Train ``drafter`` for ``steps`` AdamW steps on ``rollouts`` (reshuffled every epoch).

    Args:
        drafter: the drafter to train (in place).
        target: the target that produced the rollouts (its LM head gives the soft targets).
        rollouts: rollouts with features (see :func:`~tlt_lightning.drafter.batches.make_batches`).
        steps: optimisation steps.
        lr: AdamW learning rate (cosine-decayed to 10% over ``steps``).
        batch_size: sequences per step (rows of ``pack_budget`` samples when packing).
        progress: show a tqdm bar with the loss, top-1 agreement and acceptance at temperature 1.
        loss_cfg: objective (default :meth:`DrafterLoss.for_kind`).
        seed: shuffling seed.
        lr_warmup: steps of linear learning-rate warm-up. Use it when continuing a trained drafter:
            the first steps of a fresh AdamW at full rate undo much of what it learned (SmolLM2,
            lr 1e-3: held-out top-1 0.52 -> 0.37 after one step).
        pack_budget: pack sequences into rows of this many samples
            (:func:`~tlt_lightning.drafter.pack_batches`; longer ones are split) instead of padding
            each to the batch's longest (``max_len`` is then unused).
        on_step: called as ``on_step(step, metrics)`` after every step (``step`` from 1), e.g. to
            checkpoint a long warm-up.
        autocast_dtype: run each step's forward and backward under ``torch.autocast`` in this
            dtype (``torch.bfloat16``); weights and optimizer state stay in the drafter's dtype.
            SmolLM2's drafter, 8 x 384 packed samples, 3-step unroll, one AVX-512-bf16 core:
            7.0 s a step in fp32, 3.6 s with bf16 autocast.

    Returns:
        The metrics of every step (see :func:`drafter_train_step`); shorter than ``steps`` when
        interrupted with Ctrl-C after at least one step (the drafter keeps what it learned).

    Example:
        >>> # history = warmup_drafter(drafter, target, result.rollouts, steps=200, lr=3e-3, batch_size=8)
        >>> # history[-1]["top1"]
    """
    positive_int("steps", steps)
    check(lr > 0, "lr", lr, "> 0")
    check(lr_warmup >= 0, "lr_warmup", lr_warmup, ">= 0")
    generator = torch.Generator().manual_seed(seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    schedule = _warmup_schedule(optimizer, steps, lr_warmup)
    batches = _epochs(rollouts, drafter.config, batch_size, generator, max_len, pack_budget)
    precision = torch.autocast(drafter.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)

    def train_step(batch: DrafterBatch) -> dict[str, float]:
        with precision:
            metrics = drafter_train_step(drafter, target, batch, optimizer, loss_cfg, max_grad_norm)
        schedule.step()
        return metrics

    return _run_steps(map(train_step, itertools.islice(batches, steps)), steps, progress, on_step)


def _warmup_schedule(
    optimizer: torch.optim.Optimizer, steps: int, lr_warmup: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``lr_warmup`` steps, then cosine decay to 10% of the rate at ``steps``."""

    def rate(t: int) -> float:
        warm = min(1.0, (t + 1) / (lr_warmup + 1))
        return warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(t / steps, 1.0))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, rate)


def _epochs(
    rollouts: Sequence[Rollout],
    config: DrafterConfig,
    batch_size: int,
    generator: torch.Generator,
    max_len: int | None,
    pack_budget: int | None,
) -> Iterator[DrafterBatch]:
    """Batches of ``rollouts`` without end, reshuffled every epoch (packed when ``pack_budget`` is set)."""
    from tlt_lightning.drafter.packing import pack_batches  # packing builds on this module

    while True:
        if pack_budget is None:
            batches = make_batches(rollouts, config, batch_size, True, generator, max_len)
        else:
            batches = pack_batches(rollouts, config, pack_budget, batch_size, True, generator)
        if not batches:
            raise ValueError("no training samples: every rollout has fewer than 2 tokens")
        yield from batches


def _run_steps(
    steps_metrics: Iterator[dict[str, float]],
    steps: int,
    progress: bool,
    on_step: Callable[[int, dict[str, float]], None] | None,
) -> list[dict[str, float]]:
    """Drive the training steps with a progress bar and ``on_step``; Ctrl-C after a step ends early.

    Returns:
        The metrics of the steps that ran.
    """
    history: list[dict[str, float]] = []
    bar = tqdm(total=steps, desc="drafter warm-up", disable=not progress, leave=False)
    try:
        for metrics in steps_metrics:
            history.append(metrics)
            if on_step is not None:
                on_step(len(history), metrics)
            bar.set_postfix(
                loss=f"{metrics['loss']:.3f}",
                top1=f"{metrics['top1']:.2f}",
                accept=f"{metrics['accept']:.2f}",
                refresh=False,
            )
            bar.update()
    except KeyboardInterrupt:  # Ctrl-C ends the warm-up early; the drafter keeps what it learned
        if not history:
            raise
        print(f"\n[drafter warm-up] interrupted after {len(history)} of {steps} steps", flush=True)
    finally:
        bar.close()
    return history
