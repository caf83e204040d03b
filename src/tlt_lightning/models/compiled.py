"""A compiled decode path: the lean forward through ``torch.compile``, over shape buckets (gpt-fast style).

:func:`~tlt_lightning.models.lean.lean_decoder` is traced as it is (one copy of the math) with a
key/value store of fixed buffers. A forward of ``n`` rows of ``q`` new tokens over ``kv_len`` key
slots pads its queries to the smallest query bucket ``>= q`` (:class:`CompileConfig`), and then:

- **dynamic graphs** (the default, except for CUDA graphs): rows and key slots are dynamic
  dimensions, so one graph per query bucket serves every batch size and length (plus one for a
  single row, which ``torch.compile`` specialises), rows are not padded and attention reads exactly
  the cached keys (all of the cache's slots where that is cheaper: :attr:`CompileConfig.all_slots_ratio`).
  Measured side by side on SmolLM2 (bf16, one AMD Zen 5 core, ``benchmarks/compiled_steps.py``,
  ``docs/results/compiled_steps_zen5.json``), static against dynamic graphs with the CPU defaults:
  48 rows over 300 keys 238 against 81 ms (the static bucket: 64 rows, 512 keys), 32 rows over 280
  keys 94.6 against 50.4 ms, over 200 keys 64.0 against 49.1 ms, 8 rows of 4 queries 40.5 against 37.2.
- **static graphs** (CUDA graphs, which replay fixed shapes): rows pad to the smallest batch bucket
  ``>= n`` and ``kv_len`` rounds up to a multiple of ``kv_step``; one graph per bucket.

Graphs compile lazily, on their first call, and are reused for every step that falls in them; any
call that compiles is timed and logged (:attr:`BucketedGraphs.compile_times`), so benchmarks report
compile time apart from decoding, and a recompile would show there too.

Padding never touches a sequence: padded rows and padded queries write their keys and values into a
spare slot past ``max_len`` (:meth:`CompiledDecode.new_cache` allocates it), real queries see the
padded key slots masked out, and padded queries attend slot 0 so they stay finite.

On a CPU the linears multiply by oneDNN-packed copies of the weights (:class:`PackedWeight`, what
the ``"packed"`` layout uses) through :func:`packed_linear`, an op Inductor keeps as it is; the packed
copies are graph *inputs*, remade when a weight changes in place (an RL update), so graphs never
freeze weights. Measured (``benchmarks/decode_paths.py``): compiling pays on a CPU only with packed
weights. One exception: in bf16 a graph of one row of one token (batch-1 decode) multiplies by the
plain weights as an Inductor reduction (:func:`row_gemv`), which streams them faster than oneDNN's
bf16 product for one row on the Zen 4 measured (that product is a matrix-vector one there,
memory-bound). In bf16 on a CPU the graphs attend by a C++ kernel of ours
(:func:`tlt_lightning.kernels.decode_attention`, built on first use), which reads each key/value head of
the cache once, in place, for all the query heads and tokens it serves; where it does not build, by
PyTorch's flash kernel (one row) or batched products (:attr:`CompileConfig.matmul_attention`). On CUDA
the default mode is ``"reduce-overhead"`` (CUDA graphs per bucket), the cache buffers are marked static,
and outputs are copied out of the graph's memory.

Calls the graphs do not take run on the eager lean forward instead: prefill (rows with nothing
cached: ``kv_len <= q``), autograd, a shape outside every bucket, or a cache without the spare slot;
the last three log one warning per kind and shape.

Numerics: the same contract as the other paths. fp32 greedy outputs equal transformers' token for
token (tests on tiny Llama and Qwen2, SmolLM2 in a slow test). Inductor fuses the element-wise ops and
padding changes the row count of the matrix products, so hidden states differ from the eager path by
rounding: documented tolerance (tested), the largest difference relative to the largest hidden value,
``1e-5`` in fp32 (measured ~1.5e-6) and ``5e-2`` in bf16 (measured ~2-3e-2: a few bf16 ulps). bf16
greedy outputs can part after a near-tie, as between any two bf16 kernels.
"""

from __future__ import annotations

import logging
import time
import types
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from tlt_lightning import kernels
from tlt_lightning.models.attention import grouped_matmul_attention
from tlt_lightning.models.kv_cache import KVCache
from tlt_lightning.models.layout import PackedLinear, PackedWeight, packable_dtypes
from tlt_lightning.models.lean import MAX_LEAN_QUERIES, check_lean_model, lean_decoder

