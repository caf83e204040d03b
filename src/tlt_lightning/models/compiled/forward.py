"""What the compiled decode graphs trace: :func:`~tlt_lightning.models.lean.lean_decoder` over fixed buffers.

:func:`static_forward` is the lean decoder itself (one copy of the math), with the key/value store a
:class:`StaticKV` of the cache's per-layer buffers and the linears and attention chosen for the hardware
(:class:`~tlt_lightning.models.compiled.CompileConfig`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tlt_lightning import kernels
from tlt_lightning.models.attention import grouped_matmul_attention
from tlt_lightning.models.compiled.ops import packed_linear, row_gemv
from tlt_lightning.models.lean import lean_decoder

__all__ = ["StaticKV", "merged_groups", "static_forward"]


class StaticKV:
    """The key/value store of a traced forward: per-layer ``[B, H, S, D]`` buffers written at
    ``slots``, read to ``kv_len``.

    ``update`` has :meth:`KVCache.update`'s contract, for ``n`` padded rows (rows ``[0, n)`` of the buffers).
    The buffers are one tensor per layer (views of the cache's ``[L, B, H, S, D]``), each written
    once per forward: written through one ``[L, ...]`` input, Inductor copied the whole cache per layer,
    which made steps several times slower.
    """

    def __init__(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor, kv_len: int
    ) -> None:
        self.keys, self.values, self.slots, self.kv_len = keys, values, slots, kv_len
        self.rows = torch.arange(slots.shape[0], device=slots.device)[:, None]

    def begin_step(self, rows: int, positions: torch.Tensor) -> int:
        return self.kv_len  # the slots were fixed by the caller, padding included

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[n, H, q, D]`` new keys/values, return ``[n, H, kv_len, D]`` views of the buffers."""
        n, keys, values = self.rows.shape[0], self.keys[layer], self.values[layer]
        keys[self.rows, :, self.slots] = key.transpose(1, 2).to(keys.dtype)
        values[self.rows, :, self.slots] = value.transpose(1, 2).to(values.dtype)
        return keys[:n, :, : self.kv_len], values[:n, :, : self.kv_len]


_MERGED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def merged_groups(linears: dict[str, nn.Module], merge: bool = True) -> list[tuple[str, ...]]:
    """The decoder's linears (by name) grouped by the products that compute them: with ``merge``, each
    layer's q/k/v and gate/up projections where their biases are alike (all or none), every other alone.

    Example:
        >>> names = ["layers.0.self_attn." + p for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        >>> merged_groups({n: nn.Linear(4, 4, bias=False) for n in names})  # doctest: +NORMALIZE_WHITESPACE
        [('layers.0.self_attn.q_proj', 'layers.0.self_attn.k_proj', 'layers.0.self_attn.v_proj'),
         ('layers.0.self_attn.o_proj',)]
    """
    groups: list[tuple[str, ...]] = []
    for name in linears if merge else ():
        for parts in _MERGED:
            if name.endswith(parts[0]):
                group = tuple(name[: -len(parts[0])] + part for part in parts)
                if all(g in linears for g in group) and len({linears[g].bias is None for g in group}) == 1:
                    groups.append(group)
    merged = {name for group in groups for name in group}
    return groups + [(name,) for name in linears if name not in merged]


def static_forward(
    model: nn.Module,
    packed: dict[str, torch.Tensor] | None,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    feature_layers: tuple[int, ...],
    one_row_gemv: bool,
    matmul_attention: bool,
    all_slots: bool = False,
    cpp_attention: bool = False,
    few_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The traced function: :func:`lean_decoder` over a :class:`StaticKV`, linears multiplying by
    ``packed`` (keyed by name, projections of one input by their merged copy, keyed
    ``"+".join(names)``, where there is one; or, with ``one_row_gemv`` and a single row of one token,
    by :func:`row_gemv`); with ``matmul_attention`` and several rows, attending by
    :func:`grouped_matmul_attention`, over every cache slot if ``all_slots`` (the slots past ``mask``
    masked out; they hold zeros or earlier keys, finite either way); with ``cpp_attention``,
    attending by :func:`~tlt_lightning.kernels.decode_attention` instead; with ``few_rows`` (and not
    ``row_gemv``), multiplying by :func:`~tlt_lightning.kernels.few_rows_linear`."""
    gemv = one_row_gemv and input_ids.numel() == 1
    few = few_rows and not gemv
    attention = grouped_matmul_attention if matmul_attention and input_ids.shape[0] > 1 else None
    attention = kernels.decode_attention if cpp_attention else attention
    if all_slots:
        mask = F.pad(mask, (0, keys[0].shape[2] - mask.shape[-1]))

    def linear(x: torch.Tensor, module: nn.Module, name: str) -> torch.Tensor:
        if gemv:
            return row_gemv(x, module.weight, module.bias)
        if few:
            return kernels.few_rows_linear(x, module.weight, module.bias)
        if packed is None:
            return F.linear(x, module.weight, module.bias)
        return packed_linear(x, packed[name], module.bias, module.out_features)

    def linears(
        x: torch.Tensor, modules: tuple[nn.Module, ...], names: tuple[str, ...]
    ) -> list[torch.Tensor]:
        key = "+".join(names)
        if gemv or few or packed is None or key not in packed:
            return [linear(x, module, name) for module, name in zip(modules, names)]
        bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
        sizes = [m.out_features for m in modules]
        return list(packed_linear(x, packed[key], bias, sum(sizes)).split(sizes, -1))

    store = StaticKV(keys, values, slots, kv_len=mask.shape[-1])
    return lean_decoder(
        model, input_ids, positions, mask, store.update, feature_layers, linear, attention, linears
    )
