"""Micro-benchmark: SmolLM2 target forwards of ``q`` new tokens for ``n`` rows over a cached context
(a plain decode step is ``q = 1``, a chain-``K`` verify ``q = K + 1``), with transformers' ``sdpa``
attention and with ``"tlt_grouped_sdpa"`` (:mod:`tlt_lightning.models.attention`), alternating
between the two; packed weights. Reports the best of ``--rounds`` medians of 5 forwards, in ms.

    python scripts/verify_forward.py [--dtype bfloat16] [--rows 1 4 8] [--queries 1 4 7] [--context 250]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.models.attention import GROUPED_SDPA
from tlt_lightning.rollout.engine import causal_decode_mask


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--queries", type=int, nargs="+", default=[1, 4, 7])
    p.add_argument("--context", type=int, default=250, help="cached positions per row")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    target = HFTarget(load_model("smollm2-135m", dtype=args.dtype).model)
    target.set_weight_layout("packed")
    ctx, impls = args.context, ("sdpa", GROUPED_SDPA)
    print(f"{'rows':>4} {'queries':>7}  {'sdpa':>8}  {'grouped':>8}  (ms)  ratio")
    for n in args.rows:
        cache = target.new_cache(n, ctx + max(args.queries))
        lengths = torch.full((n,), ctx)
        g = torch.Generator().manual_seed(n)
        with torch.no_grad():
            zero = torch.zeros(n, dtype=torch.long)
            target.forward(torch.randint(100, 1000, (n, ctx), generator=g), torch.arange(ctx).expand(n, ctx),
                           causal_decode_mask(zero, ctx, ctx), cache)
            best = {}
            for _ in range(args.rounds):
                for impl in impls:
                    target.model.set_attn_implementation(impl)
                    for q in args.queries:
                        times = []
                        for _ in range(5):  # writes past the context only: the cache stays as prefilled
                            ids = torch.randint(100, 1000, (n, q), generator=g)
                            start = time.perf_counter()
                            target.forward(ids, lengths[:, None] + torch.arange(q), causal_decode_mask(lengths, q, ctx + q),
                                           cache)
                            times.append(time.perf_counter() - start)
                        ms = statistics.median(times) * 1e3
                        best[impl, q] = min(best.get((impl, q), ms), ms)
        for q in args.queries:
            a, b = best["sdpa", q], best[GROUPED_SDPA, q]
            print(f"{n:>4} {q:>7}  {a:8.1f}  {b:8.1f}        {a / b:.2f}")


if __name__ == "__main__":
    main()
