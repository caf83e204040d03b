"""Target adapter for torchtune decoders (optional extra: ``pip install 'tlt-lightning[torchtune]'``).

:class:`TorchtuneTarget` implements the :class:`~tlt_lightning.models.TargetModel` protocol for a
torchtune :class:`~torchtune.modules.TransformerDecoder` of self-attention layers (the Llama and
Qwen2 builders), so the rollout engine and speculative decoding run on it unchanged. It runs
torchtune's own layers; only the KV cache is ours: for the duration of a forward each attention
layer's ``kv_cache`` is a view of one layer of our :class:`~tlt_lightning.models.KVCache` (per-row
lengths, tree slots), and the caller's 4D mask goes to torchtune's attention as ``[n, q, kv_len]``.
Without autograd, grouped-query layers also hand their keys/values to
:func:`~tlt_lightning.models.attention.grouped_sdpa` unexpanded (see :meth:`TorchtuneTarget._bound`).

:func:`torchtune_from_hf` builds the torchtune model of a transformers Llama / Qwen2 checkpoint with
torchtune's builders and loads the same weights through torchtune's converters (``hf_to_tune``
permutes q/k for torchtune's interleaved RoPE), so both compute the same function.

Example:
    >>> from tlt_lightning.models import load_model
    >>> target = TorchtuneTarget.from_hf(load_model("tiny-llama").model)
    >>> target.info.num_layers
    4
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from tlt_lightning.models.attention import MAX_GROUPED_QUERIES, grouped_sdpa
from tlt_lightning.models.kv_cache import KVCache
from tlt_lightning.models.target import TargetInfo, TargetOutput, begin_forward, eos_ids
from tlt_lightning.validation import MissingExtraError

try:
    from torchtune.models.convert_weights import hf_to_tune
    from torchtune.models.llama3 import llama3
    from torchtune.models.qwen2 import qwen2
    from torchtune.models.qwen2._convert_weights import qwen2_hf_to_tune
    from torchtune.modules import TransformerDecoder, TransformerSelfAttentionLayer
except ImportError as err:  # the optional extra is not installed
    raise MissingExtraError(
        "tlt_lightning.models.torchtune_target needs torchtune: pip install 'tlt-lightning[torchtune]' "
        f"(torchtune==0.6.1, torchao==0.15.0); the import failed with: {err}"
    ) from err

__all__ = ["TORCHTUNE_MODEL_TYPES", "TorchtuneTarget", "torchtune_from_hf"]

TORCHTUNE_MODEL_TYPES = ("llama", "qwen2")


class _LayerCache:
    """What torchtune's attention calls as ``kv_cache``: one layer of our :class:`KVCache`."""

    def __init__(self, cache: KVCache, layer: int) -> None:
        self.cache, self.layer = cache, layer

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(k, v, self.layer)  # [n, H_kv, q, D] in, [n, H_kv, kv_len, D] out


