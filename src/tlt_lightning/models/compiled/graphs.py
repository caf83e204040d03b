"""Shape buckets, padding and lazily compiled graphs: what every compiled step shares.

:class:`BucketedGraphs` pads a forward's inputs to its bucket (:meth:`~BucketedGraphs.pad`), runs it in
that bucket's graph, compiled on its first call (:meth:`~BucketedGraphs.launch`), and cuts the padding
off the outputs. Every call that compiles is timed and logged (:attr:`BucketedGraphs.compile_times`), so
benchmarks report compile time apart from decoding, and a recompile would show there too. A forward the
graphs do not take returns ``None`` from :meth:`~BucketedGraphs.pad` (the caller runs eager), with one
logged warning per kind and shape.

Padding never touches a sequence: padded rows and padded queries write their keys and values into a
spare slot past ``max_len`` (:meth:`~BucketedGraphs.new_cache` allocates it), real queries see the padded
key slots masked out, and padded queries attend slot 0 so they stay finite.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._dynamo.utils import counters

from tlt_lightning.models.compiled.config import CompileConfig
from tlt_lightning.models.compiled.guards import guard_free, own_code
from tlt_lightning.models.kv_cache import KVCache

__all__ = ["Bucket", "BucketedGraphs", "Padded"]

log = logging.getLogger(__name__)

_RECOMPILE_LIMIT = 4096  # one graph per bucket is the design, not a recompile storm


class Bucket(NamedTuple):
    """The shape a forward runs at: padded rows, queries per row, key slots; requested features; whether
    attention reads all the cache's slots (:attr:`CompileConfig.all_slots_ratio`); whether the linears
    multiply by :func:`~tlt_lightning.kernels.few_rows_linear` (:attr:`CompileConfig.few_rows_linear`).

    As a key of :attr:`BucketedGraphs.compile_times` (one compiled graph), a ``batch`` or ``kv_len`` of 0
    is a dynamic dimension: any."""

    batch: int
    queries: int
    kv_len: int
    feature_layers: tuple[int, ...]
    all_slots: bool = False
    few_rows: bool = False


def _bucket(sizes: tuple[int, ...], value: int) -> int | None:
    return next((s for s in sizes if s >= value), None)


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


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
    """What every compiled step shares: buckets, caches with room for padding, padding, timing,
    fallback warnings.

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
        self._guarded: dict[
            tuple, tuple[Callable[..., Any], Callable[..., Any]]
        ] = {}  # per graph key: a copy
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
        its own code object (:func:`~tlt_lightning.models.compiled.guards.own_code`), so it holds one
        compiled graph, which with ``config.skip_guards`` later calls run directly (:meth:`launch`).

        Its graphs skip dynamo's guards on the model's modules (``skip_guard_on_all_nn_modules_unsafe``):
        they cost time at every call, and what they check cannot change under these graphs but the
        weights' dtype, device and layout (:mod:`~tlt_lightning.models.layout`), which :meth:`launch`
        checks itself. Weights updated in place, or replaced by tensors of the same kind, are read
        afresh every call."""
        self._options = {
            **torch._inductor.list_mode_options(self.mode, dynamic=False),
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
        }
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
        self,
        num_layers: int,
        max_batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
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
        """The shape a forward of ``n`` rows, ``q`` new tokens each, over ``kv_len`` key slots runs at
        (or ``None``).

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
            self._fallback(
                ("shape", n, q),
                f"{n} rows x {q} new tokens is outside the buckets "
                f"(batch_buckets={c.batch_buckets}, query_buckets={c.query_buckets})",
            )
            return None
        rows, buffer_len = cache.keys.shape[1], cache.keys.shape[3]
        if bucket.batch > rows or buffer_len <= max(cache.max_len, bucket.kv_len):
            self._fallback(
                ("cache", rows, buffer_len),
                "the cache has no room for the bucket's padding (make it with the model's new_cache)",
            )
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
        """Mark dimension 0 (rows) of the graph inputs dynamic, where graphs are dynamic and rows are not
        one."""
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
        return (
            graph,
            torch.get_num_threads(),
            torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled(self._device_type),
            *kinds,
        )

    def launch(self, bucket: Bucket, *args: Any) -> Any:
        """Call the compiled function in ``bucket``'s graph; a call that compiles is timed and logged.

        With ``config.skip_guards``, once a graph key (:meth:`_key`) has compiled, its calls run the
        compiled bytecode directly: no dynamo guards, no frame hook. Weights that changed dtype, device or
        layout since the graphs were built get new graphs (logged).
        """
        assert self._traced is not None, "compile() must precede launch()"
        if self._weights_kind() != self._built_for:
            log.warning(
                "%s: the model's weights changed dtype, device or layout; compiling new graphs", self.what
            )
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
            own = own_code(self._traced)
            self._guarded[key] = own, torch.compile(own, dynamic=False, fullgraph=True, options=self._options)
        own, compiled = self._guarded[key]
        graphs = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        with torch._dynamo.config.patch(
            recompile_limit=_RECOMPILE_LIMIT, accumulated_recompile_limit=_RECOMPILE_LIMIT
        ):
            out = compiled(*args)
        if (
            counters["stats"]["unique_graphs"] != graphs
        ):  # this call compiled (first call of a graph, or a recompile)
            seconds = time.perf_counter() - start
            if graph in self.compile_times:
                log.warning("%s: graph %s compiled again (%.1f s)", self.what, tuple(graph), seconds)
            self.compile_times[graph] = self.compile_times.get(graph, 0.0) + seconds
            log.info("%s: bucket %s compiled in %.1f s", self.what, tuple(graph), seconds)
        if self.config.skip_guards and not self._cudagraphs:
            direct = guard_free(own)  # None while guards tell graphs of this key apart: keep them
            if direct is not None:
                self._direct[key] = direct
        return out

    def unpad(self, x: torch.Tensor | None, padded: Padded) -> torch.Tensor | None:
        """``[B, Q, ...]`` graph output -> ``[n, q, ...]`` (copied out of CUDA graph memory, which the
        next replay reuses)."""
        if x is None:
            return None
        x = x[: padded.n, : padded.q]
        return x.clone() if self._cudagraphs else x
