"""``python -m benchmarks NAME [options]``: run one benchmark from a checkout (not in the wheel).

    python -m benchmarks --threads 1 rollout --batch-sizes 1 8 --json runs/bench/rollout.json
    python -m benchmarks bandit                    # seconds: strategy bandits, simulated
    python -m benchmarks rollout --help            # one benchmark's options

The options are those ``tlt-lightning bench NAME`` took: one jsonargparse parser
(:class:`tlt_lightning.cli_options.Parser`: no abbreviations, a misspelt option is a short error naming
the closest, exit status 2), ``--threads`` (torch intra-op threads) and ``--traceback`` before the name.
A ``ValueError``/``TypeError`` on the command line ends with a short message and exit status 1 (the
full traceback with ``--traceback`` or ``TLT_LIGHTNING_TRACEBACK=1``). Building the parser imports no
torch and no benchmark; a benchmark's module is imported when it runs.

The experiments that back single results in docs/benchmarks.md run as modules with their own options:
``python -m benchmarks.compiled_steps``, ``.decode_paths``, ``.batch1_rates``, ``.compiled_check``
(the CUDA check behind ``scripts/gpu_check_compiled.sh``), ``.measure_task_reward``, ``.prefill_sharing``,
``.few_rows_verify`` and ``.optimizer_step``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from importlib import import_module

from benchmarks.options import BENCHMARKS
from tlt_lightning.cli import QUIET_LOGGERS, QUIET_WARNING_MODULES, TRACEBACK_ENV, short_error
from tlt_lightning.cli_options import Parser, plain

__all__ = ["PROG", "build_parser", "main", "parse"]

PROG = "python -m benchmarks"
EXPERIMENTS = (
    "The experiments behind single results run as modules, each with its own --help: "
    "python -m benchmarks.compiled_steps | .decode_paths | .batch1_rates | .compiled_check | "
    ".measure_task_reward | .prefill_sharing | .few_rows_verify | .optimizer_step"
)
_RUNS = {name: run for name, _, _, run in BENCHMARKS}


def build_parser() -> Parser:
    """Global ``--threads`` and ``--traceback``, then one subcommand per benchmark (``ns.name``)."""
    parser = Parser(prog=PROG, description=__doc__.split("\n")[0], epilog=EXPERIMENTS)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--traceback",
        action="store_true",
        help=f"show the full traceback of a ValueError/TypeError (or set {TRACEBACK_ENV}=1)",
    )
    subcommands = parser.add_subcommands(dest="name", required=True)
    for name, help_, options, _ in BENCHMARKS:
        sub = Parser(prog=f"{PROG} {name}", description=help_)
        options(sub)
        subcommands.add_subcommand(name, sub, help=plain(help_))
    return parser


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The benchmark's options, flat, with ``name``, ``threads``, ``traceback`` and ``argv`` beside them
    (what each benchmark's ``run(args)`` reads).

    Example:
        >>> args = parse(["--threads", "1", "bandit", "--steps", "10"])
        >>> args.name, args.steps, args.threads
        ('bandit', 10, 1)
    """
    parsed = build_parser().parse_args(list(argv))
    return argparse.Namespace(
        **parsed[parsed.name].as_dict(),
        name=parsed.name,
        threads=parsed.threads,
        traceback=parsed.traceback,
        argv=list(argv),
    )


def _run(args: argparse.Namespace) -> int:
    # As `tlt-lightning` does: no warnings about what the docs already say, the library's warnings shown.
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=QUIET_WARNING_MODULES)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.threads is not None:
        from tlt_lightning.validation import positive_int

        positive_int("--threads", args.threads)
        import torch

        torch.set_num_threads(args.threads)
    module, function = _RUNS[args.name].split(":")
    getattr(import_module(module), function)(args)
    return 0


def _short(err: BaseException) -> str:
    """:func:`tlt_lightning.cli.short_error`, naming this command instead of ``tlt-lightning``."""
    lines = short_error(err).splitlines()
    lines[0] = PROG + lines[0].removeprefix("tlt-lightning")
    lines[-1] = lines[-1].replace("tlt-lightning --traceback", f"{PROG} --traceback")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, short_errors: bool | None = None) -> int:
    """Run ``python -m benchmarks`` with ``argv`` (default: the command line).

    Args:
        argv: the arguments after ``python -m benchmarks``; ``None``: ``sys.argv[1:]``.
        short_errors: a ``ValueError``/``TypeError`` prints a short message to stderr and returns 1
            (unless ``--traceback`` or ``TLT_LIGHTNING_TRACEBACK=1`` asks for the traceback); ``None``:
            only on the command line (``argv is None``), so that Python callers get the exception.
    """
    if short_errors is None:
        short_errors = argv is None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may wait on a hub download
    args = parse(sys.argv[1:] if argv is None else argv)
    from_env = os.environ.get(TRACEBACK_ENV, "").strip().lower() not in ("", "0", "false", "no")
    wants_traceback = args.traceback or from_env
    if not short_errors or wants_traceback:
        return _run(args)
    try:
        return _run(args)
    except (ValueError, TypeError) as err:  # user input: the message says what and how to fix it
        print(_short(err), file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