__all__ = [
    "COMPILE_MODES",
    "Bucket",
    "BucketedGraphs",
    "CompileConfig",
    "CompiledDecode",
    "Padded",
    "StaticKV",
    "check_compiled_model",
    "merged_groups",
    "packed_linear",
    "row_gemv",
]

log = logging.getLogger(__name__)

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_RECOMPILE_LIMIT = 4096  # one graph per bucket is the design, not a recompile storm


# A library op, not ``torch.library.custom_op``: one kernel for every backend (packed weights are
# MkldnnCPU tensors), no autograd (the graphs run without it), and ~2.5 us less dispatch per call
# (29 against 31.5 us for one 8-row 576x576 product, one Zen 5 core): 0.5 ms of a step of 210 products.
_LIBRARY = torch.library.Library("tlt_lightning", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")
_LIBRARY.impl("packed_linear",
              lambda x, packed, bias, out_features: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""),
              "CompositeExplicitAutograd")


@torch.library.register_fake("tlt_lightning::packed_linear")
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` oneDNN-packed (:meth:`PackedWeight.packed`); ``[..., in] -> [..., out]``.

    An op of its own (``torch.ops.tlt_lightning.packed_linear``), so Inductor calls oneDNN as it is (its
    own lowering of packed linears wants frozen weights).
    """
    return torch.ops.tlt_lightning.packed_linear(x, packed, bias, out_features)


def row_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for one row as a product and a sum, which Inductor compiles to one vectorised
    reduction that streams ``weight`` once; ``[1, 1, in] -> [1, 1, out]``, accumulated in fp32.

    For many rows it would read the weight once per row: only graphs of one row use it.
    """
    out = (x.float().unsqueeze(-2) * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _ascending(name: str, sizes: tuple[int, ...], most: int | None = None) -> None:
    if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes) or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"{name} must be a non-empty, strictly increasing tuple of positive ints, got {sizes!r}")
    if most is not None and sizes[-1] > most:
        raise ValueError(f"{name} must not exceed {most} (the lean path's most queries per row), got {sizes!r}")


@dataclass(frozen=True)
class CompileConfig:
    """Shape buckets and mode of :class:`CompiledDecode`.

    Attributes:
        batch_buckets: row counts static graphs are compiled for (``n`` rows run in the smallest bucket
            ``>= n``); dynamic graphs take up to the largest.
        query_buckets: new tokens per row (1: decode, ``K + 1``: a chain of ``K`` drafts, tree nodes);
            at most :data:`~tlt_lightning.models.lean.MAX_LEAN_QUERIES`.
        kv_step: key slots attention reads in static graphs, rounded up to a multiple of this (the rest masked).
        mode: ``torch.compile`` mode (:data:`COMPILE_MODES`); ``None``: ``"reduce-overhead"`` (CUDA
            graphs) on CUDA, ``"default"`` elsewhere.
        packed_weights: on a CPU, multiply by oneDNN-packed weights passed as graph inputs (without
            them compiling does not pay on a CPU; no effect elsewhere or for dtypes oneDNN cannot pack).
        row_gemv: on a CPU in bf16, graphs of one row of one token (batch-1 decode) multiply by the
            plain weights as an Inductor reduction (:func:`row_gemv`) instead of oneDNN: it streams the
            weights faster (measured 1.5x on the linears of a SmolLM2 step, Zen 4).
        matmul_attention: on a CPU, graphs of several rows attend by two batched products
            (:func:`~tlt_lightning.models.attention.grouped_matmul_attention`) instead of the flash
            kernel: 1.03-1.07x faster whole steps of 8-32 rows of SmolLM2 on a Zen 5 (one row keeps
            the kernel).
        all_slots_ratio: with ``matmul_attention``, dynamic graphs read all of the cache's ``S`` slots
            (the unused ones masked) when ``S`` is at most this many times the ``kv_len`` keys a forward
            needs (0: never). On a CPU ``torch.bmm`` copies a batch of ``kv_len``-slot slices of the
            cache before multiplying (read, write, read again), while all slots are one contiguous
            block per row (``benchmarks/compiled_steps.py``).
        merged_projections: with ``packed_weights``, each layer's q/k/v projections are one product, and
            its gate and up projections another, by a packed copy of their stacked weights (where their
            biases are alike): 7 products a layer become 4, 1.2x faster linears at 8 and 32 rows of
            SmolLM2 (9.05 against 7.35 ms and 16.4 against 14.7 ms for those of 30 layers, one Zen 5 core).
            It costs memory: with the ``"packed"`` layout, whose per-linear copies the eager prefill
            multiplies by, a second packed copy of those weights (+139 MB for SmolLM2 in bf16).
        cpp_attention: on a CPU in bf16 (head dims 64 and 128), every graph attends by the C++ kernel
            :func:`tlt_lightning.kernels.decode_attention` (built on first use; where it does not build,
            as ``matmul_attention`` says). Whole SmolLM2 steps against the batched products over all slots,
            one Zen 5 core: 1.12x at one row, 1.26x at 8 rows, 1.39x at 32 over 280 keys, 1.18x for 4 rows
            of 4 queries (``benchmarks/compiled_steps.py``).
        dynamic: rows and key slots as dynamic dimensions of the graphs: one graph per query bucket
            (and one for a single row), no padded rows, attention reads exactly the cached keys.
            ``None``: on unless the graphs are CUDA graphs (they need static shapes).
        skip_guards: once a graph has compiled, call it without dynamo's guards (as vLLM does), where
            the graphs are not CUDA graphs. What they check is fixed by the graph's key (bucket, weights'
            kind, thread count, inference and autocast modes, the inputs' dtypes and shapes) and by
            :meth:`BucketedGraphs.pad` (contiguous inputs, cache views of one buffer); Inductor still
            asserts every input's sizes and strides. For dynamic graphs the guards are a Python function
            of ~4000 symbolic checks on the cache views: whole SmolLM2 steps 1.06x faster without them at
            one row (9.2 against 8.7 ms, one Zen 5 core), 1.04-1.07x at 8 and 32 rows.

    Example:
        >>> CompileConfig(batch_buckets=(1, 8), query_buckets=(1, 4)).kv_step
        256
    """

    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    query_buckets: tuple[int, ...] = (1, 2, 4, 8, 16)
    kv_step: int = 256
    mode: str | None = None
    packed_weights: bool = True
    row_gemv: bool = True
    matmul_attention: bool = True
    all_slots_ratio: float = 2.0
    merged_projections: bool = True
    cpp_attention: bool = True
    dynamic: bool | None = None
    skip_guards: bool = True

    def __post_init__(self) -> None:
        _ascending("batch_buckets", self.batch_buckets)
        _ascending("query_buckets", self.query_buckets, MAX_LEAN_QUERIES)
        if not self.all_slots_ratio >= 0:
            raise ValueError(f"all_slots_ratio must be >= 0 (0: never read all slots), "
                             f"got {self.all_slots_ratio!r}")
        if not isinstance(self.kv_step, int) or self.kv_step < 1:
            raise ValueError(f"kv_step must be a positive int, got {self.kv_step!r}")
        if self.mode is not None and self.mode not in COMPILE_MODES:
            raise ValueError(f"mode must be None or one of {COMPILE_MODES}, got {self.mode!r}")


class Bucket(NamedTuple):
    """The shape a forward runs at: padded rows, queries per row, key slots; requested features; whether
    attention reads all the cache's slots (:attr:`CompileConfig.all_slots_ratio`).

    As a key of :attr:`BucketedGraphs.compile_times` (one compiled graph), a ``batch`` or ``kv_len`` of 0
    is a dynamic dimension: any."""

    batch: int
    queries: int
    kv_len: int
    feature_layers: tuple[int, ...]
    all_slots: bool = False


def _bucket(sizes: tuple[int, ...], value: int) -> int | None:
    return next((s for s in sizes if s >= value), None)


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def check_compiled_model(model: nn.Module) -> None:
    """Raise unless :class:`CompiledDecode` can trace ``model``: :func:`check_lean_model`, and every
    linear of its decoder a plain ``nn.Linear`` (or the ``"packed"`` layout's), not a wrapper (peft, QAT)."""
    check_lean_model(model)
    for name, module in model.get_decoder().named_modules():
        if isinstance(module, nn.Linear) and type(module) not in (nn.Linear, PackedLinear):
            raise TypeError(
                f"decode='compiled' multiplies by the decoder's nn.Linear weights, {name} is {type(module).__name__}; "
                "use decode='lean' for this model"
            )


class StaticKV:
    """The key/value store of a traced forward: per-layer ``[B, H, S, D]`` buffers written at ``slots``, read to ``kv_len``.

    ``update`` has :meth:`KVCache.update`'s contract, for ``n`` padded rows (rows ``[0, n)`` of the buffers).
    The buffers are one tensor per layer (views of the cache's ``[L, B, H, S, D]``), each written
    once per forward: written through one ``[L, ...]`` input, Inductor copied the whole cache per layer
    (measured: 4x slower steps at batch 8).
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor, kv_len: int) -> None:
        self.keys, self.values, self.slots, self.kv_len = keys, values, slots, kv_len
        self.rows = torch.arange(slots.shape[0], device=slots.device)[:, None]

    def begin_step(self, rows: int, positions: torch.Tensor) -> int:
        return self.kv_len  # the slots were fixed by the caller, padding included

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int, *args: object, **kwargs: object
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


def _static_forward(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The traced function: :func:`lean_decoder` over a :class:`StaticKV`, linears multiplying by ``packed``
    (keyed by name, projections of one input by their merged copy, keyed ``"+".join(names)``, where there is
    one; or, with ``one_row_gemv`` and a single row of one token, by :func:`row_gemv`); with ``matmul_attention``
    and several rows, attending by :func:`grouped_matmul_attention`, over every cache slot if ``all_slots``
    (the slots past ``mask`` masked out; they hold zeros or earlier keys, finite either way); with
    ``cpp_attention``, attending by :func:`~tlt_lightning.kernels.decode_attention` instead."""
    gemv = one_row_gemv and input_ids.numel() == 1
    attention = grouped_matmul_attention if matmul_attention and input_ids.shape[0] > 1 else None
    attention = kernels.decode_attention if cpp_attention else attention
    if all_slots:
        mask = F.pad(mask, (0, keys[0].shape[2] - mask.shape[-1]))

    def linear(x: torch.Tensor, module: nn.Module, name: str) -> torch.Tensor:
        if gemv:
            return row_gemv(x, module.weight, module.bias)
        if packed is None:
            return F.linear(x, module.weight, module.bias)
        return packed_linear(x, packed[name], module.bias, module.out_features)

    def linears(x: torch.Tensor, modules: tuple[nn.Module, ...], names: tuple[str, ...]) -> list[torch.Tensor]:
        key = "+".join(names)
        if gemv or packed is None or key not in packed:
            return [linear(x, module, name) for module, name in zip(modules, names)]
        bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
        sizes = [m.out_features for m in modules]
        return list(packed_linear(x, packed[key], bias, sum(sizes)).split(sizes, -1))

    store = StaticKV(keys, values, slots, kv_len=mask.shape[-1])
    return lean_decoder(model, input_ids, positions, mask, store.update, feature_layers, linear, attention, linears)


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` under a code object of its own. ``torch.compile`` keeps graphs per code object, and
    :meth:`BucketedGraphs.compile`'s graphs skip the guards on the model's modules: another model of the
    same shapes (another bias, norm epsilon) or another config (a static graph, a dynamic one) must never
    reach them."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class Padded(NamedTuple):
    """A forward's inputs padded to its bucket (``[B, Q]``, ``[B, 1, Q, K]``), and its true ``n, q``."""

    bucket: Bucket
    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    n: int
    q: int


