"""``python -m benchmarks activation-checkpointing``: budgeted checkpointing against static every-other-block.

A randomly initialised Llama (transformers ``LlamaConfig``, real layer structure, CPU) trains with
AdamW on random tokens at a sequence length where activations dominate memory. Variants:

* ``none``: no checkpointing; ``all``: every decoder layer checkpointed (the memory floor);
* ``static``: every other decoder layer (0, 2, 4, ...), the baseline;
* ``optimal-layers``: the exact DP over decoder layers at static's measured peak;
* ``optimal-sublayers`` / ``greedy-sublayers``: the DP / the cost-benefit greedy over the attention
  and MLP sub-blocks of every layer, same budget.

Peak memory is measured, not estimated, by :class:`~tlt_lightning.efficiency.memory.ActivationMemoryMeter`
(live bytes of every tensor the forward pass and the recomputation create, by storage, from
creation to release; a dispatch mode, so it works on CPU where there is no
``max_memory_allocated``; gradients and optimizer state are the same for every variant and not
counted). Throughput is train steps per second (forward, backward, AdamW), variants interleaved
round by round (A B C ... A B C ...), median over rounds, wall clock and process CPU time.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine_info, new_figure, save_figure, timed, write_json
from tlt_lightning.efficiency.activation_checkpointing import (
    apply_activation_checkpointing,
    find_blocks,
    plan_greedy,
    plan_optimal,
    plan_static,
    profile_blocks,
)
from tlt_lightning.efficiency.memory import measure_step

__all__ = ["build_model", "run"]


def build_model(layers: int, hidden: int, vocab: int, attn: str, seed: int = 0) -> torch.nn.Module:
    """A Llama-architecture causal LM with random weights: SmolLM2's shape ratios, smaller."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden % 64:
        raise ValueError(f"hidden must be a multiple of 64 (heads of 64), got {hidden}")
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=(hidden * 8 // 3 + 63) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attn_implementation=attn,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).train()


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("layers", "repeats", "steps", "seq_len", "batch_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    model = build_model(args.layers, args.hidden, args.vocab, args.attn, args.seed)
    ids = torch.randint(
        0, args.vocab, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(args.seed)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def forward() -> torch.Tensor:
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        forward().backward()
        opt.step()

    layers = find_blocks(model, "model.layers.*")
    subs = find_blocks(model, ["model.layers.*.self_attn", "model.layers.*.mlp"])
    layer_profile, _, profile_s = timed(lambda: profile_blocks(layers, forward, repeats=3))
    sub_profile = profile_blocks(subs, forward, repeats=3)

    static = plan_static(layer_profile)
    with apply_activation_checkpointing(layers, static):
        budget = measure_step(forward).peak_bytes  # static's measured peak: the budget of the others
    opt.zero_grad(set_to_none=True)
    variants = {
        "none": (layers, layer_profile.plan([False] * len(layers), "none")),
        "static": (layers, static),
        "optimal-layers": (layers, plan_optimal(layer_profile, budget)),
        "optimal-sublayers": (subs, plan_optimal(sub_profile, budget)),
        "greedy-sublayers": (subs, plan_greedy(sub_profile, budget)),
        "all": (layers, layer_profile.plan([True] * len(layers), "all")),
    }
    sweep = _sweep(layer_profile, sub_profile, budget)
    results = _measure_peaks(variants, forward, lambda: opt.zero_grad(set_to_none=True), subs)
    _time_steps(variants, results, train_step, args.repeats, args.steps)
    base, none = results["static"], results["none"]
    payload = {
        "benchmark": "activation_checkpointing",
        "command": "python -m benchmarks " + " ".join(getattr(args, "argv", [])),
        "machine": machine_info(),
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "vocab": args.vocab,
            "attn": args.attn,
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        },
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "repeats": args.repeats,
        "steps": args.steps,
        "budget_mb": budget / 2**20,
        "profile_seconds": profile_s,
        # No plan can beat "none" (no recomputation): the most any plan at static's memory could gain.
        "upper_bound_vs_static_cpu": none["steps_per_cpu_s"] / base["steps_per_cpu_s"],
        "layer_profile": [b._asdict() for b in layer_profile.blocks],
        "sublayer_profile": [b._asdict() for b in sub_profile.blocks],
        "variants": results,
        "sweep": sweep,
    }
    path = write_json(args.json, payload)
    plot_path = plot(results, sweep, Path(args.plot or Path(args.json).with_suffix(".png")), budget / 2**20)
    _print_results(results)
    print(f"[bench activation-checkpointing] wrote {path} and {plot_path}")
    return payload


def _sweep(layer_profile: Any, sub_profile: Any, budget: int) -> list[dict[str, Any]]:
    """Predicted only (no timing): the DP's recompute across budgets, where static has one point."""
    sweep = []
    lo, hi = layer_profile.min_peak_bytes, layer_profile.max_peak_bytes
    for b in sorted({int(lo + k / 10 * (hi - lo)) for k in range(11)} | {budget}):
        for blocks_name, profile in (("layers", layer_profile), ("sublayers", sub_profile)):
            if b >= profile.min_peak_bytes:
                p = plan_optimal(profile, b)
                sweep.append(
                    {
                        "blocks": blocks_name,
                        "budget_mb": b / 2**20,
                        "checkpointed": len(p.indices),
                        "predicted_recompute_ms": p.recompute_seconds * 1e3,
                    }
                )
    return sweep


def _measure_peaks(
    variants: dict[str, tuple[Any, Any]], forward: Any, zero_grad: Any, subs: Any
) -> dict[str, dict[str, Any]]:
    """Each variant's measured and predicted peak and its predicted recompute: the result entries."""
    results: dict[str, dict[str, Any]] = {}
    for name, (blocks, plan) in variants.items():
        with apply_activation_checkpointing(blocks, plan):
            report = measure_step(forward)
        zero_grad()
        results[name] = {
            "blocks": "sublayers" if blocks is subs else "layers",
            "checkpointed": plan.indices,
            "predicted_peak_mb": plan.peak_bytes / 2**20,
            "measured_peak_mb": report.peak_bytes / 2**20,
            "predicted_recompute_ms": plan.recompute_seconds * 1e3,
            "wall_s": [],
            "cpu_s": [],
        }
        print(
            f"[bench activation-checkpointing] {name}: checkpointed {plan.indices}, "
            f"peak {report.peak_bytes / 2**20:.1f} MiB"
        )
    return results


def _time_steps(
    variants: dict[str, tuple[Any, Any]],
    results: dict[str, dict[str, Any]],
    train_step: Any,
    repeats: int,
    steps: int,
) -> None:
    """Time ``steps`` train steps of each variant in turn, ``repeats`` times after a warm-up; adds the
    medians and the ratios to static to ``results``."""
    for blocks, plan in variants.values():  # warm-up: allocator and AdamW state
        with apply_activation_checkpointing(blocks, plan):
            train_step()
    for _ in range(repeats):
        for name, (blocks, plan) in variants.items():
            with apply_activation_checkpointing(blocks, plan):
                _, wall, cpu = timed(lambda: [train_step() for _ in range(steps)])
            results[name]["wall_s"].append(wall / steps)
            results[name]["cpu_s"].append(cpu / steps)
    for r in results.values():
        r["steps_per_s"] = 1 / statistics.median(r["wall_s"])
        r["steps_per_cpu_s"] = 1 / statistics.median(r["cpu_s"])
    base = results["static"]
    for r in results.values():
        r["throughput_vs_static"] = r["steps_per_s"] / base["steps_per_s"]
        r["throughput_vs_static_cpu"] = r["steps_per_cpu_s"] / base["steps_per_cpu_s"]
        r["peak_vs_static"] = r["measured_peak_mb"] / base["measured_peak_mb"]


def _print_results(results: dict[str, dict[str, Any]]) -> None:
    for name, r in results.items():
        print(
            f"[bench activation-checkpointing] {name:18s} peak {r['measured_peak_mb']:7.1f} MiB "
            f"({r['peak_vs_static']:.3f}x static)"
            f"  {r['steps_per_s']:.3f} steps/s  vs static: wall {r['throughput_vs_static']:.3f}"
            f" cpu {r['throughput_vs_static_cpu']:.3f}  recompute {r['predicted_recompute_ms']:.0f} ms"
        )


def plot(
    results: dict[str, dict[str, Any]], sweep: list[dict[str, Any]], path: Path, budget_mb: float
) -> Path:
    """Measured peak memory and throughput (CPU time) per variant; the DP's recompute across budgets."""
    names = list(results)
    colors = ["tab:gray", "tab:blue", "tab:green", "tab:olive", "tab:orange", "tab:red"]
    fig, (a, b, c) = new_figure(1, 3, figsize=(16, 4.3))
    a.bar(names, [results[n]["measured_peak_mb"] for n in names], color=colors)
    a.axhline(budget_mb, color="k", ls="--", lw=1, label="budget (static's peak)")
    a.set(ylabel="peak activation memory (MiB, measured)", title="Peak memory")
    a.legend()
    b.bar(names, [results[n]["steps_per_cpu_s"] for n in names], color=colors)
    b.set(ylabel="train steps / CPU second (median)", title="Throughput")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
    for kind, marker in (("layers", "o-"), ("sublayers", "s--")):
        pts = [s for s in sweep if s["blocks"] == kind]
        c.plot(
            [s["budget_mb"] for s in pts],
            [s["predicted_recompute_ms"] for s in pts],
            marker,
            drawstyle="steps-post",
            label=f"optimal ({kind})",
        )  # a step function of the budget
    st = results["static"]
    c.plot(
        [st["measured_peak_mb"]],
        [st["predicted_recompute_ms"]],
        "k*",
        ms=12,
        label="static every-other-layer",
    )
    c.set(
        xlabel="memory budget (MiB)",
        ylabel="recompute per step (ms, profiled)",
        title="Optimal plan across budgets",
    )
    c.legend()
    return save_figure(fig, path)
