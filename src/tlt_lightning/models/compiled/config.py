"""The settings of the compiled decode path: shape buckets, ``torch.compile`` mode, what the graphs run."""

from __future__ import annotations

from dataclasses import dataclass

from tlt_lightning.models.lean import MAX_LEAN_QUERIES
from tlt_lightning.validation import check, is_int, positive_int

__all__ = ["COMPILE_MODES", "CompileConfig"]

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""The ``torch.compile`` modes :attr:`CompileConfig.mode` accepts."""


def _check_ascending(name: str, sizes: tuple[int, ...], most: int | None = None) -> None:
    ascending = bool(sizes) and all(is_int(s) and s >= 1 for s in sizes) and list(sizes) == sorted(set(sizes))
    check(ascending, name, sizes, "a non-empty, strictly increasing tuple of positive ints")
    if most is not None:
        allowed = f"buckets of at most {most} queries (the lean path's most per row)"
        check(sizes[-1] <= most, name, sizes, allowed)


@dataclass(frozen=True)
class CompileConfig:
    """Shape buckets and mode of :class:`~tlt_lightning.models.compiled.CompiledDecode`.

    Every switch below is on by default where it applies; turning one off is for comparing the
    variants (``python -m benchmarks.compiled_steps``, ``python -m benchmarks.decode_paths``;
    docs/benchmarks.md has the measurements) or, for ``merged_projections``, for saving memory.

    Attributes:
        batch_buckets: row counts static graphs are compiled for (``n`` rows run in the smallest bucket
            ``>= n``); dynamic graphs take up to the largest.
        query_buckets: new tokens per row (1: decode, ``K + 1``: a chain of ``K`` drafts, tree nodes);
            at most :data:`~tlt_lightning.models.lean.MAX_LEAN_QUERIES`. By default every count up to 16
            is its own bucket (graphs compile on first use, so only the arms in use cost one): a padded
            query costs what a real one does, and on a CPU a verify is compute-bound from a few rows on
            (SmolLM2 bf16, 7 rows over 600 keys, one core: 3 queries 54.9 ms, padded to 4 65.2 ms).
        kv_step: key slots attention reads in static graphs, rounded up to a multiple of this (the rest
            masked).
        mode: ``torch.compile`` mode (:data:`COMPILE_MODES`); ``None``: ``"reduce-overhead"`` (CUDA
            graphs) on CUDA, ``"default"`` elsewhere.
        packed_weights: on a CPU, multiply by oneDNN-packed weights passed as graph inputs (without
            them compiling does not pay on a CPU; no effect elsewhere or for dtypes oneDNN cannot pack).
        row_gemv: on a CPU in bf16, graphs of one row of one token (batch-1 decode) multiply by the
            plain weights as an Inductor reduction (:func:`~tlt_lightning.models.compiled.row_gemv`)
            instead of oneDNN, whose bf16 product for a single row is memory-bound and streams the
            weights slower.
        matmul_attention: on a CPU, graphs of several rows attend by two batched products
            (:func:`~tlt_lightning.models.attention.grouped_matmul_attention`) instead of the flash
            kernel, which is slower there for several rows (one row keeps the kernel).
        all_slots_ratio: with ``matmul_attention``, dynamic graphs read all of the cache's ``S`` slots
            (the unused ones masked) when ``S`` is at most this many times the ``kv_len`` keys a forward
            needs (0: never). On a CPU ``torch.bmm`` copies a batch of ``kv_len``-slot slices of the
            cache before multiplying (read, write, read again), while all slots are one contiguous
            block per row.
        merged_projections: with ``packed_weights``, each layer's q/k/v projections are one product, and
            its gate and up projections another, by a packed copy of their stacked weights (where their
            biases are alike): 7 products a layer become 4, fewer and larger, which is faster. It costs
            memory: with the ``"packed"`` layout, whose per-linear copies the eager prefill multiplies
            by, a second packed copy of those weights.
        cpp_attention: on a CPU in bf16 (head dims 64 and 128), every graph attends by the C++ kernel
            :func:`tlt_lightning.kernels.decode_attention` (built on first use; where it does not build,
            as ``matmul_attention`` says), which reads each key/value head of the cache once for all
            the query heads and tokens it serves.
        few_rows_linear: on a CPU in bf16, graphs of one row and up to 16 tokens (a verify at batch 1),
            or of a few rows and up to 8 tokens in all (decode steps at batch 2-8), multiply by the C++
            :func:`tlt_lightning.kernels.few_rows_linear` (where it builds), which streams each weight once
            for all the tokens, instead of oneDNN (:func:`~tlt_lightning.models.compiled.few_rows_pay`).
        dynamic: rows and key slots as dynamic dimensions of the graphs: one graph per query bucket
            (and one for a single row), no padded rows, attention reads exactly the cached keys.
            ``None``: on unless the graphs are CUDA graphs (they need static shapes).
        skip_guards: once a graph has compiled, call it without dynamo's guards (as vLLM does), where
            the graphs are not CUDA graphs. What they check is fixed by the graph's key (bucket, weights'
            kind, thread count, inference and autocast modes, the inputs' dtypes and shapes) and by
            :meth:`~tlt_lightning.models.compiled.BucketedGraphs.pad` (contiguous inputs, cache views of
            one buffer); Inductor still asserts every input's sizes and strides. For dynamic graphs the
            guards are a Python function of thousands of symbolic checks on the cache views, run at
            every call. It needs a private dynamo API: where a torch lacks it, calls keep their guards
            (one warning, :mod:`~tlt_lightning.models.compiled.guards`).

    Example:
        >>> CompileConfig(batch_buckets=(1, 8), query_buckets=(1, 4)).kv_step
        256
    """

    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    query_buckets: tuple[int, ...] = tuple(range(1, 17))
    kv_step: int = 256
    mode: str | None = None
    packed_weights: bool = True
    row_gemv: bool = True
    matmul_attention: bool = True
    all_slots_ratio: float = 2.0
    merged_projections: bool = True
    cpp_attention: bool = True
    few_rows_linear: bool = True
    dynamic: bool | None = None
    skip_guards: bool = True

    def __post_init__(self) -> None:
        _check_ascending("batch_buckets", self.batch_buckets)
        _check_ascending("query_buckets", self.query_buckets, MAX_LEAN_QUERIES)
        ratio = self.all_slots_ratio
        check(
            isinstance(ratio, (int, float)) and ratio >= 0,
            "all_slots_ratio",
            ratio,
            ">= 0 (0: never read all slots)",
        )
        positive_int("kv_step", self.kv_step)
        check(
            self.mode is None or self.mode in COMPILE_MODES,
            "mode",
            self.mode,
            f"None or one of {COMPILE_MODES}",
        )
