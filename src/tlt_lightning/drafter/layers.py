"""Building blocks of the drafter: attention over a caller-built mask, the EAGLE-1 and EAGLE-3 layers.

Rotary embedding, MLP and RMSNorm are transformers' own classes for the target's architecture,
so the drafter layer computes exactly what a target layer of the same shape would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from tlt_lightning.drafter.config import SUPPORTED_MODEL_TYPES, DrafterConfig
from tlt_lightning.models.attention import grouped_sdpa

__all__ = ["ARCH", "Arch", "AttentionCache", "DrafterAttention", "Eagle1Layer", "Eagle3Layer", "hf_config"]


class Arch(NamedTuple):
    """transformers' classes for one target architecture."""

    config: type
    rotary: type[nn.Module]
    mlp: type[nn.Module]
    norm: type[nn.Module]
    rotate: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # apply_rotary_pos_emb


ARCH: dict[str, Arch] = {
    "llama": Arch(
        LlamaConfig,
        modeling_llama.LlamaRotaryEmbedding,
        modeling_llama.LlamaMLP,
        modeling_llama.LlamaRMSNorm,
        modeling_llama.apply_rotary_pos_emb,
    ),
    "qwen2": Arch(
        Qwen2Config,
        modeling_qwen2.Qwen2RotaryEmbedding,
        modeling_qwen2.Qwen2MLP,
        modeling_qwen2.Qwen2RMSNorm,
        modeling_qwen2.apply_rotary_pos_emb,
    ),
}
assert set(ARCH) == set(SUPPORTED_MODEL_TYPES)


class AttentionCache(Protocol):
    """What the drafter's attention writes keys/values into (:class:`KVCache` and training caches)."""

    def begin_step(self, rows: int, positions: torch.Tensor) -> int: ...

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def hf_config(config: DrafterConfig) -> Any:
    """An HF config of the target's architecture sized like the drafter (for rotary, MLP)."""
    cls = ARCH[config.model_type].config
    return cls(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act=config.hidden_act,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=dict(config.rope_parameters),
        max_position_embeddings=config.max_position_embeddings,
    )


class DrafterAttention(nn.Module):
    """Grouped-query attention with RoPE and a caller-built bool mask; ``in_features`` is H or 2H."""

    def __init__(self, config: DrafterConfig, in_features: int) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_proj = nn.Linear(in_features, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(in_features, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(in_features, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.o_proj_bias)
        self._rotate = ARCH[c.model_type].rotate

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        cache: AttentionCache | None,
    ) -> torch.Tensor:
        n, q, _ = x.shape
        query = self.q_proj(x).view(n, q, self.num_heads, self.head_dim).transpose(1, 2)
        key = self.k_proj(x).view(n, q, self.num_kv_heads, self.head_dim).transpose(1, 2)
        value = self.v_proj(x).view(n, q, self.num_kv_heads, self.head_dim).transpose(1, 2)
        query, key = self._rotate(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, 0)
            key, value = key.to(query.dtype), value.to(query.dtype)
        if torch.is_grad_enabled():  # training: fp32 backward is 2x slower grouped (8 x 256 tokens)
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
        else:  # drafting: one kernel block per key/value head (bf16, 1 query: ~5x faster)
            out = grouped_sdpa(query, key, value, mask)
        return self.o_proj(out.transpose(1, 2).reshape(n, q, -1))


class Eagle1Layer(nn.Module):
    """A Llama decoder layer without ``input_layernorm`` (EAGLE-1 / vLLM skip it for layer 0)."""

    def __init__(self, config: DrafterConfig, hf_config: Any) -> None:
        super().__init__()
        arch = ARCH[config.model_type]
        self.self_attn = DrafterAttention(config, config.hidden_size)
        self.post_attention_layernorm = arch.norm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = arch.mlp(hf_config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        cache: AttentionCache | None,
    ) -> torch.Tensor:
        h = x + self.self_attn(x, cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Layer(nn.Module):
    """EAGLE-3's midlayer: attention over ``[input_layernorm(embed), hidden_norm(g)]`` (2H),
    residual ``g``."""

    def __init__(self, config: DrafterConfig, hf_config: Any) -> None:
        super().__init__()
        arch = ARCH[config.model_type]
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = arch.norm(H, eps=eps)
        self.hidden_norm = arch.norm(H, eps=eps)
        self.self_attn = DrafterAttention(config, 2 * H)
        self.post_attention_layernorm = arch.norm(H, eps=eps)
        self.mlp = arch.mlp(hf_config)

    def forward(
        self,
        embeds: torch.Tensor,
        g: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        cache: AttentionCache | None,
    ) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(g)], dim=-1)
        h = g + self.self_attn(x, cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))
