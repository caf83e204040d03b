"""Step times of the compiled decode path's variants, side by side: static shape buckets (what CUDA
graphs need), dynamic rows and keys, dynamic with the attention as batched products, and that reading
all of the cache's slots where they are at most twice the keys, and the C++ decode kernels, with dynamo's
guards checked every call and skipped once compiled (the CPU default).

The :class:`~tlt_lightning.models.compiled.CompiledDecode` variants share one model (bf16 by default,
one thread, packed weights); for each ``ROWSxKEYSxQUERIES`` shape a forward is timed in each variant
alternately, after one untimed call that compiles. Prints median milliseconds per step and each
variant's speed-up over the static one; ``--json`` writes every run.

    python -m benchmarks.compiled_steps --shapes 1x200x1 8x200x1 32x200x1 48x300x1 4x150x4
    python -m benchmarks.compiled_steps --variants dynamic+matmul+all-slots cpp-attention  # a quicker pair
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from tlt_lightning.models import CompileConfig, HFTarget, load_model
from tlt_lightning.rollout.engine import causal_decode_mask

# The variants, each a CompileConfig of one model.
VARIANTS = {
    "static": CompileConfig(dynamic=False, matmul_attention=False, cpp_attention=False),
    "dynamic": CompileConfig(dynamic=True, matmul_attention=False, cpp_attention=False),
    "dynamic+matmul": CompileConfig(
        dynamic=True, matmul_attention=True, all_slots_ratio=0, cpp_attention=False
    ),
    "dynamic+matmul+all-slots": CompileConfig(dynamic=True, matmul_attention=True, cpp_attention=False),
    "cpp-attention+guards": CompileConfig(dynamic=True, skip_guards=False),
    "cpp-attention": CompileConfig(dynamic=True),
    "cpp-attention+onednn": CompileConfig(dynamic=True, few_rows_linear=False),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument(
        "--shapes",
        nargs="+",
        default=["1x200x1", "8x200x1", "32x200x1", "48x300x1", "4x150x4"],
        help="ROWSxKEYSxQUERIES: rows of QUERIES new tokens each over KEYS key slots",
    )
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--slots", type=int, default=None, help="cache slots per row (default: the most keys + 1)")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=list(VARIANTS),
        help="the configs to time; speed-ups are over the first",
    )
    return p


def _time_shape(
    targets: dict[str, HFTarget],
    caches: dict[str, Any],
    shape: tuple[int, int, int],
    g: torch.Generator,
    repeats: int,
) -> dict[str, Any]:
    """One ``(rows, keys, queries)`` shape: a first (compiling) call, then ``repeats`` timed steps of
    each variant in turn."""
    n, kv, q = shape
    lengths = torch.full((n,), kv - q)
    ids = torch.randint(5, 1000, (n, q), generator=g)
    positions = lengths[:, None] + torch.arange(q)
    mask = causal_decode_mask(lengths, q, kv)

    def step(name: str) -> float:
        cache = caches[name]
        cache.lengths[:n] = lengths
        start = time.perf_counter()
        targets[name].forward(ids, positions, mask, cache)
        return time.perf_counter() - start

    first = {name: step(name) for name in targets}
    runs: dict[str, list[float]] = {name: [] for name in targets}
    for _ in range(repeats):
        for name in targets:
            runs[name].append(step(name))
    return {
        "rows": n,
        "keys": kv,
        "queries": q,
        "median_ms": {name: 1000 * statistics.median(r) for name, r in runs.items()},
        "first_call_s": first,
        "runs_ms": {k: [1000 * t for t in r] for k, r in runs.items()},
    }


def main() -> None:
    args = _parser().parse_args()
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    model = load_model(args.model, dtype=args.dtype).model
    targets = {
        name: HFTarget(model, decode="compiled", compile_config=VARIANTS[name]) for name in args.variants
    }
    for target in targets.values():
        target.set_weight_layout("packed")
    rows, keys = max(s[0] for s in shapes), max(s[1] for s in shapes)
    caches = {name: t.new_cache(rows, args.slots or keys + 1) for name, t in targets.items()}
    g = torch.Generator().manual_seed(0)
    results = []
    with torch.inference_mode():
        for n, kv, q in shapes:
            results.append(_time_shape(targets, caches, (n, kv, q), g, args.repeats))
            ms = results[-1]["median_ms"]
            print(
                f"{n} rows x {q} queries over {kv} keys: "
                + ", ".join(f"{k} {v:.1f} ms (x{ms[args.variants[0]] / v:.2f})" for k, v in ms.items()),
                flush=True,
            )
    for name, t in targets.items():
        print(f"{name}: compiled {len(t.compile_times)} graphs in {t.compile_seconds:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "dtype": args.dtype,
                    "threads": args.threads,
                    "shapes": results,
                    "compile_seconds": {k: t.compile_seconds for k, t in targets.items()},
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