def _grouped_attention_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, dropout_p: float, is_causal: bool
) -> torch.Tensor:
    """torchtune's ``_attention_call`` for keys/values left with their own heads (no autograd).

    ``q`` ``[n, H_q, q, D]``, ``k`` / ``v`` ``[n, H_kv, kv, D]``, ``mask`` ``[n, q, kv]`` bool ->
    ``[n, H_q, q, D]``: :func:`grouped_sdpa` for up to :data:`MAX_GROUPED_QUERIES` queries per row,
    PyTorch's ``enable_gqa`` for longer prefills.
    """
    mask = mask[:, None]
    if q.shape[2] <= MAX_GROUPED_QUERIES:
        return grouped_sdpa(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class TorchtuneTarget(nn.Module):
    """Adapter for a torchtune ``TransformerDecoder`` (Llama / Qwen2 builders).

    Args:
        decoder: the model; its attention layers must not have torchtune caches set up (this
            adapter brings its own, like :class:`~tlt_lightning.models.HFTarget`).
        hf_config: the transformers config of the same architecture (``model_type``, sizes, rope):
            drafters are sized from it. Checked against ``decoder``.
        eos_token_ids: end-of-sequence ids; default ``hf_config.eos_token_id``.

    Raises:
        TypeError: ``decoder`` is not a ``TransformerDecoder`` of self-attention layers.
        ValueError: caches are set up, or ``hf_config`` disagrees with ``decoder`` (the message names
            the field).
    """

    def __init__(
        self,
        decoder: TransformerDecoder,
        hf_config: PretrainedConfig,
        eos_token_ids: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(decoder, TransformerDecoder):
            raise TypeError(f"decoder must be a torchtune TransformerDecoder, got {type(decoder).__name__}")
        if not all(isinstance(layer, TransformerSelfAttentionLayer) for layer in decoder.layers):
            raise TypeError(
                "decoder must have only TransformerSelfAttentionLayer layers (no cross-attention/fusion)"
            )
        if decoder.caches_are_setup():
            raise ValueError(
                "decoder has torchtune KV caches set up; build it without setup_caches(): "
                "TorchtuneTarget uses its own KVCache"
            )
        attn = decoder.layers[0].attn
        hf = hf_config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        for name, mine, theirs in (
            ("hidden_size", decoder.tok_embeddings.embedding_dim, hf.hidden_size),
            ("vocab_size", decoder.tok_embeddings.num_embeddings, hf.vocab_size),
            ("num_hidden_layers", len(decoder.layers), hf.num_hidden_layers),
            ("num_attention_heads", attn.num_heads, hf.num_attention_heads),
            ("num_key_value_heads", attn.num_kv_heads, kv_heads),
            ("head_dim", attn.head_dim, head_dim),
        ):
            if mine != theirs:
                raise ValueError(
                    f"hf_config does not match the decoder: {name} is {theirs}, decoder has {mine}"
                )
        self.decoder = decoder
        self._hf_config = hf
        self.grouped_attention = True  # see _bound; False: torchtune's own attention everywhere
        if eos_token_ids is None:
            eos = hf.eos_token_id
            eos_token_ids = (
                () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
            )
        self.info = TargetInfo(
            model_type=hf.model_type,
            hidden_size=hf.hidden_size,
            vocab_size=hf.vocab_size,
            num_layers=hf.num_hidden_layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_positions=min(decoder.max_seq_len, hf.max_position_embeddings),  # torchtune's RoPE table
            eos_token_ids=tuple(eos_token_ids),
        )

    @classmethod
    def from_hf(cls, model: PreTrainedModel) -> TorchtuneTarget:
        """The torchtune twin of a transformers Llama / Qwen2 model (same weights, copied)."""
        return cls(torchtune_from_hf(model), model.config, eos_ids(model))

    @property
    def hf_config(self) -> PretrainedConfig:
        return self._hf_config

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.decoder.tok_embeddings.weight.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[...]`` token ids -> ``[..., H]`` input embeddings."""
        return self.decoder.tok_embeddings(input_ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` final hidden states -> ``[..., V]`` logits (the model's dtype)."""
        return self.decoder.output(hidden)

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        i = self.info
        return KVCache(i.num_layers, max_batch, i.num_kv_heads, max_len, i.head_dim, self.dtype, self.device)

    @contextmanager
    def _bound(self, cache: KVCache) -> Iterator[None]:
        """Point every attention layer's ``kv_cache`` at ``cache`` for one forward.

        Without autograd a grouped-query layer also runs as if it had as many key/value heads as
        query heads (torchtune then skips expanding the cache to one copy per query head) and
        attends with :func:`_grouped_attention_call`, which reads the key/value heads as they
        are: the same attention without the copy, one CPU kernel block per key/value head
        (:mod:`tlt_lightning.models.attention`). Everything is put back on exit. Set
        ``grouped_attention = False`` to keep torchtune's own attention.
        """
        if self.decoder.caches_are_setup():
            raise ValueError("decoder has torchtune KV caches set up; TorchtuneTarget uses its own KVCache")
        attns = [layer.attn for layer in self.decoder.layers]
        on = self.grouped_attention and not torch.is_grad_enabled()
        grouped = [a for a in attns if a.num_kv_heads != a.num_heads] if on else []
        saved = [(a.num_kv_heads, a._attention_call) for a in grouped]
        try:
            for i, attn in enumerate(attns):
                attn.kv_cache, attn.cache_enabled = _LayerCache(cache, i), True
            for attn in grouped:
                attn.num_kv_heads, attn._attention_call = attn.num_heads, _grouped_attention_call
            yield
        finally:
            for attn in attns:
                attn.kv_cache, attn.cache_enabled = None, False
            for attn, (kv_heads, call) in zip(grouped, saved):
                attn.num_kv_heads, attn._attention_call = kv_heads, call

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: KVCache,
        feature_layers: tuple[int, ...] = (),
        slots: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run new tokens through the decoder, writing their keys/values into ``cache``.

        Same contract as :meth:`HFTarget.forward <tlt_lightning.models.HFTarget.forward>`: ``input_ids``
        and ``positions`` ``[n, q]``, ``attention_mask`` ``[n, 1, q, kv_len]`` bool, optional ``slots``;
        returns ``[n, q, H]`` final normalised states and ``[n, q, C, H]`` features (index ``i < L``:
        the stream entering layer ``i``, ``L``: the final normalised state).
        """
        begin_forward(cache, input_ids, positions, attention_mask, slots)
        L = self.info.num_layers
        if any(not 0 <= i <= L for i in feature_layers):
            raise ValueError(f"feature_layers must lie in [0, {L}], got {feature_layers}")
        mask = attention_mask[:, 0]  # torchtune's attention takes [b, s, kv] and adds the head axis
        h = self.decoder.tok_embeddings(input_ids)
        captured: dict[int, torch.Tensor] = {}
        with self._bound(cache):
            for i, layer in enumerate(self.decoder.layers):
                if i in feature_layers:
                    captured[i] = h
                h = layer(h, mask=mask, input_pos=positions)
        h = self.decoder.norm(h)
        captured[L] = h
        features = torch.stack([captured[i] for i in feature_layers], dim=2) if feature_layers else None
        return TargetOutput(h, features)


def _check_convertible(config: Any) -> None:
    mt = config.model_type
    if mt not in TORCHTUNE_MODEL_TYPES:
        raise ValueError(
            f"model_type must be one of {TORCHTUNE_MODEL_TYPES} to convert to torchtune, got {mt!r}"
        )
    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
    checks = (
        ("hidden_act", config.hidden_act, config.hidden_act == "silu", "'silu'"),
        ("rope_type", rope.get("rope_type"), rope.get("rope_type", "default") == "default", "'default'"),
        (
            "head_dim",
            getattr(config, "head_dim", None),
            getattr(config, "head_dim", None) in (None, config.hidden_size // config.num_attention_heads),
            "hidden_size // num_attention_heads (what torchtune's builders use)",
        ),
        ("mlp_bias", getattr(config, "mlp_bias", False), not getattr(config, "mlp_bias", False), "False"),
    )
    if mt == "llama":
        bias = getattr(config, "attention_bias", False)
        checks += (("attention_bias", bias, not bias, "False (torchtune's llama3 has no biases)"),)
    for name, value, ok, allowed in checks:
        if not ok:
            raise ValueError(f"{name} must be {allowed} to convert a {mt} model to torchtune, got {value!r}")


def torchtune_from_hf(model: PreTrainedModel) -> TransformerDecoder:
    """Build the torchtune decoder of a transformers Llama / Qwen2 model and load its weights.

    Llama uses ``torchtune.models.llama3.llama3`` (its RoPE without scaling) and
    ``convert_weights.hf_to_tune``; Qwen2 uses ``torchtune.models.qwen2.qwen2`` and
    ``qwen2_hf_to_tune``. Tied embeddings stay tied. The result is in eval mode, on the model's
    device and dtype.

    Raises:
        ValueError: another architecture, or a setting torchtune's builders do not have (the
            message names it and what is allowed).
    """
    c = model.config
    _check_convertible(c)
    rope = getattr(c, "rope_parameters", None) or {"rope_theta": getattr(c, "rope_theta", 10000.0)}
    heads, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    dims = dict(
        vocab_size=c.vocab_size,
        num_layers=c.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv,
        embed_dim=c.hidden_size,
        intermediate_dim=c.intermediate_size,
        max_seq_len=c.max_position_embeddings,
        norm_eps=c.rms_norm_eps,
        rope_base=rope["rope_theta"],
    )
    state = {k: v.detach() for k, v in model.state_dict().items()}
    convert = dict(num_heads=heads, num_kv_heads=kv, dim=c.hidden_size, head_dim=c.hidden_size // heads)
    tied = bool(getattr(c, "tie_word_embeddings", False))
    with torch.device("cpu"):
        if c.model_type == "llama":
            decoder, weights = llama3(**dims), hf_to_tune(state, **convert)
            if tied:
                weights.setdefault("output.weight", weights["tok_embeddings.weight"])
        else:
            decoder = qwen2(**dims, tie_word_embeddings=tied)
            weights = qwen2_hf_to_tune(state, **convert, tie_word_embeddings=tied)
    decoder.load_state_dict(weights, strict=True)
    if tied and c.model_type == "llama":
        decoder.output.weight = decoder.tok_embeddings.weight  # one parameter, as in the HF model
    param = next(model.parameters())
    return decoder.to(device=param.device, dtype=param.dtype).eval()
