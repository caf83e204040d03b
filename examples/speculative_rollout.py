"""Lossless speculative rollouts on the real SmolLM2-135M with a warmed-up drafter.

    python examples/speculative_rollout.py                    # the drafter shipped in examples/drafters/
    python examples/speculative_rollout.py runs/drafter/DIR   # one of yours (`tlt-lightning drafter warmup`)

Samples the same prompts with plain decoding and with speculative decoding, prints both rollouts'
throughput and the drafter's mean accept length. Both sample from exactly the same distribution.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tlt_lightning.drafter import load_drafter
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rl import TaskConfig, TaskDataset
from tlt_lightning.rollout import RolloutConfig, RolloutEngine, SpeculativeRolloutLoop
from tlt_lightning.speculative import DraftSpec


def main(drafter_dir: str, max_new_tokens: int = 256) -> None:
    torch.set_num_threads(1)
    loaded = load_model("smollm2-135m")
    target = HFTarget(loaded.model)
    drafter = load_drafter(drafter_dir, target).eval()
    tasks = TaskDataset(TaskConfig(name="countdown", size=8, seed=1), loaded.tokenizer)
    prompts = [list(tasks[i].input_ids) for i in range(len(tasks))]
    config = RolloutConfig(max_new_tokens=max_new_tokens, temperature=1.0)

    plain = RolloutEngine(target, config).generate(prompts, generator=torch.Generator().manual_seed(0))
    loop = SpeculativeRolloutLoop(target, drafter, config, DraftSpec(6), threshold=8)
    spec = loop.generate(prompts, generator=torch.Generator().manual_seed(0), progress=True)
    print(f"plain:       {plain.stats.tokens_per_s:6.1f} tokens/s")
    print(
        f"speculative: {spec.stats.tokens_per_s:6.1f} tokens/s, mean accept length "
        f"{spec.stats.mean_accept_length:.2f}"
    )
    print(loaded.tokenizer.decode(spec.rollouts[0].token_ids))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent / "drafters" / "smollm2-countdown"))
