"""``python -m benchmarks rollout``: the engine against HF ``generate`` on the same prompts and sampling.

Two workloads:

* fixed batches (1, 8, 32, 128 by default), greedy, ``--max-new-tokens`` each: throughput of both,
  measured alternately (A B A B ...) so machine noise hits both alike, and whether the outputs are
  identical token for token;
* the long tail: ``--long-tail-requests`` task prompts sampled at temperature 1 up to
  ``--long-tail-max-new`` tokens, as an RL rollout does: response-length percentiles, the idle
  fraction a static batch would waste, and throughput of both.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    compile_report,
    machine_info,
    median,
    new_figure,
    save_figure,
    task_prompts,
    timed,
    write_json,
)
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig, RolloutEngine, RolloutResult

__all__ = ["hf_generate", "length_summary", "run"]


def hf_generate(
    model, tokenizer, prompts: list[list[int]], config: RolloutConfig, seed: int
) -> list[list[int]]:
    """HF ``generate`` on a left-padded batch; returns each response up to and including its EOS."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention[i, width - len(p) :] = 1
    kwargs: dict[str, Any] = {"do_sample": False}
    if not config.sampling.greedy:
        kwargs = {
            "do_sample": True,
            "temperature": config.temperature,
            "top_p": config.top_p,
            "top_k": config.top_k,
        }
        torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=config.max_new_tokens,
            pad_token_id=pad,
            **kwargs,
        )
    eos = set(
        model.generation_config.eos_token_id
        if isinstance(model.generation_config.eos_token_id, list)
        else [model.generation_config.eos_token_id]
    )
    responses = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        responses.append(row[:end])
    return responses


def length_summary(lengths: torch.Tensor) -> dict[str, float]:
    """Percentiles of response lengths, and the row-steps a static batch would leave idle."""
    f = lengths.float()
    return {
        "p50": float(f.quantile(0.5)),
        "p90": float(f.quantile(0.9)),
        "max": float(f.max()),
        "mean": float(f.mean()),
        "idle_fraction_static_batch": float(1 - f.mean() / f.max()),
    }


def _compare(engine: RolloutEngine, model, tokenizer, prompts, repeats: int, seed: int) -> dict[str, Any]:
    """Engine vs HF on one workload, alternating runs; throughput medians and output agreement.

    A compiled target (``--decode compiled``) first runs the workload once untimed, so its graphs
    are compiled before the timed runs; ``compile_seconds`` is what that took, and
    ``compile_seconds_in_runs`` what the timed runs still compiled (shapes the warm-up missed).
    """
    ours, theirs, ours_cpu, theirs_cpu, result, hf_out = [], [], [], [], None, None
    compiled = getattr(engine.target, "decode", None) == "compiled"
    before = compile_report(engine.target)["compile_seconds"]
    if compiled:
        engine.generate(prompts, generator=torch.Generator().manual_seed(seed))
    warm = compile_report(engine.target)["compile_seconds"]
    for r in range(repeats):
        gen = torch.Generator().manual_seed(seed + r)
        result, t, cpu = timed(lambda gen=gen: engine.generate(prompts, generator=gen))
        ours.append(result.stats.generated_tokens / t)
        ours_cpu.append(result.stats.generated_tokens / cpu)
        hf_out, t, cpu = timed(lambda r=r: hf_generate(model, tokenizer, prompts, engine.config, seed + r))
        theirs.append(sum(len(x) for x in hf_out) / t)
        theirs_cpu.append(sum(len(x) for x in hf_out) / cpu)
    same = sum(r.token_ids.tolist() == h for r, h in zip(result.rollouts, hf_out))
    return {
        "tokens_per_s": median(ours),
        "hf_tokens_per_s": median(theirs),
        "speedup_vs_hf": median(ours) / median(theirs),
        "speedup_vs_hf_cpu_time": median(ours_cpu) / median(theirs_cpu),
        "runs_tokens_per_s": ours,
        "runs_hf_tokens_per_s": theirs,
        "runs_tokens_per_cpu_s": ours_cpu,
        "runs_hf_tokens_per_cpu_s": theirs_cpu,
        "identical_outputs": same,
        "requests": len(prompts),
        "compile_seconds": warm - before,
        "compile_seconds_in_runs": compile_report(engine.target)["compile_seconds"] - warm,
        "result": result,
    }


