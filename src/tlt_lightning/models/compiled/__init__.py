"""A compiled decode path: the lean forward through ``torch.compile``, over shape buckets (gpt-fast style).

:func:`~tlt_lightning.models.lean.lean_decoder` is traced as it is (one copy of the math) with a
key/value store of fixed buffers. A forward of ``n`` rows of ``q`` new tokens over ``kv_len`` key
slots pads its queries to the smallest query bucket ``>= q`` (:class:`CompileConfig`), and then:

- **dynamic graphs** (the default, except for CUDA graphs): rows and key slots are dynamic
  dimensions, so one graph per query bucket serves every batch size and length (plus one for a
  single row, which ``torch.compile`` specialises), rows are not padded and attention reads exactly
  the cached keys (all of the cache's slots where that is cheaper: :attr:`CompileConfig.all_slots_ratio`).
  Static buckets would spend their time on padded rows and key slots.
- **static graphs** (CUDA graphs, which replay fixed shapes): rows pad to the smallest batch bucket
  ``>= n`` and ``kv_len`` rounds up to a multiple of ``kv_step``; one graph per bucket.

Graphs compile lazily, on their first call, and are reused for every step that falls in them; any
call that compiles is timed and logged (:attr:`BucketedGraphs.compile_times`), so benchmarks report
compile time apart from decoding, and a recompile would show there too. Padding never touches a
sequence (it writes to a spare slot past ``max_len``: :meth:`CompiledDecode.new_cache`).

On a CPU the linears multiply by oneDNN-packed copies of the weights through :func:`packed_linear`, an
op Inductor keeps as it is; the packed copies are graph *inputs*, remade when a weight changes in place
(an RL update), so graphs never freeze weights. Compiling pays on a CPU only with packed weights. One
exception: in bf16 a graph of one row of one token (batch-1 decode) multiplies by the plain weights as an
Inductor reduction (:func:`row_gemv`), which streams them faster than oneDNN's memory-bound bf16 product
for one row. In bf16 on a CPU the graphs attend by a C++ kernel of ours
(:func:`tlt_lightning.kernels.decode_attention`, built on first use), which reads each key/value head of
the cache once, in place, for all the query heads and tokens it serves; where it does not build, by
PyTorch's flash kernel (one row) or batched products (:attr:`CompileConfig.matmul_attention`). On CUDA
the default mode is ``"reduce-overhead"`` (CUDA graphs per bucket), the cache buffers are marked static,
and outputs are copied out of the graph's memory. docs/benchmarks.md has the measurements behind these
choices.

Calls the graphs do not take run on the eager lean forward instead: prefill (rows with nothing
cached: ``kv_len <= q``), autograd, a shape outside every bucket, or a cache without the spare slot;
the last three log one warning per kind and shape.

Numerics: the same contract as the other paths. fp32 greedy outputs equal transformers' token for
token (tests on tiny Llama and Qwen2, SmolLM2 in a slow test). Inductor fuses the element-wise ops and
padding changes the row count of the matrix products, so hidden states differ from the eager path by
rounding: documented tolerance (tested), the largest difference relative to the largest hidden value,
``1e-5`` in fp32 and ``5e-2`` in bf16 (a few bf16 ulps). bf16 greedy outputs can part after a near-tie,
as between any two bf16 kernels.

The modules: :mod:`~tlt_lightning.models.compiled.config` (:class:`CompileConfig`),
:mod:`~tlt_lightning.models.compiled.ops` (the products), :mod:`~tlt_lightning.models.compiled.forward`
(what is traced), :mod:`~tlt_lightning.models.compiled.graphs` (buckets, padding, lazy compiles),
:mod:`~tlt_lightning.models.compiled.guards` (calls without dynamo's guards: the one user of a private
dynamo API), :mod:`~tlt_lightning.models.compiled.decode` (:class:`CompiledDecode`).
"""

from tlt_lightning.models.compiled.config import COMPILE_MODES, CompileConfig
from tlt_lightning.models.compiled.decode import CompiledDecode, check_compiled_model, few_rows_pay
from tlt_lightning.models.compiled.forward import StaticKV, merged_groups
from tlt_lightning.models.compiled.graphs import Bucket, BucketedGraphs, Padded
from tlt_lightning.models.compiled.ops import packed_linear, row_gemv

__all__ = [
    "COMPILE_MODES",
    "Bucket",
    "BucketedGraphs",
    "CompileConfig",
    "CompiledDecode",
    "Padded",
    "StaticKV",
    "check_compiled_model",
    "few_rows_pay",
    "merged_groups",
    "packed_linear",
    "row_gemv",
]
