"""Decode and verify forward of the target on three paths, side by side: transformers' module tree
(``HFTarget(decode="hf")``), the lean forward (``HFTarget(decode="lean")``) and, with ``--compile``,
the compiled lean forward (``HFTarget(decode="compiled")``: Inductor, static shape buckets, the key
length rounded up to ``--bucket`` so one graph serves many steps, gpt-fast style; oneDNN-packed
weights as graph inputs unless ``--compile-unpacked``; with ``--compile-onednn`` also the compiled path
without ``row_gemv``, one-row graphs multiplying with oneDNN).

Each timed call is one target forward over ``q`` new tokens per row plus the LM head, at
``--context`` cached positions; the paths alternate round by round (A B C A B C) and medians are
printed, so machine noise hits all of them alike. Compile time (first call of each bucket) is
printed separately; ``max|diff|`` is the largest logit difference from the transformers path.

    python -m benchmarks.decode_paths [--dtype bfloat16] [--batch 1 8] [--queries 1 7] [--compile]

With ``--engine N`` it times whole greedy rollouts instead: ``RolloutEngine`` on the hf, the lean
(and with ``--compile`` the compiled) path alternately (A B A B, ``--repeats`` each, after one untimed
run of each that compiles the graphs), ``N`` new tokens for each of ``B`` countdown prompts; it prints
the median decode step, decode tokens/s and whether the outputs are identical to the hf path's.

    python -m benchmarks.decode_paths --engine 64 [--dtype bfloat16] [--batch 1 8] [--compile]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from tlt_lightning.models import CompileConfig, HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
from tlt_lightning.rollout.engine import causal_decode_mask


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument(
        "--weight-layout",
        default="packed",
        choices=["out_in", "in_out", "packed"],
        help="layout of the linear weights (the compiled path multiplies by packed copies either way)",
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--queries", type=int, nargs="+", default=[1, 7], help="new tokens per row (1 = decode)")
    p.add_argument("--context", type=int, default=300, help="cached positions per row")
    p.add_argument(
        "--bucket", type=int, default=64, help="compiled path: key length rounded up to a multiple of this"
    )
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--compile", action="store_true", help="also time the compiled path (HFTarget(decode='compiled'))"
    )
    p.add_argument(
        "--compile-unpacked",
        action="store_true",
        help="the compiled path multiplies by the parameters (F.linear) instead of oneDNN-packed copies",
    )
    p.add_argument(
        "--compile-onednn",
        action="store_true",
        help="also time the compiled path without row_gemv (one-row graphs multiply with oneDNN)",
    )
    p.add_argument(
        "--compile-no-few-rows",
        action="store_true",
        help="also time the compiled path without few_rows_linear (one-row verifies multiply with oneDNN)",
    )
    p.add_argument("--no-lean", action="store_true", help="leave out the eager lean path")
    p.add_argument(
        "--engine",
        type=int,
        default=0,
        metavar="N",
        help="time greedy RolloutEngine rollouts of N new tokens instead of single forwards",
    )
    p.add_argument("--repeats", type=int, default=3, help="--engine: alternating runs per path")
    return p


def main() -> None:
    args = _parser().parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype)
    model = loaded.model
    targets = (
        {"hf": HFTarget(model)}
        if args.no_lean
        else {"hf": HFTarget(model), "lean": HFTarget(model, decode="lean")}
    )
    if args.compile:
        # One bucket per measured shape: batch and query buckets are the measured sizes themselves.
        config = CompileConfig(
            batch_buckets=tuple(sorted(set(args.batch))),
            query_buckets=tuple(sorted(set(args.queries))),
            kv_step=args.bucket,
            packed_weights=not args.compile_unpacked,
        )
        targets["compiled"] = HFTarget(model, decode="compiled", compile_config=config)
        if args.compile_no_few_rows:
            targets["compiled-no-few-rows"] = HFTarget(
                model, decode="compiled", compile_config=dataclasses.replace(config, few_rows_linear=False)
            )
        if args.compile_onednn:
            targets["compiled-onednn"] = HFTarget(
                model, decode="compiled", compile_config=dataclasses.replace(config, row_gemv=False)
            )
    targets["hf"].set_weight_layout(args.weight_layout)  # one model: every path sees the layout
    if args.engine:
        engine_rollouts(args, loaded.tokenizer, targets)
        return
    print(
        f"{args.model} {args.dtype} layout={args.weight_layout} threads={args.threads} "
        f"context={args.context}; "
        f"ms per forward+head, median of {args.rounds} alternating rounds"
    )
    for B in args.batch:
        for q in args.queries:
            med, diffs, compile_s = measure(args, targets, B, q)
            parts = [
                f"{k} {m:6.1f} ms ({B * q / m * 1e3:6.0f} tokens fed/s, max|diff| {diffs[k]:.1e})"
                for k, m in med.items()
            ]
            ratios = "".join(f"; {k}/hf {med['hf'] / m:.2f}x" for k, m in med.items() if k != "hf")
            extra = f", compile {compile_s:.0f} s" if args.compile else ""
            print(f"B={B} q={q}: " + "; ".join(parts) + ratios + extra, flush=True)


def engine_rollouts(args, tokenizer, targets: dict[str, HFTarget]) -> None:
    """Greedy rollouts on every path, alternating after one untimed run each; medians over
    ``args.repeats`` runs."""
    from benchmarks.common import task_prompts

    prompts = task_prompts(tokenizer, "countdown", max(args.batch), seed=0)
    config = RolloutConfig(max_new_tokens=args.engine, temperature=0.0)
    print(
        f"{args.model} {args.dtype} layout={args.weight_layout} threads={args.threads}: "
        "greedy RolloutEngine, "
        f"{args.engine} new tokens per request, median of {args.repeats} alternating runs"
    )
    for B in args.batch:
        step_ms: dict[str, list[float]] = {k: [] for k in targets}
        tok_s: dict[str, list[float]] = {k: [] for k in targets}
        outputs: dict[str, list[list[int]]] = {}
        compile_s = {k: t.compile_seconds for k, t in targets.items()}
        for target in targets.values():  # untimed: compiles the graphs this workload needs
            RolloutEngine(target, config).generate(prompts[:B])
        compile_s = {k: t.compile_seconds - compile_s[k] for k, t in targets.items()}
        for _ in range(args.repeats):
            for name, target in targets.items():
                result = RolloutEngine(target, config).generate(prompts[:B])
                step_ms[name].append(statistics.median(result.stats.step_times) * 1e3)
                tok_s[name].append(result.stats.decode_tokens_per_s)
                outputs[name] = [r.token_ids.tolist() for r in result.rollouts]
        med = {k: statistics.median(v) for k, v in step_ms.items()}
        tps = {k: statistics.median(v) for k, v in tok_s.items()}
        parts = []
        for k in targets:
            same = sum(a == b for a, b in zip(outputs["hf"], outputs[k]))
            parts.append(
                f"{k} {med[k]:.1f} ms/step {tps[k]:.1f} tok/s"
                + ("" if k == "hf" else f" ({med['hf'] / med[k]:.2f}x, identical {same}/{B})")
            )
        extra = f"; compile {compile_s['compiled']:.0f} s (untimed)" if "compiled" in compile_s else ""
        print(f"B={B}: " + "; ".join(parts) + extra, flush=True)


def measure(args, targets: dict[str, HFTarget], B: int, q: int):
    """Medians (ms) per path, max logit difference from the hf path, and the compile seconds."""
    L = args.context
    caches = {k: t.new_cache(B, L + q) for k, t in targets.items()}  # the compiled path's has spare room
    info = targets["hf"].info
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(1000, info.vocab_size), (B, q), generator=g)
    lengths = torch.full((B,), L)
    pos = L + torch.arange(q)[None].expand(B, q)
    mask = causal_decode_mask(lengths, q, L + q)

    def call(name: str) -> torch.Tensor:
        target = targets[name]
        return target.lm_head(target.forward(ids, pos, mask, caches[name]).hidden)

    times: dict[str, list[float]] = {k: [] for k in targets}
    with torch.inference_mode():
        compiled = targets.get("compiled")
        before = compiled.compile_seconds if compiled is not None else 0.0
        ref = call("hf").float()
        diffs = {k: (call(k).float() - ref).abs().max().item() for k in targets}  # compiles the bucket
        compile_s = compiled.compile_seconds - before if compiled is not None else 0.0
        for _ in range(args.rounds):
            for k in targets:
                call(k)  # a warm call: each path finds the caches as it leaves them
                start = time.perf_counter()
                call(k)
                times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}, diffs, compile_s


if __name__ == "__main__":
    main()
