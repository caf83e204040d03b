"""The ``tlt-lightning`` command line: one jsonargparse parser for every subcommand.

Building it imports nothing heavy (no torch, transformers or lightning), so ``--help`` at every level
is quick; :mod:`tlt_lightning.cli` imports a command's implementation only when it runs. ``fit`` is
listed here but parsed by LightningCLI (:mod:`tlt_lightning.fit`); ``bench`` is listed too, but only
says where the benchmarks went (``python -m benchmarks NAME`` from a checkout, which reuses
:class:`Parser`).
"""

from __future__ import annotations

import difflib
import itertools
import re
import sys
from argparse import SUPPRESS
from typing import Any, NoReturn

from jsonargparse import ArgumentParser
from jsonargparse.typing import NonNegativeInt, PositiveInt

__all__ = ["BENCH_MOVED", "COMMANDS", "GROUPS", "TOP_COMMANDS", "Parser", "build_parser", "plain"]

# What `tlt-lightning bench ...` answers (exit status 2): the benchmarks are not in the package.
BENCH_MOVED = (
    "tlt-lightning bench: the benchmarks moved out of the package; from a checkout run "
    "`python -m benchmarks NAME [options]` (python -m benchmarks --help lists them)"
)


def plain(text: str) -> str:
    """``text`` without reStructuredText markup, for ``--help``.

    Example:
        >>> plain("see :class:`~tlt_lightning.fit.GRPOCLI` and ``--threads``")
        'see GRPOCLI and --threads'
    """
    text = re.sub(r":\w+:`~?(?:[\w.]*\.)?([^`]+)`", r"\1", text)
    return text.replace("``", "")


class Parser(ArgumentParser):
    """jsonargparse's parser without prefix abbreviations (``--thread`` is an error, not ``--threads``),
    with plain-text help, whose errors are a few lines (the error, the closest valid option, where the
    help is) instead of the usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        if kwargs.get("description"):
            kwargs["description"] = plain(kwargs["description"])
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("help") and kwargs["help"] is not SUPPRESS:
            kwargs["help"] = plain(kwargs["help"])
        return super().add_argument(*args, **kwargs)

    def parse_args(self, args: Any = None, *more: Any, **kwargs: Any) -> Any:
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, *more, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        prog = self.prog.replace(" [options]", "")
        lines = [f"{prog}: error: {message}"]
        options = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        # The flags the message names, else (a misspelt global option makes argparse complain about
        # the command) the leading flags of the command line.
        argv = getattr(self, "_argv", [])
        leading = [a.split("=")[0] for a in itertools.takewhile(lambda a: a.startswith("-"), argv)]
        for flag in re.findall(r"(--[\w-]+(?:\.[\w-]+)*)", message) or leading:
            if flag not in options and (close := difflib.get_close_matches(flag, options, n=1)):
                lines.append(f"  unknown option {flag}: did you mean {close[0]}?")
                break
        lines.append(f"  see: {prog} --help")
        print("\n".join(lines), file=sys.stderr)
        raise SystemExit(2)


def drafter_warmup(p: ArgumentParser) -> None:
    _warmup_sampling(p)
    _warmup_training(p)
    _warmup_run_files(p)


def _warmup_sampling(p: ArgumentParser) -> None:
    """The warm-up's target, task and sampling options."""
    p.add_argument("--model", default="smollm2-135m", help="registry name or local HF directory")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="target dtype while sampling the rollouts (bfloat16 is much faster on CPUs with AMX)",
    )
    p.add_argument("--task", default="basic_arithmetic", help="reasoning-gym task for the prompts")
    p.add_argument(
        "--task-config",
        default=None,
        metavar="FIT_YAML",
        help="render the prompts as this fit config's model.task does (task, system prompt, settings), "
        "instead of --task with the default prompt",
    )
    p.add_argument("--prompts", type=PositiveInt, default=256, help="task prompts to sample")
    p.add_argument("--samples", type=PositiveInt, default=1, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=PositiveInt, default=256)
    p.add_argument("--temperature", type=float, default=1.0)


