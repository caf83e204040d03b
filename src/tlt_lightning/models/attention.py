"""Grouped-query attention that runs each key/value head once: the fast layout for decoding on CPUs.

PyTorch's CPU flash-attention kernel (bf16) spends most of a call with few queries on work per
``(row, head)`` block that does not depend on how many queries the block holds (measured: a block
of 7 queries costs about what a block of 1 does). With grouped-query attention (SmolLM2: 9 query
heads over 3 key/value heads) both ways torch and transformers feed it several new tokens against
a cache, ``enable_gqa=True`` and ``repeat_kv``, give it one block per *query* head (and
``repeat_kv`` first copies the cache). Folding the query heads of a group into the
query axis (``[n, H_q, q, D] -> [n, H_kv, g * q, D]``) gives the kernel one block per key/value head
instead. It is the same attention, with the same kernel: outputs equal ``enable_gqa`` bit for bit on
these shapes in bf16 (up to ~1e-6 in fp32, where the kernel splits blocks differently).
transformers already does this for a single query (``pack_gqa``), not for several.

Measured per call (a one-off script, ``scripts/attention_small_q.py`` in git history; one AMD Zen 4
core, bf16, SmolLM2's heads, 600 cached positions; ``enable_gqa`` / ``repeat_kv`` / grouped,
microseconds): 1 row x 7 queries (a chain-6 verify) 446 / 547 / 313; 4 rows x 7 queries
2054 / 1849 / 1144; 8 rows x 7 queries 3299 / 11515 / 2397; 1 row x 1 query (a drafter step, which
used ``enable_gqa``) 824 / 910 / 172.

:func:`grouped_sdpa` is the pure function; :func:`grouped_sdpa_attention` wraps it as a
transformers attention function (``AttentionInterface``), registered as :data:`GROUPED_SDPA` by
:func:`use_grouped_attention`. It takes the grouped path only where it is the same computation,
without autograd (decoding, verifying drafts) and with a boolean mask (in bf16 on a CPU the C++
kernel :func:`~tlt_lightning.kernels.decode_attention` instead, for prefills too), and hands
everything else to transformers' own ``sdpa`` function unchanged, so training is untouched.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tlt_lightning import kernels

__all__ = [
    "GROUPED_SDPA",
    "MAX_GROUPED_QUERIES",
    "grouped_matmul_attention",
    "grouped_sdpa",
    "grouped_sdpa_attention",
    "use_grouped_attention",
]

GROUPED_SDPA = "tlt_grouped_sdpa"
MAX_GROUPED_QUERIES = 64
"""Most new tokens per row that :func:`grouped_sdpa_attention` groups (every draft tree fits): the
grouped mask is ``g`` times the caller's, and long prefills gain little (their blocks are full)."""


def grouped_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with the query heads of each key/value head folded together.

    Query head ``h`` reads key/value head ``h // g`` (``g = H_q / H_kv``), as ``repeat_kv`` and
    ``enable_gqa`` define it.

    Args:
        query: ``[n, H_q, q, D]``.
        key, value: ``[n, H_kv, kv, D]``, ``H_q`` a multiple of ``H_kv``.
        mask: ``[n, 1, q, kv]`` bool, True where a query may attend a key (shared by all heads);
            every query must see at least one key.
        scale: softmax scale (default ``D ** -0.5``).

    Returns:
        ``[n, H_q, q, D]``, equal to ``F.scaled_dot_product_attention(..., enable_gqa=True)``.

    Example:
        >>> q, kv = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8)
        >>> mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
        >>> expected = F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)
        >>> torch.allclose(grouped_sdpa(q, kv, kv, mask), expected, atol=1e-6)
        True
    """
    grouped_query, mask = _grouped(query, key, mask)
    out = F.scaled_dot_product_attention(grouped_query, key, value, attn_mask=mask, scale=scale)
    return out.reshape(query.shape)  # a view on a CPU; CUDA kernels may return other strides


def _grouped(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, H_q, q, D]`` queries as ``[n, H_kv, g * q, D]`` (row ``j * q + t``: head ``kv_head * g + j``,
    query ``t``) and the ``[n, 1, q, kv]`` mask repeated to match; checks the shapes."""
    n, heads, q, dim = query.shape
    kv_heads, kv = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    if mask.shape != (n, 1, q, kv):
        raise ValueError(f"mask must be [n, 1, q, kv] = {[n, 1, q, kv]}, got {list(mask.shape)}")
    g = heads // kv_heads
    if q > 1 and g > 1:
        mask = mask[:, :, None].expand(n, 1, g, q, kv).reshape(n, 1, g * q, kv)
    return query.reshape(n, kv_heads, g * q, dim), mask


