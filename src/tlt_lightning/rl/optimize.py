"""One GRPO optimizer step over a step's rollouts: gradient accumulation, clipping and checks.

:func:`optimize` accumulates the gradient over micro-batches (``manual_backward``; DDP syncs only
the last one) and calls the optimizer's ``step()``; inside it Lightning runs the callbacks'
``on_before_optimizer_step`` and then GRPOModule's, which calls :func:`clip_and_check`: the
gradient is clipped, and a non-finite loss or gradient norm, or rollout log-probabilities that
disagree with the training forward's, stop the run on every rank before the update.

Old log-probabilities. The ratio in the clipped loss compares the policy with the policy that
sampled. Here each rollout batch gets exactly one optimizer step (the micro-batches accumulate
into it), so that policy *is* the current one, before the step: ``old_logprobs`` are the training
forward's own log-probabilities, detached (as TRL does for one iteration per generation). That is
exact, and it saves the no-grad forward that a separate recomputation would cost. They are taken at
the sampling temperature (logits / T), the distribution the rollout sampled from. The rollout's own
log-probabilities (from the KV-cached, possibly speculative decode) are not used in the loss; they
serve as a consistency check: when they describe the full tempered distribution (``top_p == 1``,
``top_k == 0``), their mean absolute difference to the training forward's must stay below
``logprob_tolerance``, which catches misaligned tokens, stale weights or a lossy rollout at once.

Distributed. Each rank rolls out its own share of prompts (Lightning's ``DistributedSampler``);
DDP all-reduces the gradients. Token-level aggregation divides by the token count of *all* ranks
(all-reduced), so the averaged gradient is exactly the global token mean. Micro-batches other than
the last skip DDP's gradient sync (``block_backward_sync``); the last one syncs the accumulated
gradients. Cross-rank decisions (a failing reward, a non-finite loss) go through
``trainer.strategy`` so that every rank stops together instead of hanging in a collective.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING, NamedTuple

import torch
from lightning.pytorch.strategies import ParallelStrategy

from tlt_lightning.rl.batch import PolicyBatch, micro_batches, round_up
from tlt_lightning.rl.scoring import NonFiniteLossError

if TYPE_CHECKING:
    from tlt_lightning.rl.module import GRPOModule

__all__ = ["StepCheck", "any_rank", "clip_and_check", "optimize"]


class StepCheck(NamedTuple):
    """What :func:`optimize` hands its ``on_before_optimizer_step`` (clip and check there)."""

    finite: bool  # every micro-batch loss was finite
    drift: torch.Tensor  # mean |policy - rollout| log-probability per completion token
    tolerance: float | None  # None: the log-probability check is off
    loss: torch.Tensor
    grad_norm: torch.Tensor | None = None  # set by the hook: the norm before clipping


def optimize(module: GRPOModule, data: PolicyBatch) -> dict[str, torch.Tensor]:
    """Accumulate the gradient of ``data`` (``N`` sequences) over micro-batches, then the optimizer step.

    Returns:
        Scalars of the step: ``loss``, ``pg_loss``, ``kl``, ``clip_fraction``, ``ratio_mean``,
        ``grad_norm`` (before clipping), ``logprob_drift`` and ``forward_tokens`` (the padded tokens the
        forwards ran on: the step's training work, zero-advantage groups skipped).
    """
    optim, strategy = module.optim_config, module.trainer.strategy
    opt = module.optimizers()
    N = data.advantages.shape[0]
    if optim.aggregation == "token":
        count = data.mask.sum().float()
    else:
        count = torch.tensor(float(N), device=module.device)
    # Per-rank denominator such that DDP's gradient average is the global token (sequence) mean.
    num_items = strategy.reduce(count.clone(), reduce_op="sum") / module.trainer.world_size
    # Zero-advantage sequences have zero gradient without a KL term: skip their forward.
    rows = torch.arange(N, device=module.device)
    if optim.kl_coef == 0:
        rows = rows[data.advantages != 0]
        if rows.numel() == 0:  # still one backward, so DDP syncs (zero) gradients on every rank
            rows = torch.zeros(1, dtype=torch.long, device=module.device)
    multiple = optim.sequence_multiple
    seq_lens = round_up(data.attention_mask[rows].sum(1), multiple)  # as the forwards will pad them
    chunks = [rows[i] for i in micro_batches(seq_lens, optim.micro_batch_size, optim.micro_batch_tokens)]
    sampling = module.rollout_settings
    check_logprobs = module.hparams.check_logprobs and sampling.top_p == 1 and sampling.top_k == 0
    sixteen_bit_training = str(module.trainer.precision).startswith(("16", "bf16"))  # e.g. "bf16-mixed"
    hp = module.hparams
    full_precision = module.policy_dtype == "float32" and module.rollout_dtype in (None, "float32")
    full = full_precision and not sixteen_bit_training
    tolerance = hp.logprob_tolerance or (0.01 if full else 0.2)
    sums = dict.fromkeys(("loss", "pg_loss", "kl", "clip", "ratio", "tokens", "drift"), 0.0)
    forward_tokens = 0
    finite = True
    opt.zero_grad()
    for k, idx in enumerate(chunks):
        mb = data.select(idx, multiple)
        forward_tokens += mb.input_ids.numel()
        sync = k == len(chunks) - 1
        local = not sync and isinstance(strategy, ParallelStrategy)
        with strategy.block_backward_sync() if local else nullcontext():
            logprobs = module.policy_logprobs(mb)
            out = module.policy_loss(mb, logprobs, num_items)
            finite &= bool(torch.isfinite(out.loss))
            module.manual_backward(out.loss)
        tokens = mb.mask.sum().float()
        for key, value in (("loss", out.loss), ("pg_loss", out.pg_loss), ("kl", out.kl)):
            sums[key] += value.detach()
        sums["clip"] += out.clip_fraction * tokens
        sums["ratio"] += out.ratio_mean * tokens
        sums["tokens"] += tokens
        sums["drift"] += ((logprobs.detach() - mb.rollout_logprobs).abs() * mb.mask).sum()
    drift = sums["drift"] / max(float(sums["tokens"]), 1.0)
    module._step_check = StepCheck(finite, drift, tolerance if check_logprobs else None, sums["loss"])
    # Inside opt.step(): the callbacks' on_before_optimizer_step, ours (clip and check), the update.
    try:
        opt.step()
        grad_norm = module._step_check.grad_norm
    finally:
        module._step_check = None
        opt.zero_grad()  # the gradients' memory is free until the next step's backward
    assert grad_norm is not None, "the optimizer step ran without Lightning's on_before_optimizer_step"
    # A fused optimizer writes the weights without bumping their in-place version counters, which the
    # rollout's cached weight copies (packed layouts, the LM head's column-major copy) are keyed on.
    torch.autograd.graph.increment_version(list(module.policy.parameters()))
    module.sync_rollout_policy()
    tokens = max(float(sums["tokens"]), 1.0)
    return {
        "loss": sums["loss"],
        "pg_loss": sums["pg_loss"],
        "kl": sums["kl"],
        "clip_fraction": sums["clip"] / tokens,
        "ratio_mean": sums["ratio"] / tokens,
        "grad_norm": grad_norm.detach(),
        "logprob_drift": drift,
        "forward_tokens": torch.tensor(float(forward_tokens)),
    }


def any_rank(module: GRPOModule, flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (a collective: every rank calls it at the same point)."""
    return module.trainer.strategy.reduce_boolean_decision(flag, all=False)


def clip_and_check(module: GRPOModule, optimizer: torch.optim.Optimizer) -> None:
    """Clip the accumulated gradient and check the step (GRPOModule's ``on_before_optimizer_step``).

    Lightning calls that hook inside ``opt.step()`` of :func:`optimize`, after every callback's
    ``on_before_optimizer_step`` (the order of automatic optimization, where Lightning clips at this
    point too). So a callback that rescales the gradients in its own hook, such as
    :class:`~tlt_lightning.efficiency.LayerwisePrecisionCallback` unscaling its per-group fp16
    gradients, does so before they are clipped and checked; one that drops every gradient (a skipped
    fp16 step) leaves a zero norm and an optimizer step that changes nothing.

    Raises (on every rank, before the update, the gradients zeroed) when the loss, the gradient
    norm or the log-probability check failed on any rank.
    """
    check = module._step_check
    if check is None:  # not a step of optimize(): nothing to check
        return
    max_norm = module.optim_config.max_grad_norm or math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(module.policy.parameters(), max_norm)
    finite = check.finite and bool(torch.isfinite(grad_norm))
    drifted = check.tolerance is not None and bool(check.drift > check.tolerance)
    module._step_check = check._replace(grad_norm=grad_norm)
    if any_rank(module, not finite or drifted):
        optimizer.zero_grad()
        where = f"step {module.global_step} (rank {module.global_rank})"
        if not finite:
            raise NonFiniteLossError(
                f"non-finite loss or gradient at {where}: loss {float(check.loss)}, grad norm "
                f"{float(grad_norm)}; the optimizer step was skipped and the weights are unchanged"
            )
        if drifted:
            raise RuntimeError(
                f"at {where} the policy's log-probabilities of the rollout tokens differ from the "
                f"rollout's by {float(check.drift):.4g} nats on average "
                f"(logprob_tolerance={check.tolerance}): the rollout and the training forward disagree "
                "(misaligned tokens, stale weights or a lossy rollout); the optimizer step was skipped"
            )
        raise NonFiniteLossError(
            f"stopping at {where}: another rank's loss, gradient or log-probabilities failed their check"
        )
