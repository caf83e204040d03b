"""A lean decode forward for Llama and Qwen2 targets: the same computation as transformers', fewer ops.

A decode or verify step on a small model on a CPU is dominated by per-op overhead, not by the
arithmetic: SmolLM2-135M has 30 layers, and transformers' module tree adds mask construction,
output recording, keyword plumbing and hooks around every layer. :func:`lean_forward` runs the
same modules' weights (in place, whatever their layout: :mod:`~tlt_lightning.models.layout` packing
and peft wrappers keep working, because the linears are called as modules) in one flat loop,
op for op what transformers' Llama/Qwen2 code does with the :data:`GROUPED_SDPA` attention, so its
outputs equal the transformers path bit for bit in fp32 and bf16 on the shapes it takes
(``tests/models/test_lean.py``).

It takes inference-only calls (no autograd) of ``1..MAX_GROUPED_QUERIES`` new tokens per row with
a boolean mask: decoding and verifying drafts. Prefill and training keep transformers' forward.

Measured side by side (``benchmarks/decode_paths.py``, SmolLM2-135M, bf16, packed weights, one thread
of a busy 2-core AMD Zen 4): one forward + head is 1.04-1.12x faster than transformers' path, a
greedy ``RolloutEngine`` decode step 1.02x (batch 1) and 1.05x (batch 8); most of the step is the
linears (oneDNN), not dispatch. The same loop through ``torch.compile`` (``--compile
--compile-packed``) was 1.15-1.45x faster than transformers' path, but compiled 26-31 s per shape
and is not bit-equal: that is :mod:`~tlt_lightning.models.compiled` (``decode="compiled"``), which
traces :func:`lean_decoder` itself over shape buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

from tlt_lightning.models.attention import GROUPED_SDPA, MAX_GROUPED_QUERIES, grouped_sdpa_attention
from tlt_lightning.models.kv_cache import KVCache

__all__ = [
    "LEAN_LAYER_TYPES",
    "Attention",
    "MAX_LEAN_QUERIES",
    "Linear",
    "Linears",
    "UpdateKV",
    "check_lean_model",
    "lean_applies",
    "lean_decoder",
    "lean_forward",
]

Linear = Callable[[torch.Tensor, nn.Module, str], torch.Tensor]
"""``linear(x, module, name)``: one of the model's linears applied to ``x``; ``name`` is its path in
the decoder (``"layers.3.self_attn.q_proj"``), for callers that multiply by their own copy of it."""

Linears = Callable[[torch.Tensor, tuple[nn.Module, ...], tuple[str, ...]], Sequence[torch.Tensor]]
"""``linears(x, modules, names)``: several of the model's linears applied to the same ``x`` (q/k/v; gate and
up), one output each, for callers that multiply by one merged copy of their weights."""

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""``attention(query, key, value, mask, scale)``: ``[n, H_q, q, D]`` queries over ``[n, H_kv, kv_len, D]``
keys and values under an ``[n, 1, q, kv_len]`` bool mask, ``[n, H_q, q, D]`` out (as
:func:`~tlt_lightning.models.attention.grouped_sdpa`)."""

UpdateKV = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
"""``update_kv(key, value, layer_idx)``: store ``[n, H_kv, q, D]`` new keys/values of a layer and
return the ``[n, H_kv, kv_len, D]`` keys/values attention reads (:meth:`KVCache.update`'s contract)."""

LEAN_LAYER_TYPES: tuple[type[nn.Module], ...] = (LlamaDecoderLayer, Qwen2DecoderLayer)
"""Decoder layer classes whose forward :func:`lean_forward` reproduces (pre-norm, RoPE, GQA, SwiGLU)."""

MAX_LEAN_QUERIES = MAX_GROUPED_QUERIES
"""Most new tokens per row the lean path takes; longer calls (prefill) run transformers' forward,
whose attention differs there (~1e-6 in fp32) from the grouped attention used here."""


def check_lean_model(model: nn.Module) -> None:
    """Raise unless :func:`lean_forward` computes exactly what ``model``'s own forward does.

    Raises:
        TypeError: a decoder layer is not one of :data:`LEAN_LAYER_TYPES`.
        ValueError: the model uses sliding-window attention or an attention implementation other
            than ``sdpa`` (which :class:`~tlt_lightning.models.HFTarget` switches to
            :data:`GROUPED_SDPA`).
    """
    decoder = model.get_decoder()
    for i, layer in enumerate(decoder.layers):
        if type(layer) not in LEAN_LAYER_TYPES:
            allowed = [t.__name__ for t in LEAN_LAYER_TYPES]
            raise TypeError(
                f"decode='lean' supports decoder layers {allowed}, layer {i} is {type(layer).__name__}; "
                "use decode='hf' for this model"
            )
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            raise ValueError(
                f"decode='lean' does not implement sliding-window attention (layer {i}: "
                f"sliding_window={layer.self_attn.sliding_window}); use decode='hf'"
            )
    impl = model.config._attn_implementation
    if impl != GROUPED_SDPA:
        raise ValueError(
            f"decode='lean' needs the model on 'sdpa' attention, got attn_implementation={impl!r}; "
            "load it with attn_implementation='sdpa' or use decode='hf'"
        )