def grouped_matmul_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`grouped_sdpa`'s attention as two batched products and a softmax, as transformers' eager
    attention computes it: scores and softmax in fp32, probabilities cast to the input dtype.

    For decoding several rows on a CPU inside a compiled graph, where Inductor fuses the mask and
    softmax; the flash kernel spends most of a call with few queries on fixed work per block. Whole
    compiled steps of SmolLM2 (bf16, one AMD Zen 5 core, ``benchmarks/compiled_steps.py``): 8 rows over
    200 keys 23.4 -> 22.8 ms, 32 rows 58.0 -> 54.1 ms, 8 rows of 4 queries over 250 keys 41.0 -> 40.0 ms;
    more where it reads whole cache rows
    (:attr:`~tlt_lightning.models.compiled.CompileConfig.all_slots_ratio`).
    Arguments and return as :func:`grouped_sdpa`'s.
    """
    grouped_query, mask = _grouped(query, key, mask)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (grouped_query @ key.transpose(-1, -2)).float() * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(value.dtype)
    return (probs @ value).reshape(query.shape)


_CPP_MAX_SCORES = 1 << 24
"""Most scores (a key/value head's query heads x new tokens x keys) the C++ kernel holds per task:
64 MB of fp32 scratch per thread. Longer prefills keep transformers' ``sdpa``."""


def _cpp_applies(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether :func:`~tlt_lightning.kernels.decode_attention` takes this eager attention: bf16 on a CPU,
    a head dim it has vector code for, at most :data:`_CPP_MAX_SCORES` scores a task, and the kernel built."""
    g = query.shape[1] // key.shape[1]
    return (
        query.device.type == "cpu"
        and query.dtype == torch.bfloat16
        and query.shape[-1] in kernels.HEAD_DIMS
        and g * query.shape[2] * key.shape[2] <= _CPP_MAX_SCORES
        and not torch.compiler.is_compiling()
        and kernels.available()
    )


def grouped_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function for inference over a boolean mask: in bf16 on a CPU, the C++
    kernel :func:`~tlt_lightning.kernels.decode_attention` (any number of queries: decoding, verifying,
    prefilling; 2.2x ``sdpa`` on a prefill of 32 prompts of 146 tokens, SmolLM2's heads, one Zen 5
    core); otherwise :func:`grouped_sdpa` for 2 to :data:`MAX_GROUPED_QUERIES` queries per row (1 too
    inside a ``torch.compile`` trace, where transformers does not pack a single query). Everything else
    (training, no mask, biases, other dtypes) goes to transformers' ``sdpa``. Graphs compiled by
    :mod:`~tlt_lightning.models.compiled` choose their attention by their own config.

    Returns ``[n, q, H_q, D]`` and no attention weights, as transformers' ``sdpa`` does.
    """
    inference = (
        attention_mask is not None
        and attention_mask.dtype == torch.bool
        and attention_mask.shape[1] == 1
        and not torch.is_grad_enabled()
        and not dropout
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
    )
    if inference and _cpp_applies(query, key):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return kernels.decode_attention(query, key, value, attention_mask, scale).transpose(
            1, 2
        ).contiguous(), None
    grouped = (
        inference
        and getattr(module, "num_key_value_groups", 1) > 1
        # transformers packs a single query itself, but not in a traced graph (models.compiled)
        and (1 < query.shape[2] or torch.compiler.is_compiling())
        and query.shape[2] <= MAX_GROUPED_QUERIES
    )
    if not grouped:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = grouped_sdpa(query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    """Make :data:`GROUPED_SDPA` known to transformers (and build its masks as ``sdpa``'s)."""
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


# At import, so that a model switched in one process also runs in another that unpickles it
# (e.g. Lightning's ddp_spawn) as soon as tlt_lightning.models is imported there.
_register()


def use_grouped_attention(model: nn.Module) -> bool:
    """Switch a transformers model from ``sdpa`` to :data:`GROUPED_SDPA`; other implementations are kept.

    Returns whether the model now uses it. A process that unpickles a switched model needs
    ``tlt_lightning.models`` imported (it registers the name); ``model.set_attn_implementation("sdpa")``
    switches back.
    """
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", GROUPED_SDPA):
        return False
    if config._attn_implementation != GROUPED_SDPA:
        model.set_attn_implementation(GROUPED_SDPA)
    return config._attn_implementation == GROUPED_SDPA
