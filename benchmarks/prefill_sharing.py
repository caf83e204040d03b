"""A GRPO rollout's prefill with and without sharing it between a group's copies of a prompt, side by side.

:class:`~tlt_lightning.rollout.RolloutEngine` prefills each distinct prompt once and copies its cache rows
to the group's other requests. Here the same engine also runs with every request prefilled on its own (the
engine before the sharing: each prompt its own "distinct" one), alternating round by round; the rollouts
generate one token, so each time is the prefill. ``--config`` gives the model, rollout dtype and decode
path, and the prompts (the fit config's task), each repeated ``--group-size`` times.

    python -m benchmarks.prefill_sharing --config configs/grpo_smollm2_longtail.yaml [--prompts 32]
        [--group-size 4] [--rounds 4] [--json docs/results/prefill_sharing.json]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch
import yaml

from benchmarks.common import machine_info, median, write_json
from benchmarks.lengths import _module
from tlt_lightning.rollout import RolloutEngine
from tlt_lightning.rollout import engine as engine_module

__all__ = ["main", "measure"]


def _per_request(ids: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every request its own prefill (no two prompts treated as the same)."""
    return list(ids), torch.arange(len(ids))


def measure(module, prompts: int, group_size: int, rounds: int) -> dict[str, list[float]]:
    """Per round, the prefill seconds of ``prompts`` x ``group_size`` requests, shared and per request
    (order alternating round by round; round ``r`` takes prompts ``r * prompts ...`` of the task)."""
    config = replace(module.rollout_config(), max_new_tokens=1)
    seconds: dict[str, list[float]] = {"shared": [], "per_request": []}
    size = len(module.prompt_source)
    for r in range(rounds):
        batch = [module.prompt_source.prompt_ids((r * prompts + i) % size) for i in range(prompts)]
        requests = [p for p in batch for _ in range(group_size)]
        for name in list(seconds)[:: 1 if r % 2 == 0 else -1]:
            distinct = engine_module._distinct if name == "shared" else _per_request
            with mock.patch.object(engine_module, "_distinct", distinct):
                result = RolloutEngine(module.rollout_target, config).generate(
                    requests, generator=torch.Generator().manual_seed(r)
                )
            seconds[name].append(result.stats.prefill_time)
    return seconds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="a fit config (model, rollout settings, task)")
    parser.add_argument("--prompts", type=int, default=32, help="distinct prompts per round")
    parser.add_argument("--group-size", type=int, default=4, help="copies of each prompt (GRPO's group)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="runs/bench/prefill_sharing.json")
    args = parser.parse_args(argv)
    for name in ("prompts", "group_size", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    torch.set_num_threads(args.threads)
    config = yaml.safe_load(Path(args.config).read_text())
    config.get("model", {}).pop("speculative", None)  # plain rollouts: no drafter to load
    module = _module(config)
    seconds = measure(module, args.prompts, args.group_size, args.rounds)
    shared, alone = median(seconds["shared"]), median(seconds["per_request"])
    payload = {
        "benchmark": "prefill_sharing",
        "command": "python -m benchmarks.prefill_sharing " + " ".join(argv if argv is not None else []),
        "config": args.config,
        "requests": args.prompts * args.group_size,
        "group_size": args.group_size,
        "rollout_dtype": str(module.rollout_dtype),
        "machine": machine_info(),
        "seconds": seconds,
        "median_seconds": {"shared": shared, "per_request": alone},
        "speedup": alone / shared,
    }
    write_json(args.json, payload)
    print(
        f"prefill of {payload['requests']} requests ({args.prompts} prompts x {args.group_size}): shared "
        f"{shared:.2f} s, per request {alone:.2f} s (medians of {args.rounds}): {alone / shared:.2f}x",
        flush=True,
    )
    return payload


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
