"""A profiling forward for :class:`~tlt_lightning.rl.GRPOModule`, which has no ``forward`` of its own.

:class:`~tlt_lightning.efficiency.ActivationCheckpointingCallback` profiles the blocks' memory and time
on one training forward, at the start of the first step. A GRPO step's batch is prompt indices: the
sequences it trains on come from rollouts generated inside the step, and the step then runs its own
optimizer step, so neither the batch nor ``training_step`` can be profiled. These two functions are
the callback's ``profile_batch_fn`` and ``forward_fn`` for it:

* :func:`grpo_profile_batch` builds the largest micro-batch the step can train on, without
  generating anything: the step's longest prompts, each followed by ``max_new_tokens`` completion
  tokens, as many rows as ``micro_batch_size`` and ``micro_batch_tokens`` allow (all ``P * G`` without
  micro-batching). Rollout lengths change from step to step; the worst case is what the memory budget
  must hold for, so the plan made on it holds on every step.
* :func:`grpo_policy_loss` is the step's training forward on it: the module's own
  :meth:`~tlt_lightning.rl.GRPOModule.policy_logprobs` and
  :meth:`~tlt_lightning.rl.GRPOModule.policy_loss` hooks, so a subclass's model and loss are profiled.

The other efficiency helpers need nothing extra on a GRPOModule:
``LayerwisePrecisionCallback(module="policy")`` and DoRA on ``module.policy`` (see
:mod:`~tlt_lightning.efficiency.dora`).

Example:
    >>> from tlt_lightning.efficiency import ActivationCheckpointingCallback
    >>> callback = ActivationCheckpointingCallback(
    ...     budget_fraction=0.6, blocks="policy.model.layers.*",
    ...     forward_fn=grpo_policy_loss, profile_batch_fn=grpo_profile_batch)
    >>> # L.Trainer(callbacks=[callback]).fit(grpo_module)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tlt_lightning.rl import GRPOModule
    from tlt_lightning.rl.batch import PolicyBatch

__all__ = ["grpo_policy_loss", "grpo_profile_batch"]


def grpo_profile_batch(module: GRPOModule, batch: Any) -> PolicyBatch:
    """The largest micro-batch a GRPO step on ``batch`` can train on, as a ``PolicyBatch``.

    Args:
        module: a configured :class:`~tlt_lightning.rl.GRPOModule` (inside a fit).
        batch: ``[P]`` prompt indices, the step's batch.

    Returns:
        ``B = min(micro_batch_size, micro_batch_tokens // S, P * G)`` rows (at least 1): the ``B``
        longest of the step's ``P * G`` prompts, each followed by ``max_new_tokens`` completion
        tokens (token 0: values do not change memory or time), right-padded to
        ``S = longest prompt + max_new_tokens``; advantages 1 (every row trains, as none is skipped
        for a zero advantage), rollout log-probabilities 0.
    """
    # here: importing efficiency must not import rl
    from tlt_lightning.rl.batch import PolicyBatch, micro_batches

    optim, device = module.optim_config, module.device
    indices = torch.as_tensor(batch).cpu().long().repeat_interleave(optim.group_size)
    prompts = [
        torch.as_tensor(module.prompt_source.prompt_ids(int(i)), dtype=torch.long).flatten() for i in indices
    ]
    T = module.rollout_settings.max_new_tokens
    prompts = sorted(prompts, key=len, reverse=True)
    S = prompts[0].numel() + T
    # the step's first micro-batch if every sequence were the longest possible
    first = micro_batches(torch.full((len(prompts),), S), optim.micro_batch_size, optim.micro_batch_tokens)[0]
    prompts = prompts[: first.numel()]
    B, prompt_lens = len(prompts), torch.tensor([p.numel() for p in prompts])
    input_ids = torch.zeros(B, S, dtype=torch.long)
    for row, p in enumerate(prompts):
        input_ids[row, : p.numel()] = p
    attention_mask = (torch.arange(S) < (prompt_lens + T)[:, None]).long()
    return PolicyBatch(
        input_ids.to(device),
        attention_mask.to(device),
        prompt_lens.to(device),
        torch.zeros(B, T, dtype=torch.long, device=device),
        torch.ones(B, T, dtype=torch.bool, device=device),
        torch.ones(B, device=device),
        torch.zeros(B, T, device=device),
    )


def grpo_policy_loss(module: GRPOModule, data: PolicyBatch) -> torch.Tensor:
    """One GRPO training forward on ``data``: the scalar loss (with its graph) the step would backpropagate.

    Args:
        module: the :class:`~tlt_lightning.rl.GRPOModule`.
        data: a ``PolicyBatch`` ``[B, S]`` (e.g. from :func:`grpo_profile_batch`).
    """
    logprobs = module.policy_logprobs(data)  # [B, T]
    return module.policy_loss(data, logprobs, data.mask.sum().float()).loss