def lean_applies(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> bool:
    """Whether a forward of ``[n, q]`` tokens takes the lean path: inference,
    ``q <= MAX_LEAN_QUERIES``, bool mask."""
    return (
        input_ids.shape[1] <= MAX_LEAN_QUERIES
        and attention_mask.dtype == torch.bool
        and not torch.is_grad_enabled()
    )


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm`` / ``Qwen2RMSNorm``, op for op (statistics in fp32, scale in the input dtype)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _call_module(x: torch.Tensor, module: nn.Module, name: str) -> torch.Tensor:
    return module(x)


def _one_by_one(linear: Linear) -> Linears:
    """The default :data:`Linears`: ``linear`` applied to each module in turn."""

    def linears(
        x: torch.Tensor, modules: tuple[nn.Module, ...], names: tuple[str, ...]
    ) -> list[torch.Tensor]:
        return [linear(x, m, n) for m, n in zip(modules, names)]

    return linears


def lean_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: KVCache,
    feature_layers: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The decoder of a Llama/Qwen2 ``*ForCausalLM`` over new tokens, writing their keys/values into
    ``cache``.

    The caller has declared the writes (:func:`~tlt_lightning.models.target.begin_forward`).

    Args:
        model: a model accepted by :func:`check_lean_model`.
        input_ids: ``[n, q]`` new tokens, ``q <= MAX_LEAN_QUERIES``.
        positions: ``[n, q]`` rotary positions.
        attention_mask: ``[n, 1, q, kv_len]`` bool.
        cache: the rows' cache.
        feature_layers: hidden-state indices to return (``0`` embeddings, ``i`` after layer ``i``,
            ``L`` the final normalised state), as transformers' ``output_hidden_states`` gives them.

    Returns:
        ``[n, q, H]`` final normalised hidden states and ``[n, q, C, H]`` features (or ``None``).

    Example:
        >>> from tlt_lightning.models import HFTarget, load_model
        >>> target = HFTarget(load_model("tiny-llama").model)
        >>> cache = target.new_cache(1, 8)
        >>> ids, pos = torch.tensor([[5, 6]]), torch.arange(2)[None]
        >>> mask = torch.ones(1, 1, 2, 2, dtype=torch.bool).tril()
        >>> _ = cache.begin_step(1, pos)
        >>> with torch.no_grad():
        ...     hidden, _ = lean_forward(target.model, ids, pos, mask, cache)
        >>> hidden.shape
        torch.Size([1, 2, 64])
    """
    return lean_decoder(model, input_ids, positions, attention_mask, cache.update, feature_layers)


def lean_decoder(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attention_mask: torch.Tensor,
    update_kv: UpdateKV,
    feature_layers: tuple[int, ...] = (),
    linear: Linear = _call_module,
    attention: Attention | None = None,
    linears: Linears | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`lean_forward` with the key/value store and the linears injected: the one copy of the math.

    The eager path stores into a :class:`KVCache` and calls the linears as modules;
    :mod:`~tlt_lightning.models.compiled` traces this same function with a static-shape store and
    oneDNN-packed weights. Arguments and returns as :func:`lean_forward`'s, with ``update_kv``
    (:data:`UpdateKV`) for the cache, ``linear`` (:data:`Linear`) for every projection,
    ``attention`` (:data:`Attention`; default: the grouped attention transformers would dispatch) and
    ``linears`` (:data:`Linears`; default: ``linear`` on each) for the projections of one input.
    """
    if linears is None:
        linears = _one_by_one(linear)
    decoder = model.get_decoder()
    n, q = input_ids.shape
    num_layers = len(decoder.layers)
    wanted = set(feature_layers)
    states: dict[int, torch.Tensor] = {}
    hidden = decoder.embed_tokens(input_ids)
    if 0 in wanted:
        states[0] = hidden
    cos, sin = decoder.rotary_emb(hidden, positions)
    cos, sin = cos[:, None], sin[:, None]  # [n, 1, q, D]: broadcast over heads
    for i, layer in enumerate(decoder.layers):
        attn, mlp = layer.self_attn, layer.mlp
        pre = f"layers.{i}."
        x = _rms_norm(layer.input_layernorm, hidden)
        shape = (n, q, -1, attn.head_dim)
        names = tuple(pre + "self_attn." + p for p in ("q_proj", "k_proj", "v_proj"))
        query, key, value = (
            y.reshape(shape).transpose(1, 2)
            for y in linears(x, (attn.q_proj, attn.k_proj, attn.v_proj), names)
        )
        query = query * cos + _rotate_half(query) * sin
        key = key * cos + _rotate_half(key) * sin
        keys, values = update_kv(key, value, attn.layer_idx)
        if (
            attention is None
        ):  # the function transformers would call, so every shape dispatches as it does there
            out, _ = grouped_sdpa_attention(attn, query, keys, values, attention_mask, scaling=attn.scaling)
        else:
            out = attention(query, keys, values, attention_mask, attn.scaling).transpose(1, 2)
        hidden = hidden + linear(out.reshape(n, q, -1), attn.o_proj, pre + "self_attn.o_proj")
        x = _rms_norm(layer.post_attention_layernorm, hidden)
        gate, up = linears(x, (mlp.gate_proj, mlp.up_proj), (pre + "mlp.gate_proj", pre + "mlp.up_proj"))
        hidden = hidden + linear(mlp.act_fn(gate) * up, mlp.down_proj, pre + "mlp.down_proj")
        if i + 1 in wanted and i + 1 < num_layers:
            states[i + 1] = hidden
    hidden = _rms_norm(decoder.norm, hidden)
    states[num_layers] = hidden
    features = torch.stack([states[i] for i in feature_layers], dim=2) if feature_layers else None
    return hidden, features
