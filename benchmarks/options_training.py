"""The options of the training benchmarks (``e2e``, ``spot``, ``efficiency``,
``activation-checkpointing``); torch-free, as :mod:`benchmarks.options`, which lists them."""

from __future__ import annotations

from jsonargparse import ArgumentParser
from jsonargparse.typing import NonNegativeInt, PositiveInt

__all__ = [
    "EFFICIENCY_PARTS",
    "SPOT_PARTS",
    "bench_activation_checkpointing",
    "bench_e2e",
    "bench_efficiency",
    "bench_memory",
    "bench_spot",
]

# spot --parts (benchmarks.spot.PARTS)
SPOT_PARTS = ("packing", "preemption", "checkpoint", "ddp", "contention")
EFFICIENCY_PARTS = ("sampler", "distill", "qat")  # efficiency --part (benchmarks.efficiency.PARTS)
ROLLOUT_DECODES = ("auto", "hf", "lean", "compiled")  # e2e/spot --decode (rl.module_settings.ROLLOUT_DECODES)


def _rollout_decode(p: ArgumentParser) -> None:
    p.add_argument(
        "--decode",
        default="auto",
        choices=ROLLOUT_DECODES,
        help="the fits' rollout decode path (GRPOModule rollout_decode; auto: compiled where it pays)",
    )


