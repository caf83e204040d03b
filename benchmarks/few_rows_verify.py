"""Batch-1 rollouts, plain and speculative, with the one-row verify graphs on ``few_rows_linear`` or oneDNN.

A compiled target's graphs of one row and several tokens (a verify at batch 1) multiply by
:func:`tlt_lightning.kernels.few_rows_linear` (``CompileConfig.few_rows_linear``); here a second compiled
target over the same weights multiplies by oneDNN's packed product instead. Round by round (the two in
alternating order) both decode the same ``--prompts`` prompts of the config's task one at a time, plain and
with each ``--arms`` chain, with the config's drafter (its ``SpotDrafterCallback`` start); decode tokens
per CPU second, medians over rounds.

    python -m benchmarks.few_rows_verify --config configs/grpo_smollm2_longtail.yaml [--arms chain2 chain4]
        [--prompts 6] [--rounds 3] [--max-new-tokens 160] [--json docs/results/few_rows_verify.json]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch
import yaml

from benchmarks.common import machine_info, median, write_json
from benchmarks.e2e_config import absolute_drafter_paths
from benchmarks.lengths import _drafting, _module
from tlt_lightning.models import HFTarget
from tlt_lightning.rl.rollout_models import warm_up_rollouts
from tlt_lightning.rollout import RolloutEngine
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.speculative import Arm, arm_key, parse_arm

__all__ = ["main", "measure"]


def _rate(target: HFTarget, drafter, config, arm: Arm, prompts: list[list[int]], seed: int) -> float:
    """Decode tokens per CPU second of ``prompts`` decoded one at a time with ``arm`` (``None``: plain)."""
    tokens = seconds = 0.0
    for i, prompt in enumerate(prompts):
        backend = (
            RolloutEngine(target, config)
            if arm is None
            else SpeculativeRolloutLoop(target, drafter, config, arm, threshold=2)
        )
        stats = backend.generate([prompt], generator=torch.Generator().manual_seed(seed + i)).stats
        tokens, seconds = tokens + sum(stats.step_tokens), seconds + sum(stats.step_cpu_times)
    return tokens / seconds if seconds > 0 else 0.0


def measure(
    module, arms: list[Arm], prompts: int, rounds: int, max_new_tokens: int
) -> dict[str, list[float]]:
    """Per round and ``"<kernel|onednn> <arm>"``, decode tokens per CPU second (round ``r``: prompts
    ``r * prompts ...``)."""
    kernel = module.rollout_target
    compile_config = kernel.compile_config
    targets = {"kernel": kernel}
    if compile_config is not None:
        targets["onednn"] = HFTarget(
            kernel.model, decode="compiled", compile_config=replace(compile_config, few_rows_linear=False)
        )
    config = replace(module.rollout_config(), max_new_tokens=max_new_tokens)
    drafter, source = module.drafter.eval(), module.prompt_source
    for target in targets.values():  # compiled before the timed rounds
        warm_up_rollouts(target, config, [source.prompt_ids(0)], drafter, [a for a in arms if a is not None])
    rates: dict[str, list[float]] = {}
    for r in range(rounds):
        batch = [source.prompt_ids((r * prompts + i) % len(source)) for i in range(prompts)]
        for name in list(targets)[:: 1 if r % 2 == 0 else -1]:
            for arm in arms:
                rate = _rate(targets[name], drafter, config, arm, batch, seed=r * prompts)
                rates.setdefault(f"{name} {arm_key(arm)}", []).append(rate)
    return rates


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config", required=True, help="a fit config (model, rollout settings, task, drafter)"
    )
    parser.add_argument("--arms", nargs="+", default=["chain2", "chain4"], help="speculative arms")
    parser.add_argument("--prompts", type=int, default=6, help="prompts per round, decoded one at a time")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="runs/bench/few_rows_verify.json")
    args = parser.parse_args(argv)
    for name in ("prompts", "rounds", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    arms = [None, *(parse_arm(a) for a in args.arms)]
    torch.set_num_threads(args.threads)
    path = Path(args.config)
    module = _module(_drafting(absolute_drafter_paths(yaml.safe_load(path.read_text()), path.parent), None))
    if module.drafter is None:
        parser.error(f"--config {path} names no drafter")
    rates = measure(module, arms, args.prompts, args.rounds, args.max_new_tokens)
    medians = {key: median(values) for key, values in rates.items()}
    speedups = {
        key: medians[key] / medians[key.split()[0] + " off"] for key in medians if not key.endswith(" off")
    }
    payload = {
        "benchmark": "few_rows_verify",
        "command": "python -m benchmarks.few_rows_verify " + " ".join(argv if argv is not None else []),
        "config": args.config,
        "rollout_dtype": str(module.rollout_dtype),
        "rollout_decode": module.rollout_decode,
        "machine": machine_info(),
        "tokens_per_cpu_s": rates,
        "median_tokens_per_cpu_s": medians,
        "speculative_vs_plain": speedups,
    }
    write_json(args.json, payload)
    for key, value in speedups.items():
        print(f"[few_rows_verify] {key}: {medians[key]:.1f} tokens/CPU s, {value:.3f}x plain", flush=True)
    return payload


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
