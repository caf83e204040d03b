"""The options of every benchmark, as ``tlt-lightning bench NAME`` took them; torch-free (quick ``--help``).

One builder per benchmark adds its options to a :class:`tlt_lightning.cli_options.Parser`
(:mod:`benchmarks.__main__` builds the parser); ``BENCHMARKS`` lists name, help and builder.
"""

from __future__ import annotations

from argparse import SUPPRESS

from jsonargparse import ArgumentParser
from jsonargparse.typing import NonNegativeInt, PositiveInt

__all__ = ["BENCHMARKS", "DECODE_PATHS", "EFFICIENCY_PARTS", "SPOT_PARTS", "WEIGHT_LAYOUTS"]

# Choices of options, here so that the parser needs no torch (tests check they equal the library's).
DECODE_PATHS = ("hf", "lean", "compiled")  # tlt_lightning.models.DECODE_PATHS
WEIGHT_LAYOUTS = ("out_in", "in_out", "packed")  # tlt_lightning.models.WEIGHT_LAYOUTS
SPOT_PARTS = ("packing", "preemption", "checkpoint", "ddp")  # spot --parts (benchmarks.spot.PARTS)
EFFICIENCY_PARTS = ("sampler", "distill", "qat")  # efficiency --part (benchmarks.efficiency.PARTS)


def bench_rollout(p: ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="registry name or local HF directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--weight-layout",
        default="packed",
        choices=WEIGHT_LAYOUTS,
        help="layout of the linear weights (see `python -m benchmarks layout`)",
    )
    p.add_argument(
        "--decode",
        default="hf",
        choices=DECODE_PATHS,
        help="target decode path: transformers' modules, the lean forward (same outputs) or the lean "
        "forward compiled per shape bucket (fp32 greedy: same tokens; compile time reported apart)",
    )
    p.add_argument("--task", default="countdown", help="reasoning-gym task for the prompts")
    p.add_argument("--batch-sizes", type=PositiveInt, nargs="*", default=[1, 8, 32, 128])
    p.add_argument(
        "--max-new-tokens", type=PositiveInt, default=128, help="per request, fixed-batch workload"
    )
    p.add_argument(
        "--long-tail-requests", type=NonNegativeInt, default=128, help="0 skips the long-tail workload"
    )
    p.add_argument("--long-tail-max-new", type=PositiveInt, default=512)
    p.add_argument(
        "--repeats", type=PositiveInt, default=2, help="alternating runs per workload (medians reported)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="runs/bench/rollout.json", help="where to write the results")
    sd = p.add_argument_group("speculative decoding (--speculative)")
    sd.add_argument(
        "--speculative", action="store_true", help="compare plain decoding with speculative decoding"
    )
    sd.add_argument(
        "--drafter",
        nargs="+",
        default=None,
        metavar="DIR",
        help="drafter checkpoint directory (from `drafter warmup`); several: compared side by side "
        "(every arm of each, labelled DIRNAME/ARM), the long tail uses the first",
    )
    sd.add_argument(
        "--depth", type=PositiveInt, default=4, help="draft steps per speculation (chain length, tree depth)"
    )
    sd.add_argument("--topk", type=PositiveInt, default=1, help="children per tree node (1 = chain)")
    sd.add_argument(
        "--draft-tokens",
        type=PositiveInt,
        default=None,
        help="tree nodes verified per step (default: 2 x depth for trees)",
    )
    sd.add_argument(
        "--sampled",
        action="store_true",
        help="with --topk K >= 2: K sampled chains forking at the root (DraftSpec(sampled=True))",
    )
    sd.add_argument(
        "--arms",
        nargs="+",
        default=None,
        metavar="ARM",
        help="strategies to compare side by side instead of --depth/--topk/...: chain6, "
        "chain10@0.3 (stops below that confidence), chain6x2, tree4x2/8; the long tail "
        "uses the first",
    )
    sd.add_argument(
        "--threshold", type=PositiveInt, default=32, help="speculate below this many active requests"
    )
    sd.add_argument(
        "--temperature",
        type=float,
        nargs="+",
        default=[1.0],
        help="sampling temperature of the comparison; several: the fixed batches run at each "
        "and the plot shows the speedup against temperature (HF peers and the long tail: the first)",
    )
    sd.add_argument(
        "--assistant-layers",
        type=NonNegativeInt,
        default=6,
        help="batch-1 peer: HF assisted generation with the target's first N layers as the "
        "assistant (0 skips it)",
    )
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")


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


def bench_strategies(p: ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, help="drafter checkpoint directory (from `drafter warmup`)")
    p.add_argument("--model", default="smollm2-135m", help="registry name or local HF directory")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument(
        "--weight-layout",
        default="packed",
        choices=WEIGHT_LAYOUTS,
        help="layout of the linear weights (see `python -m benchmarks layout`)",
    )
    p.add_argument("--task", default="countdown", help="reasoning-gym task for the prompts")
    p.add_argument("--requests", type=PositiveInt, default=128, help="prompts in the long-tail rollout")
    p.add_argument(
        "--groups",
        type=PositiveInt,
        default=1,
        help="prompt groups of --requests each: every run rolls out all of them (totals reported)",
    )
    p.add_argument("--max-new-tokens", type=PositiveInt, default=512)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--threshold", type=PositiveInt, default=32, help="strategies apply below this many active requests"
    )
    p.add_argument(
        "--warm-rollouts",
        type=PositiveInt,
        default=1,
        help="bandit rollouts on other prompts before the measured ones",
    )
    p.add_argument("--epsilon", type=float, default=0.1, help="BEG-MAB exploration probability")
    p.add_argument(
        "--epsilon-half-life",
        type=PositiveInt,
        default=None,
        help="decay each bucket's epsilon with this half-life in decisions (default: constant)",
    )
    p.add_argument(
        "--bandits",
        nargs="+",
        default=["batch/1,2,5,21"],
        metavar="SPEC",
        help="BEG-MAB variants to run, as REWARD/THRESHOLDS: REWARD 'batch' (tokens/s of the "
        "step, the issue's) or 'request' (tokens/s per request, BEGMABStrategy(per_request="
        "True)), THRESHOLDS the bucket_thresholds, e.g. batch/1,2,5,21 request/1,2,3,5,8,12",
    )
    p.add_argument(
        "--arms",
        nargs="+",
        default=None,
        metavar="ARM",
        help="candidate arms of every bucket and the fixed runs, e.g. off chain2 chain4 chain6 "
        "(default: default_arms(): off, chains of 2/4/6, trees 4x2/8 and 5x4/16)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="runs/bench/strategies.json")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")


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
    p.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer as a peer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", action="store_true", help="Lightning progress bars")
    p.add_argument("--out", default="runs/bench/e2e", help="working directory of the runs")
    p.add_argument("--json", default="runs/bench/e2e.json")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")


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
    g.add_argument("--out", default="runs/bench/spot", help="working directory of the fits")
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


