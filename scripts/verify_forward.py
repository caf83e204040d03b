"""Micro-benchmark: SmolLM2 target forwards of ``q`` new tokens for ``n`` rows over a cached context
(a plain decode step is ``q = 1``, a chain-``K`` verify ``q = K + 1``), with the adapter's own
attention (transformers' ``sdpa``, or torchtune's) and with the grouped layout
(:mod:`tlt_lightning.models.attention`), alternating between the two; the HF adapter with packed
weights. Reports the best of ``--rounds`` medians of 5 forwards, in ms.

    python scripts/verify_forward.py [--adapter hf] [--dtype bfloat16] [--rows 1 4 8] [--queries 1 4 7] [--context 250]
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
    p.add_argument("--adapter", default="hf", choices=["hf", "torchtune"], help="torchtune: TorchtuneTarget")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--queries", type=int, nargs="+", default=[1, 4, 7])
    p.add_argument("--context", type=int, default=250, help="cached positions per row")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = load_model("smollm2-135m", dtype=args.dtype).model
    if args.adapter == "hf":
        target = HFTarget(model)
        target.set_weight_layout("packed")
        impls = ("sdpa", GROUPED_SDPA)
        def use(impl: str) -> None:
            target.model.set_attn_implementation(impl)
    else:
        from tlt_lightning.models.torchtune_target import TorchtuneTarget

        target = TorchtuneTarget.from_hf(model)
        impls = ("torchtune", GROUPED_SDPA)
        def use(impl: str) -> None:
            target.grouped_attention = impl == GROUPED_SDPA
    ctx = args.context
    print(f"{'rows':>4} {'queries':>7}  {impls[0]:>9}  {'grouped':>8}  (ms)  ratio")
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
                    use(impl)
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
            a, b = best[impls[0], q], best[GROUPED_SDPA, q]
            print(f"{n:>4} {q:>7}  {a:9.1f}  {b:8.1f}        {a / b:.2f}")


if __name__ == "__main__":
    main()