def plot(long_tail: RolloutResult | None, batches: list[dict[str, Any]], path: Path) -> Path:
    """Throughput per batch size; with a long-tail run also its length histogram and per-request timeline."""
    panels = 3 if long_tail is not None else 1
    fig, axes = new_figure(1, panels, figsize=(5.3 * panels, 4.5), squeeze=False)
    c = axes[0, -1]
    xs = range(len(batches))
    c.bar([x - 0.2 for x in xs], [x["tokens_per_s"] for x in batches], width=0.4, label="RolloutEngine")
    c.bar([x + 0.2 for x in xs], [x["hf_tokens_per_s"] for x in batches], width=0.4, label="HF generate")
    c.set_xticks(list(xs), [str(x["batch_size"]) for x in batches])
    c.set(xlabel="batch size (greedy)", ylabel="tokens / s", title="Throughput")
    c.legend()
    if long_tail is not None:
        a, b = axes[0, 0], axes[0, 1]
        a.hist(long_tail.lengths.numpy(), bins=30, color="tab:blue")
        a.set(xlabel="response length (tokens)", ylabel="requests", title="Long-tail rollout: lengths")
        order = sorted(range(len(long_tail.rollouts)), key=lambda i: long_tail.rollouts[i].finish_time)
        for y, i in enumerate(order):
            r = long_tail.rollouts[i]
            b.barh(
                y, r.finish_time - r.first_token_time, left=r.first_token_time, height=1.0, color="tab:orange"
            )
        b.set(xlabel="seconds", ylabel="request (by finish time)", title="Per-request timeline")
    return save_figure(fig, path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.speculative:
        from benchmarks import speculative

        return speculative.run(args)
    loaded = load_model(args.model, dtype=args.dtype)
    if loaded.tokenizer is None:
        raise ValueError(f"--model {args.model!r} has no tokenizer: the benchmark needs real task prompts")
    model, tokenizer = loaded.model, loaded.tokenizer
    target = HFTarget(model, decode=args.decode)
    target.set_weight_layout(args.weight_layout)
    count = max([*args.batch_sizes, args.long_tail_requests, 1])
    prompts = task_prompts(tokenizer, args.task, count, seed=args.seed)
    greedy = RolloutEngine(target, RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=0.0))

    batches = []
    for bs in args.batch_sizes:
        print(f"[bench rollout] batch {bs}, greedy, {args.max_new_tokens} new tokens ...", flush=True)
        out = _compare(greedy, model, tokenizer, prompts[:bs], args.repeats, args.seed)
        out.pop("result")
        batches.append({"batch_size": bs, **out})
        print(
            f"  engine {out['tokens_per_s']:.1f} tok/s, HF {out['hf_tokens_per_s']:.1f} tok/s, "
            f"x{out['speedup_vs_hf']:.2f} (CPU time x{out['speedup_vs_hf_cpu_time']:.2f}), "
            f"identical {out['identical_outputs']}/{bs}"
            + (f", compiled in {out['compile_seconds']:.1f} s (untimed)" if out["compile_seconds"] else ""),
            flush=True,
        )

    long_tail = None
    payload: dict[str, Any] = {
        "benchmark": "rollout",
        "command": "python -m benchmarks " + " ".join(getattr(args, "argv", [])),
        "model": args.model,
        "dtype": args.dtype,
        "weight_layout": target.weight_layout,
        "decode": args.decode,
        "task": args.task,
        "machine": machine_info(),
        "batches": batches,
    }
    if args.long_tail_requests:
        n = args.long_tail_requests
        sampled = RolloutEngine(
            target, replace(greedy.config, max_new_tokens=args.long_tail_max_new, temperature=1.0)
        )
        print(
            f"[bench rollout] long tail: {n} requests, T=1, up to {args.long_tail_max_new} tokens ...",
            flush=True,
        )
        out = _compare(sampled, model, tokenizer, prompts[:n], args.repeats, args.seed)
        long_tail = out.pop("result")
        out.pop("identical_outputs")  # sampled with different RNGs: lengths differ, only speed compares
        payload["long_tail"] = {
            **out,
            "lengths": length_summary(long_tail.lengths),
            "max_new_tokens": args.long_tail_max_new,
        }
        print(
            f"  engine {out['tokens_per_s']:.1f} tok/s, HF {out['hf_tokens_per_s']:.1f} tok/s, "
            f"x{out['speedup_vs_hf']:.2f}; lengths {payload['long_tail']['lengths']}",
            flush=True,
        )

    payload.update(compile_report(target))
    json_path = write_json(args.json, payload)
    plot_path = Path(args.plot) if args.plot else json_path.with_suffix(".png")
    payload["plot"] = str(plot(long_tail, batches, plot_path))
    write_json(json_path, payload)
    print(f"[bench rollout] wrote {json_path}", flush=True)
    return payload