def bench_layout(p: ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="registry name or local HF directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--task", default="countdown", help="reasoning-gym task for the prompts")
    p.add_argument(
        "--batch-sizes", type=PositiveInt, nargs="+", default=[1, 4, 32, 128], help="plain decoding"
    )
    p.add_argument("--max-new-tokens", type=PositiveInt, default=64, help="per request")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--drafter", default=None, metavar="DIR", help="also time speculative decoding at batch 1")
    p.add_argument(
        "--arms",
        nargs="+",
        default=["chain2", "chain6"],
        metavar="ARM",
        help="speculative strategies at batch 1 (with --drafter)",
    )
    p.add_argument(
        "--layouts",
        nargs="+",
        default=["out_in", "packed"],
        choices=WEIGHT_LAYOUTS,
        help="layouts to compare; speedups are against the first",
    )
    p.add_argument(
        "--repeats", type=PositiveInt, default=3, help="prompt groups; the layouts' order rotates on each"
    )
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--json", default="runs/bench/layout.json", help="where to write the results")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")


def bench_peers(p: ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="registry name or local HF directory")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="both engines")
    p.add_argument(
        "--weight-layout",
        default="packed",
        help="our engine's weight layout (see `python -m benchmarks layout`)",
    )
    p.add_argument(
        "--decode",
        default="hf",
        choices=DECODE_PATHS,
        help="our engine's decode path (see `rollout --decode`); compile time reported apart",
    )
    p.add_argument(
        "--drafter", default="examples/drafters/smollm2-countdown", help="drafter checkpoint directory"
    )
    p.add_argument(
        "--k",
        type=PositiveInt,
        default=3,
        help="drafted tokens per step: our chain{k}, vLLM num_speculative_tokens",
    )
    p.add_argument("--task", default="countdown", help="reasoning-gym task for the prompts")
    p.add_argument("--batch-sizes", type=PositiveInt, nargs="*", default=[1, 8, 32])
    p.add_argument(
        "--max-new-tokens", type=PositiveInt, default=128, help="fixed-batch workload, EOS ignored"
    )
    p.add_argument(
        "--sampled-batch-sizes",
        type=PositiveInt,
        nargs="*",
        default=[1],
        help="fixed batches at T=1: ours and ours-sd vs vLLM plain (none: skipped)",
    )
    p.add_argument("--long-tail-requests", type=NonNegativeInt, default=128, help="0 skips the long tail")
    p.add_argument("--long-tail-max-new", type=PositiveInt, default=512)
    p.add_argument(
        "--threshold",
        type=PositiveInt,
        default=32,
        help="ours-sd in the long tail: speculate below this many active",
    )
    p.add_argument(
        "--repeats", type=PositiveInt, default=3, help="alternating runs per workload (medians reported)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-speculative", dest="speculative", action="store_false", help="skip the speculative phase"
    )
    v = p.add_argument_group("vLLM worker")
    v.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="Python of vLLM's environment")
    v.add_argument("--vllm-eager", action="store_true", help="enforce_eager (faster start, slower decoding)")
    v.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.2,
        help="on a CPU: share of the NUMA node's memory for vLLM's KV cache",
    )
    v.add_argument("--max-model-len", type=PositiveInt, default=2048)
    v.add_argument(
        "--vllm-threads-bind",
        default="nobind",
        help="VLLM_CPU_OMP_THREADS_BIND for the worker ('nobind': OMP_NUM_THREADS threads, unpinned)",
    )
    v.add_argument("--worker-command", nargs="+", default=None, help=SUPPRESS)  # tests: a fake worker
    p.add_argument("--workdir", default="runs/bench/peers", help="served copies, drafter export, worker logs")
    p.add_argument("--json", default="runs/bench/peers.json", help="where to write the results")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")


