"""TorchtuneGRPOModule: the same GRPO + TLT training with a torchtune ``TransformerDecoder`` as the policy.

Optional extra (``pip install 'tlt-lightning[torchtune]'``); ``tlt_lightning.rl`` exports
:class:`TorchtuneGRPOModule` lazily, so importing the package never imports torchtune.

The policy is built by torchtune's own builders (``llama3`` / ``qwen2``) and loaded with the
registry model's weights by torchtune's converters
(:func:`~tlt_lightning.models.torchtune_from_hf`), so at step 0 it computes the same function as
:class:`~tlt_lightning.rl.GRPOModule`'s transformers policy. Everything else is the parent's:
rollouts (plain or speculative) run on a :class:`~tlt_lightning.models.TorchtuneTarget` over the
policy (or over its ``rollout_dtype`` mirror, a torchtune decoder too), drafters borrow the
decoder's ``tok_embeddings`` and ``output``, and the training log-probabilities come from
:func:`torchtune_completion_logprobs`: torchtune's layers over the right-padded batch, logits only
where completion tokens are predicted.

With ``kl_coef > 0`` the frozen reference is the parent's: the transformers model of ``model`` with
the same initial weights, i.e. the same function as the initial torchtune policy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig

from tlt_lightning.models import load_model
from tlt_lightning.models.target import TargetModel, _eos_ids
from tlt_lightning.models.torchtune_target import TorchtuneTarget, TransformerDecoder, torchtune_from_hf
from tlt_lightning.rl.batch import PolicyBatch
from tlt_lightning.rl.grpo import token_logprobs
from tlt_lightning.rl.module import GRPOModule

__all__ = ["TorchtuneGRPOModule", "torchtune_completion_logprobs"]


def torchtune_completion_logprobs(
    decoder: TransformerDecoder, batch: PolicyBatch, temperature: float, gradient_checkpointing: bool = False
) -> torch.Tensor:
    """``[B, T]`` log-probabilities of the completion tokens under a torchtune ``decoder`` at ``temperature``.

    The torchtune twin of :func:`~tlt_lightning.rl.completion_logprobs`. Sequences are right-padded
    (``batch.input_ids`` ``[B, S]``), so every row's token ``s`` sits at position ``s`` and the
    ``[B, S, S]`` mask is causal over each row's real tokens (a padding query sees the row's real
    tokens, never an empty row). The LM head runs only at the positions that predict completion
    tokens (``prompt_len + t - 1``): ``[B, T, V]`` logits, never ``[B, S, V]``.

    Args:
        decoder: a ``TransformerDecoder`` without torchtune KV caches set up.
        batch: the padded sequences (:func:`~tlt_lightning.rl.policy_batch`).
        temperature: the sampling temperature (logits are divided by it).
        gradient_checkpointing: recompute each layer's activations in backward (less memory).
    """
    ids, valid = batch.input_ids, batch.attention_mask.bool()
    S, T = ids.shape[1], batch.tokens.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=ids.device).tril()
    mask = causal & valid[:, None, :]  # [B, S, S]: query s sees real keys <= s
    h = decoder.tok_embeddings(ids)  # [B, S, H]
    for layer in decoder.layers:
        if gradient_checkpointing:
            h = checkpoint(layer, h, mask=mask, use_reentrant=False)
        else:
            h = layer(h, mask=mask)
    idx = (batch.prompt_lens[:, None] - 1 + torch.arange(T, device=h.device)).clamp(max=S - 1)
    picked = h.gather(1, idx[..., None].expand(-1, -1, h.shape[-1]))  # [B, T, H]
    return token_logprobs(decoder.output(decoder.norm(picked)), batch.tokens, temperature)


class TorchtuneGRPOModule(GRPOModule):
    """:class:`~tlt_lightning.rl.GRPOModule` whose trained policy is a torchtune ``TransformerDecoder``.

    Takes the parent's arguments. ``model`` names a Llama or Qwen2 model (registry name or local
    transformers directory); the policy is torchtune's builder of that architecture with its
    weights, in ``dtype`` (:func:`~tlt_lightning.models.torchtune_from_hf`: SiLU MLP, default RoPE,
    no Llama attention bias, else a ``ValueError`` naming the setting). ``policy_target`` and
    ``rollout_target`` are :class:`~tlt_lightning.models.TorchtuneTarget` adapters; the checkpoint
    holds the decoder's torchtune parameter names (``policy.layers.0.attn.q_proj.weight``, ...).
    ``gradient_checkpointing`` checkpoints each torchtune layer in the training forward.

    Example:
        >>> source = TokenPromptSource([[5, 6, 7], [8, 9], [3], [4, 2]], reward_fn)  # doctest: +SKIP
        >>> module = TorchtuneGRPOModule(model="tiny-llama", drafter_kind="eagle1", prompt_source=source)  # doctest: +SKIP
        >>> Trainer(max_steps=2, accelerator="cpu").fit(module)  # doctest: +SKIP
    """

    # The architecture the drafters and caches are sized from; set by configure_policy.
    _hf_config: PretrainedConfig | None = None
    _eos_token_ids: tuple[int, ...] = ()

    def configure_policy(self) -> tuple[nn.Module, Any, TargetModel]:
        """The torchtune decoder of ``model`` (train mode), its tokenizer (or ``None``), its adapter."""
        hp = self.hparams
        loaded = load_model(hp.model, dtype=hp.dtype, seed=hp.seed)
        self._hf_config, self._eos_token_ids = loaded.model.config, _eos_ids(loaded.model)
        decoder = torchtune_from_hf(loaded.model).train()
        return decoder, loaded.tokenizer, self.make_target(decoder)

    def make_target(self, module: nn.Module) -> TargetModel:
        """A :class:`~tlt_lightning.models.TorchtuneTarget` over ``module`` (the policy or its mirror)."""
        if self._hf_config is None:
            raise RuntimeError("make_target needs the policy's architecture: call configure_model() first")
        return TorchtuneTarget(module, self._hf_config, self._eos_token_ids)

    def policy_logprobs(self, batch: PolicyBatch) -> torch.Tensor:
        """``[B, T]`` the torchtune policy's log-probabilities of the completion tokens (with grad)."""
        hp = self.hparams
        return torchtune_completion_logprobs(
            self.policy, batch, hp.temperature, gradient_checkpointing=hp.gradient_checkpointing and self.policy.training
        )
