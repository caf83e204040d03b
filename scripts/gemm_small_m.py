"""Micro-benchmark: the linears of one SmolLM2 forward (30 layers + the 49k-row LM head) for M rows.

What a verify forward of M drafted tokens costs against a plain decode step, on this CPU:
PyTorch's ``[out, in]`` weights, ``[in, out]`` (``set_weight_layout(..., "in_out")``), oneDNN's
packed weights (``set_weight_layout(..., "packed")``: ``torch.ops.mkldnn._linear_pointwise`` on a
weight reordered once) and, in fp32, MKL's packed GEMM (``torch.ops.mkl._mkl_linear`` on a weight
reordered for exactly ``P`` rows, inputs zero-padded to ``P``). Random weights of the real shapes
(540 MB in fp32), so they stream from memory as in decoding. One torch thread; medians.

    python scripts/gemm_small_m.py [--dtype bfloat16] [--rows 1 2 3 4 7 8 16 32] [--packs 8 16 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tlt_lightning.models.layout import PACK_ROWS

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 7, 8, 16, 32])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--packs", type=int, nargs="*", default=[8, 16, 32], help="row counts to pack for (MKL, fp32)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    shapes = [shape for _ in range(30) for shape in LAYER] + [(49152, 576)]
    weights = [(torch.randn(o, i) * 0.02).to(dtype) for o, i in shapes]
    col = [w.t().contiguous().t() for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in weights]
    packs = {m: [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in weights] for m in args.packs} \
        if dtype == torch.float32 else {}

    def ms(fn, rows: int) -> float:
        xs = {i: torch.randn(rows, i).to(dtype) for i in (576, 1536)}
        times = []
        with torch.inference_mode():
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn(xs)
                times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    print(f"{'rows':>4} {'[out,in]':>9} {'[in,out]':>9} {'oneDNN':>9} "
          + " ".join(f"{f'mkl{m}':>9}" for m in packs) + "  (ms)")
    for rows in args.rows:
        line = [ms(lambda xs: [F.linear(xs[w.shape[1]], w) for w in weights], rows),
                ms(lambda xs: [F.linear(xs[w.shape[1]], w) for w in col], rows),
                ms(lambda xs: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], pk, None, "none", [], "")
                               for pk, w in zip(onednn, weights)], rows)]
        for m in packs:
            line.append(float("nan") if m < rows else ms(
                lambda xs, m=m: [torch.ops.mkl._mkl_linear(F.pad(xs[w.shape[1]], (0, 0, 0, m - rows)), pk, w, None, m)
                                 for pk, w in zip(packs[m], weights)], rows))
        print(f"{rows:>4} " + " ".join(f"{t:9.1f}" for t in line), flush=True)


if __name__ == "__main__":
    main()
