"""The options of every benchmark, as ``tlt-lightning bench NAME`` took them; torch-free (quick ``--help``).

One builder per benchmark adds its options to a :class:`tlt_lightning.cli_options.Parser`
(:mod:`benchmarks.__main__` builds the parser); ``BENCHMARKS`` lists name, help and builder. The
training benchmarks' builders are in :mod:`benchmarks.options_training`.
"""

from __future__ import annotations

from argparse import SUPPRESS

from jsonargparse import ArgumentParser
from jsonargparse.typing import NonNegativeInt, PositiveInt

from benchmarks.options_training import (
    EFFICIENCY_PARTS,
    SPOT_PARTS,
    bench_activation_checkpointing,
    bench_e2e,
    bench_efficiency,
    bench_memory,
    bench_spot,
)

# SPOT_PARTS and EFFICIENCY_PARTS are re-exported (defined in options_training, with their benchmarks).
__all__ = ["BENCHMARKS", "DECODE_PATHS", "EFFICIENCY_PARTS", "SPOT_PARTS", "WEIGHT_LAYOUTS"]

# Choices of options, here so that the parser needs no torch (tests check they equal the library's).
DECODE_PATHS = ("hf", "lean", "compiled")  # tlt_lightning.models.DECODE_PATHS
WEIGHT_LAYOUTS = ("out_in", "in_out", "packed")  # tlt_lightning.models.WEIGHT_LAYOUTS


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
        "(default: default_arms(): off, chains of 1/2/4, trees 4x2/8 and 5x4/15)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="runs/bench/strategies.json")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")


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


def bench_lengths(p: ArgumentParser) -> None:
    p.add_argument(
        "--config", default="configs/grpo_smollm2_longtail.yaml", help="the fit config whose rollouts to draw"
    )
    p.add_argument(
        "--drafter",
        default=None,
        help="drafter directory (default: the config's SpotDrafterCallback start or its "
        "speculative.drafter_path)",
    )
    p.add_argument(
        "--arms",
        nargs="+",
        default=["off", "chain2", "chain4", "begmab"],
        help="'off' (plain decoding, the reference) first, then draft arms (chain2, tree4x2/8, ...), "
        "begmab (BEG-MAB choosing, trying every arm) or crossover (BEG-MAB with this machine's step "
        "costs, as in the fit with compiled rollouts)",
    )
    p.add_argument("--groups", type=int, default=12, help="prompt groups; group g samples with seed + g")
    p.add_argument("--prompts", type=int, default=32, help="prompts per group (the config's, in order)")
    p.add_argument(
        "--group-size", type=PositiveInt, default=None, help="samples per prompt (default: the config's)"
    )
    p.add_argument(
        "--threshold", type=PositiveInt, default=None, help="speculate below this many active requests "
        "(default: the config's)"
    )  # fmt: skip
    p.add_argument("--permutations", type=int, default=9999, help="sign patterns of the paired tests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="runs/bench/lengths.json")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")


def bench_bandit(p: ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=8000)
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
        "lengths",
        "a fit config's rollouts with and without speculation: lengths, cap hits and rewards alike?",
        bench_lengths,
        "benchmarks.lengths:run",
    ),
    ("memory", "a fit's memory by part and by phase", bench_memory, "benchmarks.memory:run"),
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