def _warmup_training(p: ArgumentParser) -> None:
    """The warm-up's drafter and training options."""
    p.add_argument("--kind", default="eagle1", choices=["eagle1", "eagle3"])
    p.add_argument("--draft-vocab", type=NonNegativeInt, default=8192, help="0 = the full vocabulary")
    p.add_argument("--steps", type=int, default=1000)  # checked by the warm-up (a ValueError)
    p.add_argument(
        "--batch-size", type=PositiveInt, default=8, help="sequences (with --pack: packed rows) per step"
    )
    p.add_argument(
        "--max-len", type=PositiveInt, default=256, help="samples per sequence (longer ones are cut)"
    )
    p.add_argument(
        "--pack",
        type=NonNegativeInt,
        default=0,
        metavar="BUDGET",
        help="pack the training sequences into rows of BUDGET samples (no padding; 0 = pad)",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--train-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="bfloat16: autocast the training steps (the drafter keeps fp32 weights; ~2x faster "
        "on CPUs with bf16 matrix instructions)",
    )
    p.add_argument(
        "--lr-warmup",
        type=NonNegativeInt,
        default=0,
        help="steps of linear learning-rate warm-up (use ~50 with --init-from)",
    )
    p.add_argument("--unroll", type=PositiveInt, default=1, help="multi-step unroll during training")
    p.add_argument(
        "--accept-weight",
        type=float,
        default=0.0,
        help="weight of the total-variation term 1 - sum(min(p, q)), which trains for the "
        "acceptance of sampled drafts (0 = EAGLE's objective only)",
    )
    p.add_argument(
        "--save-every",
        type=NonNegativeInt,
        default=0,
        metavar="N",
        help=(
            "also save the drafter to --out every N steps (a crash keeps the last save; 0 = at the end only)"
        ),
    )


def _warmup_run_files(p: ArgumentParser) -> None:
    """The warm-up's batching and seed, and the files it reads and writes."""
    p.add_argument("--rollout-batch", type=PositiveInt, default=64, help="requests per rollout call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/drafter/warmup", help="output directory")
    p.add_argument(
        "--init-from",
        default=None,
        help="drafter checkpoint directory to continue training (its kind and draft vocabulary win)",
    )
    p.add_argument(
        "--rollouts-cache",
        default=None,
        help="file to reuse rollouts from (and save them to, after every --rollout-batch): retrain "
        "without resampling, or resume an interrupted sampling where it stopped (a safetensors "
        "rollout file, with the target features unless --cache-tokens-only)",
    )
    p.add_argument(
        "--cache-tokens-only",
        action="store_true",
        help="keep only tokens in --rollouts-cache (1.1 MB instead of 197 MB for 640 countdown "
        "rollouts; the features are recomputed when it is read, at ~2x the sampling rate)",
    )
    p.add_argument(
        "--more-rollouts",
        nargs="+",
        default=[],
        metavar="CACHE",
        help="rollout caches of other warm-ups (same model, dtype, task, sampling; other prompts or "
        "--seed) added to the training set; the held-out tenth stays this run's own",
    )


def drafter_evaluate(p: ArgumentParser) -> None:
    p.add_argument(
        "--drafter",
        nargs="+",
        required=True,
        metavar="DIR",
        help="drafter checkpoint directories (from `drafter warmup`), evaluated on the same positions",
    )
    p.add_argument(
        "--rollouts",
        required=True,
        metavar="FILE",
        help="a rollout file (`drafter warmup --rollouts-cache`); tokens-only files get their "
        "target features recomputed",
    )
    p.add_argument(
        "--first",
        type=NonNegativeInt,
        default=0,
        metavar="N",
        help="evaluate on the file's first N rollouts (0 = its first tenth: the held-out set of a "
        "warm-up that sampled this file)",
    )
    p.add_argument("--model", default=None, help="the target (default: the model the file was sampled with)")
    p.add_argument("--unroll", type=PositiveInt, default=3, help="draft steps evaluated per position")
    p.add_argument(
        "--max-len", type=PositiveInt, default=256, help="positions per rollout (the warm-up's default)"
    )
    p.add_argument("--batch-size", type=PositiveInt, default=8)
    p.add_argument(
        "--renormalise",
        action="store_true",
        help="acceptance against the target renormalised on the draft vocabulary (the warm-up's "
        "metric, an upper bound) instead of what speculative sampling accepts",
    )
    p.add_argument("--json", default=None, help="where to write the results")


