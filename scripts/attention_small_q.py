"""Micro-benchmark: one attention call of SmolLM2's shape (9 query heads over 3 key/value heads, head
size 64) for ``n`` rows of ``q`` new tokens against ``kv`` cached positions, three ways:
``F.scaled_dot_product_attention(..., enable_gqa=True)`` (the drafter's former call), ``repeat_kv``
then SDPA (transformers' ``sdpa`` for several queries under a mask: a verify forward) and
:func:`tlt_lightning.models.attention.grouped_sdpa`. Also checks that grouped equals ``enable_gqa``.
One torch thread; medians of 5 timings.

    python scripts/attention_small_q.py [--dtype bfloat16] [--shapes 1x1x600 1x7x600 4x7x600 ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tlt_lightning.models.attention import grouped_sdpa


def _time(fn, calls: int) -> float:
    """Median microseconds per call of ``fn`` over 5 timings of ``calls`` calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def _ways(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor):
    """The three ways to run one call, as argument-free callables."""
    groups = query.shape[1] // key.shape[1]
    return (
        lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True),
        lambda: F.scaled_dot_product_attention(
            query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), attn_mask=mask),
        lambda: grouped_sdpa(query, key, value, mask),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--shapes", nargs="+", default=["1x1x600", "1x7x300", "1x7x600", "4x7x600", "8x4x600", "8x7x600"],
                   help="ROWSxQUERIESxCACHED")
    p.add_argument("--calls", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    print(f"{'rows x queries x cached':>24}  {'enable_gqa':>10}  {'repeat_kv':>10}  {'grouped':>10}  (us)  equal")
    for shape in args.shapes:
        n, q, kv = (int(x) for x in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        query = torch.randn(n, 9, q, 64, generator=g).to(dtype)
        key, value = (torch.randn(n, 3, kv, 64, generator=g).to(dtype) for _ in range(2))
        mask = torch.rand(n, 1, q, kv, generator=g) < 0.9
        mask[..., 0] = True
        gqa, rep, grouped = _ways(query, key, value, mask)
        equal = torch.equal(gqa(), grouped())
        times = [_time(fn, args.calls) for fn in (gqa, rep, grouped)]
        print(f"{shape:>24}  {times[0]:10.0f}  {times[1]:10.0f}  {times[2]:10.0f}        {equal}")


if __name__ == "__main__":
    main()