class BucketedGraphs:
    """What every compiled step shares: buckets, caches with room for padding, padding, timing, fallback warnings.

    Subclasses compile their traced function with :meth:`compile` and call :meth:`pad` then :meth:`launch`.

    Args:
        module: the model the graphs run (its first parameter's device is where they run).
        config: buckets and mode (default :class:`CompileConfig`).
        what: the name warnings and logs give the step (``"decode='compiled'"``).

    Attributes:
        compile_times: per graph (:meth:`graph`), seconds of the calls that compiled it (tracing,
            compiling, one run); none where ``torch.compile`` reused a graph it had already compiled.
        graph_calls: per graph, the forwards that ran in it.
    """

    def __init__(self, module: nn.Module, config: CompileConfig | None, what: str) -> None:
        self.config, self.what = config or CompileConfig(), what
        self._module = module
        self._first_linear = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
        self._traced: Callable[..., Any] | None = None
        self._options: dict[str, Any] = {}
        self._guarded: dict[tuple, tuple[Callable[..., Any], Callable[..., Any]]] = {}  # per graph key: a copy
        # of the traced function under its own code object, and that copy through torch.compile
        self._direct: dict[tuple, Callable[..., Any]] = {}  # per graph key: its compiled bytecode, no guards
        self._built_for: tuple = ()
        device = next(module.parameters()).device
        self._device_type = device.type
        self.mode = self.config.mode or ("reduce-overhead" if device.type == "cuda" else "default")
        self._cudagraphs = device.type == "cuda" and "cudagraphs" not in self.mode and self.mode != "default"
        self.dynamic = not self._cudagraphs if self.config.dynamic is None else self.config.dynamic
        self._warned: set[tuple] = set()
        self._views: tuple[weakref.ref, list[torch.Tensor], list[torch.Tensor]] | None = None
        self.compile_times: dict[Bucket, float] = {}
        self.graph_calls: Counter[Bucket] = Counter()

    def compile(self, fn: Callable[..., Any]) -> None:
        """Compile ``fn`` (the traced function :meth:`launch` calls): each graph key (:meth:`_key`) gets
        its own code object (:func:`_own_code`), so it holds one compiled graph, which with
        ``config.skip_guards`` later calls run directly (:meth:`launch`).

        Its graphs skip dynamo's guards on the model's modules (``skip_guard_on_all_nn_modules_unsafe``):
        they cost ~0.7 ms a call (one Zen 5 core, SmolLM2: 9.96 against 9.22 ms per batch-1 forward), and
        what they check cannot change under these graphs but the weights' dtype, device and layout
        (:mod:`~tlt_lightning.models.layout`), which :meth:`launch` checks itself. Weights updated in
        place, or replaced by tensors of the same kind, are read afresh every call."""
        self._options = {**torch._inductor.list_mode_options(self.mode, dynamic=False),
                         "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        self._traced, self._built_for = fn, self._weights_kind()
        self._guarded.clear()
        self._direct.clear()

    def _weights_kind(self) -> tuple:
        """Dtype, device and strides of the model's first parameter and first linear's weight, read afresh."""
        weights = [next(self._module.parameters())]
        if self._first_linear is not None:
            weights.append(self._first_linear.weight)
        return tuple((w.dtype, w.device, w.stride()) for w in weights)

    @property
    def compile_seconds(self) -> float:
        """Total seconds spent compiling (first calls of every bucket so far)."""
        return float(sum(self.compile_times.values()))

    def new_cache(
        self, num_layers: int, max_batch: int, num_kv_heads: int, max_len: int, head_dim: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> KVCache:
        """A :class:`KVCache` with room for the padding: the spare slot padded queries write to and, for
        static graphs, rows rounded up to a batch bucket and key slots to a multiple of ``kv_step``."""
        if self.dynamic:  # at least two rows: graphs take any count above one (torch.compile specialises one)
            rows, spare = max(max_batch, 2), 1
        else:
            rows = _bucket(self.config.batch_buckets, max_batch) or max_batch
            spare = _round_up(max_len, self.config.kv_step) - max_len + 1
        cache = KVCache(num_layers, rows, num_kv_heads, max_len, head_dim, dtype, device, spare_slots=spare)
        return cache

    def layer_views(self, cache: KVCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The cache's per-layer ``[B, kv_heads, S, D]`` key and value views, the same tensors every step.

        CUDA graphs write them in place, so their addresses must be static: they are marked so once per
        cache (views made afresh each step would be new inputs, and the graphs would be skipped). For
        dynamic graphs their rows and slots are marked dynamic: caches of any size share the graphs."""
        if self._views is None or self._views[0]() is not cache.keys:
            keys, values = list(cache.keys.unbind(0)), list(cache.values.unbind(0))
            for view in keys + values:
                if self._cudagraphs:
                    torch._dynamo.mark_static_address(view)
                if self.dynamic and view.shape[0] > 1:
                    torch._dynamo.mark_dynamic(view, 0)
                    torch._dynamo.mark_dynamic(view, 2)
            self._views = (weakref.ref(cache.keys), keys, values)
        return self._views[1], self._views[2]

    def bucket(self, n: int, q: int, kv_len: int, feature_layers: tuple[int, ...] = ()) -> Bucket | None:
        """The shape a forward of ``n`` rows, ``q`` new tokens each, over ``kv_len`` key slots runs at (or ``None``).

        Static graphs: rows up to a batch bucket, keys to a multiple of ``kv_step``. Dynamic ones: rows
        and keys as they are (``n`` within the largest batch bucket)."""
        c = self.config
        batch, queries = _bucket(c.batch_buckets, n), _bucket(c.query_buckets, q)
        if batch is None or queries is None:
            return None
        if self.dynamic:
            return Bucket(n, queries, kv_len, tuple(feature_layers))
        return Bucket(batch, queries, _round_up(kv_len, c.kv_step), tuple(feature_layers))

    def graph(self, bucket: Bucket) -> Bucket:
        """The graph a bucket runs in: the bucket itself if static; if dynamic, with ``kv_len`` and (unless
        one) ``batch`` 0, meaning any."""
        if not self.dynamic:
            return bucket
        return bucket._replace(batch=1 if bucket.batch == 1 else 0, kv_len=0)

    def _fallback(self, key: tuple, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s: %s; running the eager forward", self.what, message)

    def pad(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor | None = None,
        feature_layers: tuple[int, ...] = (),
    ) -> Padded | None:
        """The forward's inputs padded to its bucket, or ``None`` where the graphs do not apply (run eager).

        Padding tokens are token 0 at position 0, written at the cache's spare slot and attending slot 0.
        """
        n, q = input_ids.shape
        kv_len = attention_mask.shape[-1]
        if kv_len <= q:  # nothing cached before these tokens: a prefill, eager by design
            return None
        if torch.is_grad_enabled():
            self._fallback(("autograd",), "the graphs run without autograd, this forward needs it")
            return None
        bucket = self.bucket(n, q, kv_len, feature_layers)
        if bucket is None:
            c = self.config
            self._fallback(("shape", n, q), f"{n} rows x {q} new tokens is outside the buckets "
                                             f"(batch_buckets={c.batch_buckets}, query_buckets={c.query_buckets})")
            return None
        rows, buffer_len = cache.keys.shape[1], cache.keys.shape[3]
        if bucket.batch > rows or buffer_len <= max(cache.max_len, bucket.kv_len):
            self._fallback(("cache", rows, buffer_len), "the cache has no room for the bucket's padding "
                                                        "(make it with the model's new_cache)")
            return None
        B, Q, K = bucket.batch, bucket.queries, bucket.kv_len
        ids = input_ids.new_zeros(B, Q)
        ids[:n, :q] = input_ids
        pos = positions.new_zeros(B, Q)
        pos[:n, :q] = positions
        where = positions.new_full((B, Q), buffer_len - 1)
        where[:n, :q] = positions if slots is None else slots
        mask = attention_mask.new_zeros(B, 1, Q, K)
        mask[..., 0] = True
        mask[:n, :, :q, :kv_len] = attention_mask
        if self.dynamic:
            self.mark_rows(ids, pos, where, mask)
            torch._dynamo.mark_dynamic(mask, 3)
        return Padded(bucket, ids, pos, where, mask, n, q)

    def mark_rows(self, *tensors: torch.Tensor) -> None:
        """Mark dimension 0 (rows) of the graph inputs dynamic, where graphs are dynamic and rows are not one."""
        if self.dynamic and tensors[0].shape[0] > 1:
            for t in tensors:
                torch._dynamo.mark_dynamic(t, 0)

    def _key(self, graph: Bucket, args: tuple) -> tuple:
        """A graph's key: its bucket, the global state dynamo's guards would check (thread count, which
        Inductor's CPU kernels are built for; inference and autocast modes), and its tensor arguments'
        dtypes and shapes (static graphs) or which of their dimensions are 0 or 1 (dynamic graphs, which
        specialise those); a list of tensors (cache views, all alike) by its first."""
        kinds = []
        for arg in args:
            if isinstance(arg, list) and arg and isinstance(arg[0], torch.Tensor):
                arg = arg[0]
            if isinstance(arg, torch.Tensor):
                kinds.append((arg.dtype, tuple(min(d, 2) for d in arg.shape) if self.dynamic else arg.shape))
        return (graph, torch.get_num_threads(), torch.is_inference_mode_enabled(),
                torch.is_autocast_enabled(self._device_type), *kinds)

    def launch(self, bucket: Bucket, *args: Any) -> Any:
        """Call the compiled function in ``bucket``'s graph; a call that compiles is timed and logged.

        With ``config.skip_guards``, once a graph key (:meth:`_key`) has compiled, its calls run the
        compiled bytecode directly: no dynamo guards, no frame hook. Weights that changed dtype, device or
        layout since the graphs were built get new graphs (logged).
        """
        assert self._traced is not None, "compile() must precede launch()"
        if self._weights_kind() != self._built_for:
            log.warning("%s: the model's weights changed dtype, device or layout; compiling new graphs", self.what)
            self.compile(self._traced)
        graph = self.graph(bucket)
        key = self._key(graph, args)
        self.graph_calls[graph] += 1
        direct = self._direct.get(key)
        if direct is not None:
            return direct(*args)
        if self._cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        if key not in self._guarded:
            own = _own_code(self._traced)
            self._guarded[key] = own, torch.compile(own, dynamic=False, fullgraph=True, options=self._options)
        own, compiled = self._guarded[key]
        graphs = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT, accumulated_recompile_limit=_RECOMPILE_LIMIT):
            out = compiled(*args)
        if counters["stats"]["unique_graphs"] != graphs:  # this call compiled (first call of a graph, or a recompile)
            seconds = time.perf_counter() - start
            if graph in self.compile_times:
                log.warning("%s: graph %s compiled again (%.1f s)", self.what, tuple(graph), seconds)
            self.compile_times[graph] = self.compile_times.get(graph, 0.0) + seconds
            log.info("%s: bucket %s compiled in %.1f s", self.what, tuple(graph), seconds)
        if self.config.skip_guards and not self._cudagraphs:
            entries = _debug_get_cache_entry_list(own.__code__)
            if len(entries) == 1:  # else guards told graphs of this key apart: keep them
                self._direct[key] = types.FunctionType(entries[0].code, own.__globals__, own.__name__, own.__defaults__,
                                                         own.__closure__)
        return out

    def unpad(self, x: torch.Tensor | None, padded: Padded) -> torch.Tensor | None:
        """``[B, Q, ...]`` graph output -> ``[n, q, ...]`` (copied out of CUDA graph memory, which the next replay reuses)."""
        if x is None:
            return None
        x = x[: padded.n, : padded.q]
        return x.clone() if self._cudagraphs else x


class CompiledDecode(BucketedGraphs):
    """Decode and verify forwards of a Llama/Qwen2 model through compiled, bucketed graphs.

    :class:`~tlt_lightning.models.HFTarget` builds one for ``decode="compiled"``; its forward
    calls it and runs the eager lean forward whenever it returns ``None``.

    Args:
        model: a model accepted by :func:`check_compiled_model`.
        config: buckets and mode (default :class:`CompileConfig`).

    Example:
        >>> from tlt_lightning.models import load_model
        >>> decode = CompiledDecode(load_model("tiny-llama").model, CompileConfig(batch_buckets=(2,)))  # doctest: +SKIP
        >>> decode.new_cache(num_layers=4, max_batch=1, num_kv_heads=2, max_len=10, head_dim=16).keys.shape  # doctest: +SKIP
        torch.Size([4, 2, 2, 257, 16])
    """

    def __init__(self, model: nn.Module, config: CompileConfig | None = None) -> None:
        check_compiled_model(model)
        super().__init__(model, config, "decode='compiled'")
        self.model = model
        self._pack = self.config.packed_weights and model.device.type == "cpu" and model.dtype in packable_dtypes()
        self._gemv = self.config.row_gemv and model.device.type == "cpu" and model.dtype == torch.bfloat16
        self._matmul_attention = self.config.matmul_attention and model.device.type == "cpu"
        head_dim = model.get_decoder().layers[0].self_attn.head_dim
        self._cpp_attention = (self.config.cpp_attention and model.device.type == "cpu" and model.dtype == torch.bfloat16
                               and head_dim in kernels.HEAD_DIMS and kernels.available())
        linears = {n: m for n, m in model.get_decoder().named_modules() if isinstance(m, nn.Linear)}
        self._groups = [("+".join(group), [linears[name] for name in group])  # keyed as _static_forward reads them
                        for group in merged_groups(linears, self.config.merged_projections)]
        self._own_packs: dict[str, PackedWeight] = {}
        self.compile(_static_forward)

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
        hidden, features = self.launch(bucket, self.model, None if gemv else self._packed(), p.input_ids, p.positions,
                                       p.slots, p.mask,
                                       *self.layer_views(cache), bucket.feature_layers, self._gemv,
                                       self._matmul_attention, bucket.all_slots, self._cpp_attention)
        return self.unpad(hidden, p), self.unpad(features, p)
