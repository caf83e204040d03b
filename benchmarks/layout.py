"""``python -m benchmarks layout``: weight layouts side by side (``[out, in]``, ``[in, out]``, packed).

The same rollouts (same prompts, seeds and sampling) run once per layout, the layouts' order
rotated on every prompt group so that machine noise hits all alike; medians reported. Plain
decoding at each ``--batch-sizes`` and, with ``--drafter``, speculative decoding at batch 1 for each
``--arms``. The target and the drafter take the same layout (``set_weight_layout``); speedups are
against the first of ``--layouts``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    machine_info,
    median,
    new_figure,
    save_figure,
    task_prompts,
    timed,
    write_json,
)
from tlt_lightning.drafter import load_drafter
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.speculative import parse_arm

__all__ = ["run"]


def plot(payload: dict[str, Any], path: Path) -> Path:
    rows, layouts = payload["workloads"], payload["layouts"]
    fig, ax = new_figure(figsize=(max(6.0, 1.1 * len(rows)), 3.8))
    x = range(len(rows))
    width = 0.8 / len(layouts)
    for i, layout in enumerate(layouts):
        offset = (i - (len(layouts) - 1) / 2) * width
        ax.bar([j + offset for j in x], [r[f"{layout}_tokens_per_s"] for r in rows], width, label=layout)
        for j, r in enumerate(rows):
            if i > 0:
                ax.text(
                    j + offset,
                    r[f"{layout}_tokens_per_s"],
                    f"x{r[f'{layout}_speedup']:.2f}",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax.set_xticks(list(x), [r["workload"] for r in rows], fontsize=8)
    title = f"Weight layout, {payload['model']} {payload['dtype']}, T={payload['temperature']:g}"
    ax.set(ylabel="tokens / s", title=title)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _time_layouts(
    engine: Any, models: list[Any], prompts: list[list[int]], bs: int, layouts: list[str], repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Tokens/s and CPU seconds per token of ``engine`` in each layout (of every model in ``models``;
    ``None`` skipped), repeat ``r`` on the ``r``-th group of ``bs`` prompts, the layouts' order rotated."""
    tps: dict[str, list[float]] = {layout: [] for layout in layouts}
    cpu: dict[str, list[float]] = {layout: [] for layout in layouts}
    for r in range(repeats):
        group = prompts[r * bs : (r + 1) * bs]
        shift = r % len(layouts)
        for layout in layouts[shift:] + layouts[:shift]:
            for model in models:
                if model is not None:
                    model.set_weight_layout(layout)
            out, wall, cpu_s = timed(
                lambda group=group, r=r: engine.generate(group, generator=torch.Generator().manual_seed(r))
            )
            tps[layout].append(out.stats.generated_tokens / wall)
            cpu[layout].append(cpu_s / out.stats.generated_tokens)
    return tps, cpu


def run(args: argparse.Namespace) -> dict[str, Any]:
    layouts = list(dict.fromkeys(args.layouts))
    if len(layouts) < 2:
        raise ValueError(f"--layouts: name at least two different layouts to compare, got {args.layouts}")
    arms = [parse_arm(a) for a in args.arms] if args.drafter else []
    if None in arms:
        raise ValueError("--arms: name speculative strategies only (plain decoding is always timed)")
    loaded = load_model(args.model, dtype=args.dtype)
    if loaded.tokenizer is None:
        raise ValueError(f"--model {args.model!r} has no tokenizer: the benchmark needs real task prompts")
    target = HFTarget(loaded.model)
    cfg = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    workloads: list[tuple[str, int, Any]] = [
        (f"plain, batch {bs}", bs, RolloutEngine(target, cfg)) for bs in args.batch_sizes
    ]
    drafter = None
    if args.drafter:
        drafter = load_drafter(args.drafter, target).eval()
        workloads += [
            (f"{arm}, batch 1", 1, SpeculativeRolloutLoop(target, drafter, cfg, arm, threshold=2))
            for arm in arms
        ]
    prompts = task_prompts(
        loaded.tokenizer, args.task, max(bs for _, bs, _ in workloads) * args.repeats, args.seed
    )
    rows = []
    for name, bs, engine in workloads:
        print(f"[bench layout] {name}, {args.max_new_tokens} new tokens ...", flush=True)
        tps, cpu = _time_layouts(engine, [target, drafter], prompts, bs, layouts, args.repeats)
        row = {
            "workload": name,
            "batch_size": bs,
            **{f"{k}_tokens_per_s": median(v) for k, v in tps.items()},
            **{f"{k}_cpu_s_per_token": median(v) for k, v in cpu.items()},
        }
        base = layouts[0]
        for layout in layouts[1:]:
            row[f"{layout}_speedup"] = row[f"{layout}_tokens_per_s"] / row[f"{base}_tokens_per_s"]
            row[f"{layout}_speedup_cpu_time"] = (
                row[f"{base}_cpu_s_per_token"] / row[f"{layout}_cpu_s_per_token"]
            )
        rows.append(row)
        parts = [f"{base} {row[f'{base}_tokens_per_s']:.1f} tok/s"] + [
            f"{layout} {row[f'{layout}_tokens_per_s']:.1f} tok/s (x{row[f'{layout}_speedup']:.2f}, "
            f"CPU time x{row[f'{layout}_speedup_cpu_time']:.2f})"
            for layout in layouts[1:]
        ]
        print("  " + ", ".join(parts), flush=True)
    payload: dict[str, Any] = {
        "benchmark": "weight-layout",
        "command": "python -m benchmarks " + " ".join(getattr(args, "argv", [])),
        "model": args.model,
        "dtype": args.dtype,
        "task": args.task,
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "drafter": args.drafter,
        "layouts": layouts,
        "machine": machine_info(),
        "workloads": rows,
    }
    json_path = write_json(args.json, payload)
    payload["plot"] = str(plot(payload, Path(args.plot) if args.plot else json_path.with_suffix(".png")))
    write_json(json_path, payload)
    print(f"[bench layout] wrote {json_path}", flush=True)
    return payload
