"""Decode and verify forwards of a Llama/Qwen2 model through compiled, bucketed graphs (``"compiled"``)."""

from __future__ import annotations

import torch
from torch import nn

from tlt_lightning import kernels
from tlt_lightning.models.compiled.config import CompileConfig
from tlt_lightning.models.compiled.forward import merged_groups, static_forward
from tlt_lightning.models.compiled.graphs import BucketedGraphs
from tlt_lightning.models.kv_cache import KVCache
from tlt_lightning.models.layout import PackedLinear, PackedWeight, packable_dtypes
from tlt_lightning.models.lean import check_lean_model

__all__ = ["CompiledDecode", "check_compiled_model", "few_rows_pay"]

FEW_DECODE_TOKENS = 8
"""Tokens (rows x queries) up to which a forward of several rows multiplies by ``few_rows_linear``: SmolLM2
in bf16 on a Zen 4 (``benchmarks.compiled_steps``, docs/benchmarks.md), 2 rows of one token 1.46x faster
than oneDNN's packed weights, 4-8 rows 1.03-1.08x, 2 rows of 3 tokens 1.07x; 4 rows of 3 were 0.81x."""


def few_rows_pay(rows: int, queries: int) -> bool:
    """Whether a compiled forward of ``rows`` x ``queries`` new tokens multiplies by
    :func:`~tlt_lightning.kernels.few_rows_linear` (where it is on) rather than oneDNN's packed weights:
    one row of up to :data:`~tlt_lightning.kernels.FEW_ROWS` tokens (a verify at batch 1), or a few rows of
    :data:`FEW_DECODE_TOKENS` tokens in all. One token alone multiplies by ``row_gemv`` where that is on.

    Example:
        >>> few_rows_pay(1, 16), few_rows_pay(2, 1), few_rows_pay(8, 1), few_rows_pay(4, 3)
        (True, True, True, False)
    """
    tokens = rows * queries
    return 1 <= tokens <= (kernels.FEW_ROWS if rows == 1 else FEW_DECODE_TOKENS)


def check_compiled_model(model: nn.Module) -> None:
    """Raise unless :class:`CompiledDecode` can trace ``model``: :func:`check_lean_model`, and every
    linear of its decoder a plain ``nn.Linear`` (or the ``"packed"`` layout's), not a wrapper (peft, QAT)."""
    check_lean_model(model)
    for name, module in model.get_decoder().named_modules():
        if isinstance(module, nn.Linear) and type(module) not in (nn.Linear, PackedLinear):
            raise TypeError(
                "decode='compiled' multiplies by the decoder's nn.Linear weights, "
                f"{name} is {type(module).__name__}; "
                "use decode='lean' for this model"
            )


class CompiledDecode(BucketedGraphs):
    """Decode and verify forwards of a Llama/Qwen2 model through compiled, bucketed graphs.

    :class:`~tlt_lightning.models.HFTarget` builds one for ``decode="compiled"``; its forward
    calls it and runs the eager lean forward whenever it returns ``None``.

    Args:
        model: a model accepted by :func:`check_compiled_model`.
        config: buckets and mode (default :class:`CompileConfig`).

    Example:
        >>> from tlt_lightning.models import load_model
        >>> model = load_model("tiny-llama").model  # doctest: +SKIP
        >>> decode = CompiledDecode(model, CompileConfig(batch_buckets=(2,)))  # doctest: +SKIP
        >>> sizes = dict(num_layers=4, max_batch=1, num_kv_heads=2, max_len=10, head_dim=16)
        >>> decode.new_cache(**sizes).keys.shape  # doctest: +SKIP
        torch.Size([4, 2, 2, 257, 16])
    """

    def __init__(self, model: nn.Module, config: CompileConfig | None = None) -> None:
        check_compiled_model(model)
        super().__init__(model, config, "decode='compiled'")
        self.model = model
        self._pack = (
            self.config.packed_weights and model.device.type == "cpu" and model.dtype in packable_dtypes()
        )
        self._gemv = self.config.row_gemv and model.device.type == "cpu" and model.dtype == torch.bfloat16
        self._matmul_attention = self.config.matmul_attention and model.device.type == "cpu"
        head_dim = model.get_decoder().layers[0].self_attn.head_dim
        self._cpp_attention = (
            self.config.cpp_attention
            and model.device.type == "cpu"
            and model.dtype == torch.bfloat16
            and head_dim in kernels.HEAD_DIMS
            and kernels.available()
        )
        self._few_rows = (
            self.config.few_rows_linear
            and model.device.type == "cpu"
            and model.dtype == torch.bfloat16
            and kernels.available()
        )
        linears = {n: m for n, m in model.get_decoder().named_modules() if isinstance(m, nn.Linear)}
        self._groups = [
            ("+".join(group), [linears[name] for name in group])  # keyed as static_forward reads them
            for group in merged_groups(linears, self.config.merged_projections)
        ]
        self._own_packs: dict[str, PackedWeight] = {}
        self.compile(static_forward)

    def _packed(self) -> dict[str, torch.Tensor] | None:
        if not self._pack:
            return None
        out = {}
        for name, modules in self._groups:
            packer = getattr(modules[0], "_packed_weight", None) if len(modules) == 1 else None
            if packer is None:  # else the "packed" layout's own copy: share it
                packer = self._own_packs.setdefault(name, PackedWeight())
            out[name] = packer.packed(*(m.weight for m in modules))
        return out

    def release_packed(self) -> int:
        """Drop the packed copies of the merged projections (:meth:`PackedWeight.release`); their bytes."""
        return sum(pack.release() for pack in self._own_packs.values())

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: KVCache,
        feature_layers: tuple[int, ...] = (),
        slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """:func:`~tlt_lightning.models.lean.lean_forward`'s result through the bucket's graph, or ``None``
        where the graphs do not apply (the caller runs the eager path). ``cache.begin_step`` was called."""
        p = self.pad(input_ids, positions, attention_mask, cache, slots, feature_layers)
        if p is None:
            return None
        bucket = p.bucket
        many_rows = self._matmul_attention and self.dynamic and p.n > 1 and not self._cpp_attention
        if many_rows and cache.keys.shape[3] <= self.config.all_slots_ratio * bucket.kv_len:
            bucket = bucket._replace(all_slots=True)
        gemv = self._gemv and p.input_ids.numel() == 1  # the graph multiplies by row_gemv: no packed weights
        if not gemv and self._few_rows and few_rows_pay(*p.input_ids.shape):
            bucket = bucket._replace(few_rows=True)
        hidden, features = self.launch(
            bucket,
            self.model,
            None if gemv or bucket.few_rows else self._packed(),  # few_rows_linear: the plain weights
            p.input_ids,
            p.positions,
            p.slots,
            p.mask,
            *self.layer_views(cache),
            bucket.feature_layers,
            self._gemv,
            self._matmul_attention,
            bucket.all_slots,
            self._cpp_attention,
            bucket.few_rows,
        )
        return self.unpad(hidden, p), self.unpad(features, p)