def bench_bandit(p: ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=8000)  # checked by the benchmark (a ValueError)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="runs/bench/bandit.json")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")


# (name, help, options, "module:function" that runs it with the parsed options)
BENCHMARKS = (
    ("rollout", "RolloutEngine vs HF generate", bench_rollout, "benchmarks.rollout:run"),
    (
        "bandit",
        "strategy bandits on a simulated environment with a known optimum",
        bench_bandit,
        "benchmarks.bandit:run",
    ),
    (
        "activation-checkpointing",
        "budgeted (DP) vs static every-other-layer activation checkpointing",
        bench_activation_checkpointing,
        "benchmarks.activation_checkpointing:run",
    ),
    (
        "strategies",
        "BEG-MAB vs every fixed SD arm vs no SD on a real long-tail rollout",
        bench_strategies,
        "benchmarks.strategies:run",
    ),
    ("e2e", "GRPO steps with TLT vs the identical run without it", bench_e2e, "benchmarks.e2e:run"),
    (
        "spot",
        "spot drafter training: packing vs padding, preemption latency, 2-rank DDP overhead",
        bench_spot,
        "benchmarks.spot:run",
    ),
    (
        "efficiency",
        "importance sampling / hierarchical distillation / INT4 QAT vs baselines",
        bench_efficiency,
        "benchmarks.efficiency:run",
    ),
    (
        "layout",
        "weight layouts ([out, in], [in, out], packed) side by side: plain and speculative decoding",
        bench_layout,
        "benchmarks.layout:run",
    ),
    (
        "peers",
        "our engine (plain, speculative) vs vLLM in its own venv, side by side",
        bench_peers,
        "benchmarks.peers:run",
    ),
)