def bench_activation_checkpointing(parser: ArgumentParser) -> None:
    parser.add_argument("--layers", type=PositiveInt, default=8)
    parser.add_argument("--hidden", type=PositiveInt, default=256, help="hidden size (heads of 64)")
    parser.add_argument("--vocab", type=PositiveInt, default=8192)
    parser.add_argument("--seq-len", type=PositiveInt, default=512)
    parser.add_argument("--batch-size", type=PositiveInt, default=2)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation")
    parser.add_argument("--repeats", type=PositiveInt, default=5, help="interleaved timing rounds")
    parser.add_argument("--steps", type=PositiveInt, default=2, help="train steps per variant and round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="runs/bench/activation_checkpointing.json")
    parser.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")


def bench_e2e(p: ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="registry name or local HF directory")
    p.add_argument("--task", default="countdown", help="reasoning-gym task (easy settings)")
    p.add_argument("--steps", type=PositiveInt, default=6, help="GRPO optimizer steps per run")
    p.add_argument("--prompts-per-step", type=PositiveInt, default=4)
    p.add_argument("--group-size", type=PositiveInt, default=8)
    p.add_argument("--max-new-tokens", type=PositiveInt, default=384)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument(
        "--micro-batch-size",
        type=PositiveInt,
        default=4,
        help="sequences per training forward/backward (bounds the [B, T, vocab] logits in memory)",
    )
    p.add_argument(
        "--rollout-dtype",
        default="bfloat16",
        choices=["float32", "bfloat16"],
        help="precision of the rollouts in both runs (the policy keeps float32 weights)",
    )
    p.add_argument(
        "--precision",
        default="bf16-mixed",
        choices=["32-true", "bf16-mixed"],
        help="Lightning precision of both runs' training step (bf16-mixed: autocast, fast on AMX CPUs)",
    )
    p.add_argument("--drafter", default=None, help="warmed-up drafter directory (default: a fresh drafter)")
    p.add_argument(
        "--threshold", type=PositiveInt, default=8, help="speculate below this many active requests"
    )
    p.add_argument(
        "--depth", type=PositiveInt, default=4, help="chain depth of the fixed strategy (without --bandit)"
    )
    p.add_argument("--bandit", action="store_true", help="choose the strategy with BEG-MAB (BanditCallback)")
    p.add_argument(
        "--drafter-steps",
        type=PositiveInt,
        default=4,
        help="drafter steps per RL step (single worker: paid for, no idle time to hide them)",
    )
    p.add_argument(
        "--drift-every",
        type=NonNegativeInt,
        default=0,
        help="probe the spot-trained vs a frozen drafter every N RL steps (DrafterDriftProbe; 0 = off)",
    )
    p.add_argument(
        "--drift-tokens", type=PositiveInt, default=128, help="response cap of the drift probe rollouts"
    )
    _rollout_decode(p)
    p.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer as a peer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", action="store_true", help="Lightning progress bars")
    p.add_argument("--out", default="runs/bench/e2e", help="working directory of the runs")
    p.add_argument("--json", default="runs/bench/e2e.json")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")
    g = p.add_argument_group(
        "a fit config (benchmarks/e2e_config.py): --steps, --out and --json apply, the rest is the config's"
    )
    g.add_argument("--config", default=None, help="run exactly this fit config with TLT and with TLT removed")
    g.add_argument("--devices", type=int, default=None, help="workers (default: the config's)")
    g.add_argument("--skip-steps", type=int, default=2, help="first steps left out of the medians")
    g.add_argument("--baseline-first", action="store_true", help="run the baseline first (default: TLT)")
    g.add_argument(
        "--frozen",
        action="store_true",
        help="also a third run: TLT with its drafter frozen (no spot training)",
    )
    g.add_argument(
        "--bracket",
        action="store_true",
        help="run the baseline again after the others: ratios against the mean of both, and the drift",
    )
    g.add_argument(
        "--peers",
        nargs="+",
        default=[],
        choices=["vllm", "trl"],
        help="also the job on peers (benchmarks/e2e_peers.py): vllm = our fit without TLT, its rollouts on "
        "vLLM; trl = TRL's GRPOTrainer on one worker's share of a step. A peer not installed is skipped",
    )
    g.add_argument(
        "--vllm-config",
        default="benchmarks/vllm_cpu_peer.yaml",
        help="fit config merged into the vllm peer's (model.rollout_backend: vllm and its settings)",
    )
    g.add_argument(
        "--vllm-python",
        default=None,
        help="Python of an environment with vLLM (default: this one if it has vLLM, else .venv-vllm)",
    )


def bench_memory(p: ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the fit config to run (TLT as written)")
    p.add_argument("--steps", type=PositiveInt, default=3, help="training steps")
    p.add_argument("--devices", type=int, default=None, help="workers (default: the config's)")
    p.add_argument("--out", default="runs/bench/memory", help="working directory of the run")
    p.add_argument("--json", default="runs/bench/memory.json")


def bench_spot(p: ArgumentParser) -> None:
    p.add_argument("--parts", nargs="+", default=list(SPOT_PARTS), choices=SPOT_PARTS)
    p.add_argument("--model", default="smollm2-135m", help="registry name or local HF directory")
    p.add_argument("--task", default="countdown", help="reasoning-gym task (easy settings)")
    p.add_argument("--drafter", default=None, help="warmed-up drafter directory (default: a fresh drafter)")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("packing")
    g.add_argument(
        "--rollouts-cache",
        default=None,
        help="a `drafter warmup --rollouts-cache` file to take rollouts from (eagle1 features recomputed)",
    )
    g.add_argument("--packing-rollouts", type=PositiveInt, default=64, help="rollouts per epoch")
    g.add_argument("--packing-budget", type=PositiveInt, default=1024, help="samples per packed row")
    g.add_argument("--packing-repeats", type=PositiveInt, default=3)
    g = p.add_argument_group("preemption")
    g.add_argument("--windows", type=PositiveInt, default=60, help="rollouts (training windows) to time")
    g = p.add_argument_group("checkpoint")
    g.add_argument(
        "--checkpoint-repeats", type=PositiveInt, default=5, help="sync / async saves to time (alternating)"
    )
    g = p.add_argument_group("ddp")
    g.add_argument("--steps", type=PositiveInt, default=5, help="GRPO steps per fit")
    g.add_argument("--prompts-per-step", type=PositiveInt, default=4, help="over both ranks")
    g.add_argument("--group-size", type=PositiveInt, default=8)
    g.add_argument("--max-new-tokens", type=PositiveInt, default=256)
    g.add_argument(
        "--threshold", type=PositiveInt, default=8, help="speculate below this many active requests"
    )
    g.add_argument("--depth", type=PositiveInt, default=6, help="chain depth")
    _rollout_decode(g)
    g.add_argument("--out", default="runs/bench/spot", help="working directory of the fits")
    g = p.add_argument_group("contention (--max-new-tokens: the decode's steps)")
    g.add_argument("--contention-repeats", type=PositiveInt, default=5, help="alone / beside pairs")
    g.add_argument(
        "--contention-decode", default="hf", choices=["hf", "lean", "compiled"], help="decode path"
    )
    g.add_argument(
        "--contention-arm",
        default=None,
        help="decode speculatively with this arm (chain4, ...) and --drafter",
    )
    g.add_argument(
        "--contention-train-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the trainer's target and drafter (float32: as the spot trainer's)",
    )
    p.add_argument("--json", default="runs/bench/spot.json")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")


def bench_efficiency(parser: ArgumentParser) -> None:
    parser.add_argument("--part", required=True, choices=EFFICIENCY_PARTS, help="which comparison to run")
    parser.add_argument("--task", default="basic_arithmetic", help="reasoning-gym task (TaskConfig names)")
    parser.add_argument(
        "--task-kwargs",
        default=None,
        help='JSON reasoning-gym settings (default: {"min_terms": 2, "max_terms": 3, "max_digits": 1})',
    )
    parser.add_argument("--train-size", type=PositiveInt, default=4096)
    parser.add_argument("--eval-size", type=PositiveInt, default=512)
    parser.add_argument("--batch-size", type=PositiveInt, default=32)
    parser.add_argument(
        "--steps",
        type=PositiveInt,
        default=None,
        help="learner / student steps (sampler: the token budget is steps x batch x mean length; "
        "default 400 sampler, 300 distill and qat)",
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--hidden",
        type=PositiveInt,
        default=None,
        help="learner / student width (default 128 sampler, 64 else)",
    )
    parser.add_argument(
        "--layers",
        type=PositiveInt,
        default=None,
        help="learner / student layers (default 4 sampler, 3 else)",
    )
    parser.add_argument("--evals", type=PositiveInt, default=5, help="evaluations along each run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seeds", type=PositiveInt, default=1, help="sampler: repeat every variant with this many seeds"
    )
    sampler = parser.add_argument_group("sampler")
    sampler.add_argument("--candidate-factor", type=float, default=10)
    sampler.add_argument("--temperature", type=float, default=1.0)
    sampler.add_argument("--proxy-hidden", type=PositiveInt, default=64)
    sampler.add_argument("--proxy-layers", type=PositiveInt, default=2)
    sampler.add_argument(
        "--holdout-steps", type=PositiveInt, default=300, help="training steps of the RHO-LOSS holdout proxy"
    )
    sampler.add_argument(
        "--rho-learner",
        action="store_true",
        help="RHO-LOSS scores with the learner's own loss (the paper's form; ~4x slower here) "
        "instead of the online proxy's",
    )
    teacher = parser.add_argument_group("distill / qat")
    teacher.add_argument("--teacher-hidden", type=PositiveInt, default=128)
    teacher.add_argument("--teacher-layers", type=PositiveInt, default=6)
    teacher.add_argument("--teacher-steps", type=PositiveInt, default=500)
    teacher.add_argument("--kd-temperature", type=float, default=2.0)
    teacher.add_argument("--hidden-weight", type=float, default=1.0)
    teacher.add_argument("--ce-weight", type=float, default=1.0)
    teacher.add_argument("--qat-steps", type=PositiveInt, default=150, help="qat: steps after the fp32 phase")
    teacher.add_argument("--qat-lr", type=float, default=1e-3)
    teacher.add_argument(
        "--group-size",
        type=PositiveInt,
        default=32,
        help="qat: INT4 group size (0: one scale per output channel)",
    )
    teacher.add_argument(
        "--scratch",
        action="store_true",
        help="qat: also fp32 / PTQ / QAT with one schedule, QAT under fake quantization from the start",
    )
    parser.add_argument("--json", default=None, help="default: runs/bench/efficiency_<part>.json")
    parser.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")
