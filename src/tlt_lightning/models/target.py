"""Target adapters: what the rollout engine, speculative decoding and drafter training need from a model.

A target exposes its embedding, its LM head, and one forward over several new tokens per row with
a caller-built attention mask (causal for plain decoding, a tree for verification) that writes
into a :class:`~tlt_lightning.models.kv_cache.KVCache` and returns the hidden states of chosen
layers from the same pass, so drafter features cost no extra forward.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from tlt_lightning.models.attention import GROUPED_SDPA, use_grouped_attention
from tlt_lightning.models.compiled import Bucket, CompileConfig, CompiledDecode, check_compiled_model
from tlt_lightning.models.kv_cache import KVCache
from tlt_lightning.models.layout import PackedLinear, column_major, set_weight_layout
from tlt_lightning.models.lean import check_lean_model, lean_applies, lean_forward

__all__ = [
    "DECODE_PATHS",
    "HFTarget",
    "TargetInfo",
    "TargetModel",
    "TargetOutput",
    "begin_forward",
    "default_feature_layers",
]


log = logging.getLogger(__name__)

DECODE_PATHS = ("hf", "lean", "compiled")
"""How :class:`HFTarget` runs decode and verify forwards: transformers' module tree,
:func:`~tlt_lightning.models.lean.lean_forward` (same outputs, fewer ops; Llama and Qwen2), or that
forward through ``torch.compile`` over shape buckets (:mod:`~tlt_lightning.models.compiled`)."""


def cache_argument(decoder: nn.Module) -> str:
    """The name under which ``decoder.forward`` takes its cache: ``cache`` in newer transformers 5 releases,
    ``past_key_values`` before (5.19 and older, which vLLM pins). Under the wrong name the cache
    would vanish into ``**kwargs`` and the model would attend to the new tokens alone."""
    parameters = inspect.signature(decoder.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise TypeError(
        f"{type(decoder).__name__}.forward takes neither `cache` nor `past_key_values`: "
        "this transformers version is not supported (transformers>=5.0,<6)"
    )


class TargetOutput(NamedTuple):
    """Result of one target forward.

    Attributes:
        hidden: ``[n, q, H]`` final (normalised) hidden states, the LM head's input.
        features: ``[n, q, C, H]`` hidden states of the requested layers, or ``None``.
    """

    hidden: torch.Tensor
    features: torch.Tensor | None


@dataclass(frozen=True)
class TargetInfo:
    """Static facts about a target that drafters and caches are sized from."""

    model_type: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    eos_token_ids: tuple[int, ...]


def default_feature_layers(num_layers: int, kind: str = "eagle1") -> tuple[int, ...]:
    """Hidden-state indices a drafter reads (``0`` = embeddings, ``i`` = after layer ``i``, ``L`` = final).

    ``"eagle1"``: the final normalised state. ``"eagle3"``: a low, a middle and a high layer, as
    EAGLE-3 does (``2, L // 2, L - 3``; ``1, L // 2, L - 1`` for models of fewer than 8 layers).
    """
    if kind == "eagle1":
        return (num_layers,)
    if kind == "eagle3":
        if num_layers < 4:
            raise ValueError(f"eagle3 features need a target with >= 4 layers, got {num_layers}")
        if num_layers >= 8:
            return (2, num_layers // 2, num_layers - 3)
        return (1, num_layers // 2, num_layers - 1)
    raise ValueError(f"kind must be 'eagle1' or 'eagle3', got {kind!r}")


@runtime_checkable
class TargetModel(Protocol):
    """The protocol every target adapter implements (HF transformers, torchtune, ...)."""

    info: TargetInfo

    @property
    def hf_config(self) -> PretrainedConfig: ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def new_cache(self, max_batch: int, max_len: int) -> KVCache: ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: KVCache,
        feature_layers: tuple[int, ...] = (),
        slots: torch.Tensor | None = None,
    ) -> TargetOutput: ...


def begin_forward(
    cache: KVCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attention_mask: torch.Tensor,
    slots: torch.Tensor | None = None,
) -> int:
    """Declare a target forward's cache writes and check its mask; every adapter's forward starts here.

    Returns:
        ``kv_len``; ``attention_mask`` must be ``[n, 1, q, kv_len]`` for ``[n, q]`` ``input_ids``.
    """
    n, q = input_ids.shape
    kv_len = cache.begin_step(n, positions if slots is None else slots)
    if attention_mask.shape != (n, 1, q, kv_len):
        raise ValueError(
            f"attention_mask must be [n, 1, q, kv_len] = {[n, 1, q, kv_len]}, "
            f"got {list(attention_mask.shape)}"
        )
    return kv_len


def hf_attention_mask(model: PreTrainedModel, mask: torch.Tensor) -> torch.Tensor:
    """Our ``[n, 1, q, kv_len]`` bool mask in the form ``model``'s attention implementation adds or reads.

    ``sdpa`` (and :data:`~tlt_lightning.models.attention.GROUPED_SDPA`) take the bool mask as it is;
    ``eager`` adds its mask to the scores, so it gets ``0`` where a query may attend and the dtype's
    minimum elsewhere (a bool mask would be added as 1/0 and attend everywhere). Implementations that
    take no arbitrary 4-D mask (flash, flex, paged) cannot verify trees and are refused.
    """
    impl = model.config._attn_implementation
    if impl in ("sdpa", GROUPED_SDPA):
        return mask
    if impl == "eager":
        return torch.zeros(mask.shape, dtype=model.dtype, device=mask.device).masked_fill_(
            ~mask, torch.finfo(model.dtype).min
        )
    raise ValueError(
        f"HFTarget passes explicit [n, 1, q, kv_len] attention masks (tree verification, cache slots), "
        f"which attn_implementation={impl!r} does not take; load the model with attn_implementation='sdpa'"
    )


def eos_ids(model: PreTrainedModel) -> tuple[int, ...]:
    """The end-of-sequence token ids of a transformers model (generation config first, then config).

    Args:
        model: a transformers ``PreTrainedModel``.

    Returns:
        The ids as a tuple, empty when the model names none.
    """
    eos = model.generation_config.eos_token_id if model.generation_config else None
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


class HFTarget(nn.Module):
    """Adapter for transformers decoder-only models (Llama, Qwen2, and the many that share their layout).

    Args:
        model: a ``*ForCausalLM`` model whose attention layers call ``cache.update(...)``. A model
            on transformers' ``sdpa`` attention is switched to
            :data:`~tlt_lightning.models.attention.GROUPED_SDPA`: the same attention, run once per
            key/value head when a few tokens per row are decoded without autograd (verifying
            drafts), transformers' ``sdpa`` everywhere else (training is unchanged). ``eager``
            attention runs too (:func:`hf_attention_mask`); flash and flex attention are refused.
        decode: ``"hf"`` runs every forward through transformers; ``"lean"`` runs decode and verify
            forwards (inference, ``1..MAX_LEAN_QUERIES`` tokens per row) through
            :func:`~tlt_lightning.models.lean.lean_forward` over the same weights, with the same
            outputs bit for bit and less per-op overhead; prefill and training stay on transformers.
            ``"lean"`` needs a Llama or Qwen2 model on ``sdpa`` attention
            (:func:`~tlt_lightning.models.lean.check_lean_model`). ``"compiled"`` (opt-in) runs
            those forwards through compiled graphs, one per shape bucket
            (:class:`~tlt_lightning.models.compiled.CompiledDecode`; fp32 greedy outputs equal; hidden
            states within 1e-5 (fp32) / 5e-2 (bf16) of the largest value), the eager lean forward
            where a call fits no graph; a model the lean path cannot run logs a warning and decodes
            with ``"hf"`` (``"lean"`` if only its linears are wrapped). :attr:`compile_seconds` is
            the compile time so far.
        compile_config: buckets and mode for ``decode="compiled"``.

    Example:
        >>> from tlt_lightning.models import load_model
        >>> target = HFTarget(load_model("tiny-llama").model)
        >>> target.info.num_layers
        4
    """

    def __init__(
        self, model: PreTrainedModel, decode: str = "hf", compile_config: CompileConfig | None = None
    ) -> None:
        super().__init__()
        config = model.config
        if getattr(config, "is_encoder_decoder", False):
            raise TypeError(f"HFTarget needs a decoder-only causal LM, got {type(model).__name__}")
        self.model = model
        hf_attention_mask(model, torch.ones(1, 1, 1, 1, dtype=torch.bool))  # refuses what cannot run here
        use_grouped_attention(model)
        self.set_decode(decode, compile_config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.info = TargetInfo(
            model_type=config.model_type,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            num_layers=config.num_hidden_layers,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            max_positions=config.max_position_embeddings,
            eos_token_ids=eos_ids(model),
        )
        self.weight_layout = "out_in"
        self._head_copy: tuple[tuple[int, int], torch.Tensor] | None = None
        self._cache_argument = cache_argument(model.get_decoder())

    def set_decode(self, decode: str, compile_config: CompileConfig | None = None) -> str:
        """Run decode and verify forwards by ``decode`` (see the class); returns the path taken, which
        for ``"compiled"`` may be an eager one (logged). Caches made before keep working only on the
        old path: call it before the rollouts."""
        if decode not in DECODE_PATHS:
            raise ValueError(f"decode must be one of {DECODE_PATHS}, got {decode!r}")
        if decode == "lean":
            check_lean_model(self.model)
        self._compiled: CompiledDecode | None = None
        if decode == "compiled":
            decode = self._compiled_or_fallback(self.model, compile_config)
        self.decode = decode
        return decode

    def _compiled_or_fallback(self, model: PreTrainedModel, compile_config: CompileConfig | None) -> str:
        """Set up ``decode="compiled"``, or the eager path the model supports (with a warning)."""
        try:
            check_compiled_model(model)
        except (TypeError, ValueError) as err:
            try:
                check_lean_model(model)
                eager = "lean"
            except (TypeError, ValueError):
                eager = "hf"
            log.warning(
                "decode='compiled' is not available for this model (%s); decoding with decode=%r", err, eager
            )
            return eager
        self._compiled = CompiledDecode(model, compile_config)
        return "compiled"

    @property
    def compile_config(self) -> CompileConfig | None:
        """The compiled graphs' settings (``None`` unless ``decode="compiled"``)."""
        return None if self._compiled is None else self._compiled.config

    @property
    def compile_times(self) -> dict[Bucket, float]:
        """Seconds each compiled bucket's first call took (empty unless ``decode="compiled"``)."""
        return {} if self._compiled is None else dict(self._compiled.compile_times)

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling decode graphs so far (0 unless ``decode="compiled"``)."""
        return sum(self.compile_times.values())

    @property
    def hf_config(self) -> PretrainedConfig:
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[...]`` token ids -> ``[..., H]`` input embeddings."""
        return self.model.get_input_embeddings()(input_ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` final hidden states -> ``[..., V]`` logits."""
        head = self.model.get_output_embeddings()
        if self.weight_layout != "in_out" or not head.weight.is_contiguous() or torch.is_grad_enabled():
            return head(hidden)
        # A head tied to the embedding stays row-major (set_weight_layout): multiply by a
        # column-major copy, refreshed when the weights change in place (RL updates).
        key = (head.weight.data_ptr(), head.weight._version)
        if self._head_copy is None or self._head_copy[0] != key:
            with torch.inference_mode(False):
                self._head_copy = (key, column_major(head.weight.detach()))
        return F.linear(hidden, self._head_copy[1], head.bias)

    def release_weight_copies(self) -> int:
        """Drop the copies of the weights laid out for decoding (packed weights, a tied head's column-major
        copy), remade on next use; returns their bytes. An RL step calls it once its rollouts are done:
        the update changes the weights, so the copies would be remade anyway."""
        freed = sum(m._packed_weight.release() for m in self.model.modules() if isinstance(m, PackedLinear))
        if self._compiled is not None:
            freed += self._compiled.release_packed()
        if self._head_copy is not None:
            freed += self._head_copy[1].numel() * self._head_copy[1].element_size()
            self._head_copy = None
        return freed

    def set_weight_layout(self, layout: str) -> int:
        """Lay out the model's linear weights ``"out_in"`` (PyTorch's), ``"in_out"`` or ``"packed"``, see
        :mod:`tlt_lightning.models.layout`; returns how many changed. With ``"in_out"`` a tied LM
        head gets a column-major copy for decoding (one more ``V x H`` tensor); ``"packed"`` packs
        it like every other linear."""
        changed = set_weight_layout(self.model, layout)
        self.weight_layout, self._head_copy = layout, None
        return changed

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        i = self.info
        if self._compiled is not None:  # room for the buckets' padding
            return self._compiled.new_cache(
                i.num_layers, max_batch, i.num_kv_heads, max_len, i.head_dim, self.dtype, self.device
            )
        return KVCache(i.num_layers, max_batch, i.num_kv_heads, max_len, i.head_dim, self.dtype, self.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: KVCache,
        feature_layers: tuple[int, ...] = (),
        slots: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run new tokens through the model, writing their keys/values into ``cache``.

        Args:
            input_ids: ``[n, q]`` new tokens of the first ``n`` cache rows.
            positions: ``[n, q]`` their rotary positions; also their cache slots unless ``slots`` is given.
            attention_mask: ``[n, 1, q, kv_len]`` bool, True where a query may attend a key slot,
                ``kv_len = positions.max() + 1``.
            cache: the rows' cache.
            feature_layers: hidden-state indices to return (see :func:`default_feature_layers`).
            slots: ``[n, q]`` cache slots, when they differ from the positions (tree verification:
                siblings share a position, not a slot). ``kv_len = slots.max() + 1`` then.

        Returns:
            The final hidden states and the requested features, ``[n, q, H]`` / ``[n, q, C, H]``.
        """
        begin_forward(cache, input_ids, positions, attention_mask, slots)
        if self._compiled is not None and attention_mask.dtype == torch.bool:
            out = self._compiled(input_ids, positions, attention_mask, cache, feature_layers, slots)
            if out is not None:
                return TargetOutput(*out)
        if self.decode != "hf" and lean_applies(input_ids, attention_mask):
            return TargetOutput(
                *lean_forward(self.model, input_ids, positions, attention_mask, cache, feature_layers)
            )
        out = self.model.get_decoder()(
            input_ids=input_ids,
            attention_mask=hf_attention_mask(self.model, attention_mask),
            position_ids=positions,
            **{self._cache_argument: cache},
            use_cache=True,
            output_hidden_states=bool(feature_layers),
        )
        features = None
        if feature_layers:
            features = torch.stack([out.hidden_states[i] for i in feature_layers], dim=2)
        return TargetOutput(out.last_hidden_state, features)
