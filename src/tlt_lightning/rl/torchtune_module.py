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

Or torchtune's builders supply the model, as in a torchtune recipe: ``builder`` is a ``model:``
node (``{"_component_": "torchtune.models.llama3_2.llama3_2", "num_layers": 16, ...}``),
``checkpointer`` a ``checkpointer:`` node (``torchtune.training.FullModelHFCheckpointer``) whose
weights it is loaded with (its ``checkpoint_dir`` a transformers directory or a registry name:
:func:`~tlt_lightning.models.model_dir`), ``tokenizer`` an optional ``tokenizer:`` node (default:
the checkpoint directory's transformers tokenizer, if it has one); all three are built with
``torchtune.config.instantiate`` in :meth:`configure_policy`, and the KL reference is a frozen copy
of that initial decoder.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from tlt_lightning.models import ModelNotFoundError, load_model, load_tokenizer, model_dir
from tlt_lightning.models.registry import DTYPES
from tlt_lightning.models.target import TargetModel, eos_ids
from tlt_lightning.models.torchtune_target import TorchtuneTarget, TransformerDecoder, torchtune_from_hf
from tlt_lightning.rl.batch import PolicyBatch, head_logprobs
from tlt_lightning.rl.module import GRPOModule
from tlt_lightning.rl.sources import PromptSource, TaskPromptSource
from tlt_lightning.rl.tasks import TaskDataset

__all__ = ["TorchtuneGRPOModule", "torchtune_chat_render", "torchtune_completion_logprobs"]


def torchtune_chat_render(tokenizer: Any) -> Callable[[list[dict[str, str]]], tuple[str, list[int]]]:
    """A :class:`~tlt_lightning.rl.tasks.TaskDataset` ``render`` for a torchtune model tokenizer.

    Renders as torchtune's ``generate`` recipe does: the messages as torchtune ``Message`` objects
    and an empty assistant message, ``tokenizer({"messages": ...}, inference=True)["tokens"]``; the
    text is those tokens decoded with their special tokens. The generation prompt is right for
    tokenizers that honour ``inference=True`` (torchtune 0.6.1's Llama 3 tokenizer does; its Qwen 2 /
    2.5 tokenizers close the empty assistant turn: use their transformers tokenizer instead).

    Example:
        >>> render = torchtune_chat_render(llama3_tokenizer(path))  # doctest: +SKIP
        >>> text, ids = render([{"role": "user", "content": "What is 2+3?"}])  # doctest: +SKIP
    """
    from torchtune.data import Message

    def render(messages: list[dict[str, str]]) -> tuple[str, list[int]]:
        chat = [Message(role=m["role"], content=m["content"]) for m in messages]
        tokens = list(
            tokenizer({"messages": [*chat, Message(role="assistant", content="")]}, inference=True)["tokens"]
        )
        return tokenizer.decode(tokens, skip_special_tokens=False), tokens

    return render


def torchtune_completion_logprobs(
    decoder: TransformerDecoder, batch: PolicyBatch, temperature: float, gradient_checkpointing: bool = False
) -> torch.Tensor:
    """``[B, T]`` log-probabilities of the completion tokens under a torchtune ``decoder`` at ``temperature``.

    The torchtune twin of :func:`~tlt_lightning.rl.completion_logprobs`. Sequences are right-padded
    (``batch.input_ids`` ``[B, S]``), so every row's token ``s`` sits at position ``s`` and the
    ``[B, S, S]`` mask is causal over each row's real tokens (a padding query sees the row's real
    tokens, never an empty row). The LM head runs only where a completion token is predicted
    (:func:`~tlt_lightning.rl.batch.head_logprobs`).

    Args:
        decoder: a ``TransformerDecoder`` without torchtune KV caches set up.
        batch: the padded sequences (:func:`~tlt_lightning.rl.policy_batch`).
        temperature: the sampling temperature (logits are divided by it).
        gradient_checkpointing: recompute each layer's activations in backward (less memory).
    """
    ids, valid = batch.input_ids, batch.attention_mask.bool()
    S = ids.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=ids.device).tril()
    mask = causal & valid[:, None, :]  # [B, S, S]: query s sees real keys <= s
    h = decoder.tok_embeddings(ids)  # [B, S, H]
    for layer in decoder.layers:
        if gradient_checkpointing:
            h = checkpoint(layer, h, mask=mask, use_reentrant=False)
        else:
            h = layer(h, mask=mask)
    return head_logprobs(h, batch, lambda x: decoder.output(decoder.norm(x)), temperature)


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
        >>> module = TorchtuneGRPOModule(
        ...     model="tiny-llama", speculative={"drafter_kind": "eagle1"}, prompt_source=source
        ... )  # doctest: +SKIP
        >>> Trainer(max_steps=2, accelerator="cpu").fit(module)  # doctest: +SKIP
    """

    # The architecture the drafters and caches are sized from; set by configure_policy.
    _hf_config: PretrainedConfig | None = None
    _eos_token_ids: tuple[int, ...] = ()

    def __init__(
        self,
        *args: Any,
        builder: Mapping[str, Any] | None = None,
        checkpointer: Mapping[str, Any] | None = None,
        tokenizer: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        for name, node in (("builder", builder), ("checkpointer", checkpointer), ("tokenizer", tokenizer)):
            if node is not None and not (
                isinstance(node, Mapping) and isinstance(node.get("_component_"), str)
            ):
                raise ValueError(
                    f"{name} must be a torchtune config node (a mapping with a _component_ dotted "
                    f"path and its keyword arguments) or None, got {node!r}"
                )
        if (builder is None) != (checkpointer is None):
            raise ValueError(
                "builder and checkpointer go together (the builder makes the decoder, the checkpointer "
                f"loads its weights), got builder={builder!r}, checkpointer={checkpointer!r}"
            )
        if tokenizer is not None and builder is None:
            raise ValueError(
                "tokenizer needs builder and checkpointer "
                "(without them the tokenizer is the one `model` names)"
            )
        if checkpointer is not None and "checkpoint_dir" not in checkpointer:
            raise ValueError(
                f"checkpointer needs a checkpoint_dir (a transformers directory or a registry model "
                f"name), got {dict(checkpointer)!r}"
            )
        super().__init__(*args, **kwargs)

    def configure_policy(self) -> tuple[nn.Module, Any, TargetModel]:
        """The torchtune decoder (train mode), its tokenizer (or ``None``), its adapter.

        Built by ``builder`` and loaded by ``checkpointer`` when given, else converted from ``model``.
        """
        hp = self.hparams
        if hp.get("builder") is not None:
            decoder, tokenizer = self._build_from_nodes()
        else:
            loaded = load_model(hp.model, dtype=self.policy_dtype, seed=hp.seed)
            self._hf_config, self._eos_token_ids = loaded.model.config, eos_ids(loaded.model)
            decoder, tokenizer = torchtune_from_hf(loaded.model), loaded.tokenizer
        decoder.train()
        return decoder, tokenizer, self.make_target(decoder)

    def _build_from_nodes(self) -> tuple[TransformerDecoder, Any]:
        """``(decoder, tokenizer or None)`` from the ``builder`` / ``checkpointer`` / ``tokenizer`` nodes."""
        from omegaconf import OmegaConf
        from torchtune import config, training

        hp = self.hparams
        try:  # a directory, or a registry model's (written on first use)
            directory = model_dir(str(hp.checkpointer["checkpoint_dir"]), seed=hp.seed)
        except ModelNotFoundError as err:
            raise ValueError(
                f"checkpointer.checkpoint_dir: {err} The policy's architecture (drafter sizes, EOS "
                "ids) is read from the transformers config.json there."
            ) from err
        self._hf_config = AutoConfig.from_pretrained(directory, local_files_only=True)
        eos = None
        if (directory / "generation_config.json").is_file():
            eos = GenerationConfig.from_pretrained(directory, local_files_only=True).eos_token_id
        eos = self._hf_config.eos_token_id if eos is None else eos
        self._eos_token_ids = (
            () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hp.seed)  # the builder's initial weights, overwritten by the checkpoint
            decoder = config.instantiate(OmegaConf.create(dict(hp.builder)))
        if not isinstance(decoder, TransformerDecoder):
            raise TypeError(
                f"builder {hp.builder['_component_']} must return a torchtune TransformerDecoder, "
                f"got {type(decoder).__name__}"
            )
        checkpointer = config.instantiate(
            OmegaConf.create({**hp.checkpointer, "checkpoint_dir": str(directory)})
        )
        decoder.load_state_dict(checkpointer.load_checkpoint()[training.MODEL_KEY], strict=True)
        if hp.get("tokenizer") is not None:
            tokenizer = config.instantiate(OmegaConf.create(dict(hp.tokenizer)))
        else:
            tokenizer = load_tokenizer(directory)
        return decoder.to(DTYPES[self.policy_dtype]), tokenizer

    def configure_prompt_source(self) -> PromptSource:
        """The task's prompts, rendered by a torchtune tokenizer (:func:`torchtune_chat_render`) or the
        parent's way."""
        if self.tokenizer is None or isinstance(self.tokenizer, PreTrainedTokenizerBase):
            return super().configure_prompt_source()
        dataset = TaskDataset(self.task_config, self.tokenizer, render=torchtune_chat_render(self.tokenizer))
        return TaskPromptSource(dataset)

    def configure_reference(self) -> nn.Module:
        """The KL reference: with ``builder``, a copy of the initial decoder; else the parent's."""
        if self.hparams.get("builder") is None:
            return super().configure_reference()
        return copy.deepcopy(self.policy)

    def reference_logprobs(self, batch: PolicyBatch) -> torch.Tensor:
        """``[B, T]`` the reference's log-probabilities (a torchtune decoder with ``builder``)."""
        if isinstance(self.reference, TransformerDecoder):
            return torchtune_completion_logprobs(self.reference, batch, self.rollout_settings.temperature)
        return super().reference_logprobs(batch)

    def make_target(self, module: nn.Module) -> TargetModel:
        """A :class:`~tlt_lightning.models.TorchtuneTarget` over ``module`` (the policy or its mirror)."""
        if self._hf_config is None:
            raise RuntimeError("make_target needs the policy's architecture: call configure_model() first")
        return TorchtuneTarget(module, self._hf_config, self._eos_token_ids)

    def policy_logprobs(self, batch: PolicyBatch) -> torch.Tensor:
        """``[B, T]`` the torchtune policy's log-probabilities of the completion tokens (with grad)."""
        checkpointing = self.optim_config.gradient_checkpointing and self.policy.training
        return torchtune_completion_logprobs(
            self.policy, batch, self.rollout_settings.temperature, gradient_checkpointing=checkpointing
        )


def _signature() -> inspect.Signature:
    """The parent's parameters and ``builder`` / ``checkpointer`` / ``tokenizer``: what the class takes, for
    signature checks (``torchtune.config.validate``) that would otherwise see ``*args, **kwargs``."""
    parent = list(inspect.signature(GRPOModule).parameters.values())
    mine = [
        p
        for name, p in inspect.signature(TorchtuneGRPOModule.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    return inspect.Signature(parent + mine)


TorchtuneGRPOModule.__signature__ = _signature()
