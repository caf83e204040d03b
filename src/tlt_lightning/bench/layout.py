"""``tlt-lightning bench layout``: linear weights stored ``[out, in]`` vs ``[in, out]``, side by side.

The same rollouts (same prompts, seeds and sampling) run once per layout, the layouts alternated
on every prompt group so that machine noise hits both alike; medians reported. Plain decoding at
each ``--batch-sizes`` and, with ``--drafter``, speculative decoding at batch 1 for each ``--arms``.
Only the target's storage changes (:meth:`HFTarget.set_weight_layout`), not the drafter's.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from tlt_lightning.bench.common import machine_info, median, save_figure, task_prompts, timed, write_json
from tlt_lightning.drafter import load_drafter
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
from tlt_lightning.rollout.speculative import FixedChooser, SpeculativeRolloutLoop
from tlt_lightning.scheduling import parse_arm

__all__ = ["add_arguments", "run"]

LAYOUTS = ("out_in", "in_out")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="registry name or local HF directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--task", default="countdown", help="reasoning-gym task for the prompts")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 32, 128], help="plain decoding")
    p.add_argument("--max-new-tokens", type=int, default=64, help="per request")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--drafter", default=None, metavar="DIR", help="also time speculative decoding at batch 1")
    p.add_argument("--arms", nargs="+", default=["chain2", "chain6"], metavar="ARM",
                   help="speculative strategies at batch 1 (with --drafter)")
    p.add_argument("--repeats", type=int, default=3, help="prompt groups; layouts alternate on each")
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--json", default="runs/bench/layout.json", help="where to write the results")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")


def plot(payload: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["workloads"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 3.8))
    x = range(len(rows))
    for i, layout in enumerate(LAYOUTS):
        ax.bar([j + (i - 0.5) * 0.4 for j in x], [r[f"{layout}_tokens_per_s"] for r in rows], 0.4, label=layout)
    for j, r in enumerate(rows):
        ax.text(j, max(r["out_in_tokens_per_s"], r["in_out_tokens_per_s"]), f"x{r['speedup']:.2f}",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [r["workload"] for r in rows], fontsize=8)
    title = f"Weight layout, {payload['model']} {payload['dtype']}, T={payload['temperature']:g}"
    ax.set(ylabel="tokens / s", title=title)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    arms = [parse_arm(a) for a in args.arms] if args.drafter else []
    if None in arms:
        raise ValueError("--arms: name speculative strategies only (plain decoding is always timed)")
    loaded = load_model(args.model, dtype=args.dtype)
    if loaded.tokenizer is None:
        raise ValueError(f"--model {args.model!r} has no tokenizer: the benchmark needs real task prompts")
    target = HFTarget(loaded.model)
    cfg = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    workloads: list[tuple[str, int, Any]] = [(f"plain, batch {bs}", bs, RolloutEngine(target, cfg))
                                             for bs in args.batch_sizes]
    if args.drafter:
        drafter = load_drafter(args.drafter, target).eval()
        workloads += [(f"{arm}, batch 1", 1, SpeculativeRolloutLoop(target, drafter, cfg, FixedChooser(arm),
                                                                      threshold=2)) for arm in arms]
    prompts = task_prompts(loaded.tokenizer, args.task, max(bs for _, bs, _ in workloads) * args.repeats, args.seed)
    rows = []
    for name, bs, engine in workloads:
        print(f"[bench layout] {name}, {args.max_new_tokens} new tokens ...", flush=True)
        tps: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        cpu: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        for r in range(args.repeats):
            group = prompts[r * bs:(r + 1) * bs]
            for layout in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
                target.set_weight_layout(layout)
                out, wall, cpu_s = timed(lambda: engine.generate(group, generator=torch.Generator().manual_seed(r)))
                tps[layout].append(out.stats.generated_tokens / wall)
                cpu[layout].append(cpu_s / out.stats.generated_tokens)
        row = {"workload": name, "batch_size": bs, **{f"{k}_tokens_per_s": median(v) for k, v in tps.items()},
               **{f"{k}_cpu_s_per_token": median(v) for k, v in cpu.items()}}
        row["speedup"] = row["in_out_tokens_per_s"] / row["out_in_tokens_per_s"]
        row["speedup_cpu_time"] = row["out_in_cpu_s_per_token"] / row["in_out_cpu_s_per_token"]
        rows.append(row)
        print(f"  out_in {row['out_in_tokens_per_s']:.1f} tok/s, in_out {row['in_out_tokens_per_s']:.1f} tok/s: "
              f"x{row['speedup']:.2f} (CPU time x{row['speedup_cpu_time']:.2f})", flush=True)
    payload: dict[str, Any] = {
        "benchmark": "weight-layout",
        "command": "tlt-lightning " + " ".join(getattr(args, "argv", [])),
        "model": args.model, "dtype": args.dtype, "task": args.task, "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "drafter": args.drafter,
        "machine": machine_info(), "workloads": rows,
    }
    json_path = write_json(args.json, payload)
    payload["plot"] = str(plot(payload, Path(args.plot) if args.plot else json_path.with_suffix(".png")))
    write_json(json_path, payload)
    print(f"[bench layout] wrote {json_path}", flush=True)
    return payload