def _export_drafter(p: ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        nargs="?",
        metavar="CHECKPOINT",
        help="drafter checkpoint directory (from `drafter warmup` or save_drafter), or an MLflow URI "
        "of one: models:/NAME/VERSION, models:/NAME@ALIAS, runs:/RUN_ID/PATH; not with --from-fit",
    )
    p.add_argument(
        "out",
        nargs="?",
        metavar="OUT",
        help="output directory (config.json, model.safetensors, README.md; with --from-fit: "
        "target/ (the policy, save_pretrained), drafter/, README.md, export.json)",
    )
    p.add_argument(
        "--from-fit",
        default=None,
        metavar="RUN_DIR_OR_CKPT",
        help="export the RL policy of a fit (its run directory or a .ckpt) and the drafter trained "
        "with it, together, as vLLM loads them (OUT/target, OUT/drafter)",
    )
    p.add_argument(
        "--engine",
        default="vllm",
        choices=["vllm", "sglang"],
        help="the serving engine that loads the export as it is (default: vllm)",
    )
    p.add_argument(
        "--kind",
        default=None,
        choices=["eagle1", "eagle3"],
        help="require this drafter kind (default: the checkpoint's; a checkpoint is never converted)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="the target the drafter drafts for: registry name or local HF directory "
        "(default: the checkpoint's warmup.json, else the registry model of its target's shape; "
        "with --from-fit: the policy's architecture and tokenizer, default the run's model)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="weight dtype of the export (default: the target's; with --from-fit, the run's)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of a tiny registry model's random weights")
    p.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow store of a models:/ or runs:/ CHECKPOINT (default: $MLFLOW_TRACKING_URI, "
        "else sqlite:///runs/mlflow.db, the store of `tlt-lightning fit`)",
    )


def _certify(p: ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="registry model (the target)")
    p.add_argument("--drafter", default=None, help="drafter checkpoint directory, or `random` (the default)")
    p.add_argument(
        "--arm",
        nargs="+",
        default=["off", "chain4"],
        help="arms to certify (`off`, `chain4`, `tree4x2/8`, ...)",
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--rows", type=int, default=4000, help="samples per site")
    p.add_argument("--depth", type=int, default=3, help="tokens per sample (>= 2 tests the joint law)")
    p.add_argument("--positions", type=int, nargs="+", default=[0, 16], help="where continuations are cut")
    p.add_argument("--task", default="countdown", help="reasoning-gym task of the prompts")
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--alpha", type=float, default=0.01, help="family-wise false alarm rate")
    p.add_argument("--power", type=float, default=0.9, help="power of the reported detectable deviation")
    p.add_argument(
        "--max-bins", type=PositiveInt, default=32, help="own bins per law at most (fewer: more power)"
    )
    p.add_argument("--chunk", type=int, default=512, help="rows per batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--backend",
        default="engine",
        choices=["engine", "vllm"],
        help="the stack under test: our engine, or vLLM (chain arms; run from vLLM's environment)",
    )
    p.add_argument("--out", default="runs/certify", help="output directory (one folder per arm)")


def _torchtune(p: ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="recipe YAML with _component_ nodes")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (torchtune syntax)")


# (group, command, help, options)
COMMANDS = (
    ("drafter", "warmup", "train a drafter on the target's rollouts", drafter_warmup),
    ("drafter", "evaluate", "compare drafters' acceptance on the same stored rollouts", drafter_evaluate),
)
TOP_COMMANDS = (
    (
        "export-drafter",
        (
            "write a drafter checkpoint in the EAGLE format of vLLM / SGLang; with --from-fit, "
            "a fit's policy and drafter together"
        ),
        _export_drafter,
    ),
    (
        "torchtune",
        (
            "GRPO from a torchtune recipe config, as `tune run tlt_lightning.recipes.grpo_torchtune` "
            "(needs the torchtune extra)"
        ),
        _torchtune,
    ),
    (
        "certify",
        "certify statistically that rollouts (plain or speculative) sample the target's law",
        _certify,
    ),
    ("models", "list registry model names", None),
    ("bench", "moved: the benchmarks run from a checkout, `python -m benchmarks NAME`", None),
)
GROUPS = {"drafter": "drafter tools"}


def build_parser(description: str = "") -> ArgumentParser:
    """The ``tlt-lightning`` parser: global ``--threads`` and ``--traceback``, then a subcommand.

    ``parse_args`` returns a namespace whose ``command`` names the subcommand; a grouped command's
    options sit under ``ns[group][command]`` (``ns.drafter.warmup``), the others' under ``ns[command]``.
    """
    parser = Parser(prog="tlt-lightning", description=description)
    parser.add_argument(
        "--threads", type=PositiveInt, default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="show the full traceback of a ValueError/TypeError (or set TLT_LIGHTNING_TRACEBACK=1)",
    )
    top = parser.add_subcommands(dest="command", required=True)
    # Listed for --help only: cli.main() hands `fit` to LightningCLI before this parser runs.
    top.add_subcommand(
        "fit",
        Parser(prog="tlt-lightning fit", add_help=False),
        help="GRPO training from a YAML config (LightningCLI; tlt-lightning fit --help)",
    )

    def command(group: str | None, name: str, help_: str, options: Any = None) -> Parser:
        sub = Parser(prog=" ".join(["tlt-lightning", *([group] if group else []), name]), description=help_)
        if options is not None:
            options(sub)
        (groups[group] if group else top).add_subcommand(name, sub, help=plain(help_))
        return sub

    groups: dict[str | None, Any] = {}
    # jsonargparse wants the levels in order: every top-level command first, then the groups' commands.
    for name, help_, options in TOP_COMMANDS:
        command(None, name, help_, options)
    for group, help_ in GROUPS.items():
        groups[group] = command(None, group, help_).add_subcommands(dest=group, required=True)
    for group, name, help_, options in COMMANDS:
        command(group, name, help_, options)
    return parser
