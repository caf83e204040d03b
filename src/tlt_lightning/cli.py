"""``tlt-lightning``: GRPO training and tools on the command line.

    tlt-lightning fit --config CONFIG [--model.x=...] [--trainer.x=...]   GRPO training (LightningCLI)
    tlt-lightning drafter warmup [--out DIR] ...      train a drafter on the target's own rollouts
    tlt-lightning drafter evaluate --drafter DIR ...  drafters' acceptance on the same stored rollouts
    tlt-lightning export-drafter CKPT OUT [--engine vllm|sglang]
                                                      a drafter checkpoint (dir, models:/ or runs:/ URI)
                                                      -> EAGLE dir for vLLM or SGLang
    tlt-lightning export-drafter --from-fit RUN OUT   a fit's policy (save_pretrained) + its drafter, for vLLM
    tlt-lightning torchtune --config CFG [key=value]   GRPO from a torchtune recipe config (= tune run ...)
    tlt-lightning certify [--drafter DIR] [--arm ...]  certify that rollouts sample the target's own law
    tlt-lightning models                              list the registry

The benchmarks are not in the package: from a checkout, ``python -m benchmarks NAME [options]`` (the
former ``tlt-lightning bench NAME``, which now only says so and exits with status 2).

Every subcommand takes ``--threads`` (torch intra-op threads; on shared 2-core machines one
thread is often faster than two) before the subcommand name.

Options are parsed by jsonargparse (:mod:`tlt_lightning.cli_options`, which imports nothing heavy, so
``--help`` is quick at every level); options are never abbreviated, and a misspelt one ends the command
with a two-line error naming the closest valid option (exit status 2). On the command line a
``ValueError`` or ``TypeError`` (a bad setting, a file that is not what it should be) ends the command
with a short message and exit status 1 instead of a long traceback, as does any other error a user fixes
(:func:`user_error`: a NaN reward, a non-finite loss, a tracking store that cannot be opened, a full
disk or a read-only folder); ``--traceback`` before the
subcommand, or ``TLT_LIGHTNING_TRACEBACK=1`` in the environment, shows the whole traceback. ``fit`` is
handed to :mod:`tlt_lightning.fit` (LightningCLI, also jsonargparse) before the parser sees it:
``tlt-lightning fit --help`` lists its top-level options (``--print_config`` every setting), and ``fit``
also takes ``--threads`` after its name.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from importlib import import_module
from pathlib import Path

from tlt_lightning.cli_options import BENCH_MOVED, GROUPS, build_parser
from tlt_lightning.validation import MissingExtraError, UserError

__all__ = ["FILE_SYSTEM_ERRORS", "TRACEBACK_ENV", "command_args", "main", "short_error", "user_error"]

TRACEBACK_ENV = "TLT_LIGHTNING_TRACEBACK"


def _split_fit(argv: list[str]) -> tuple[list[str], list[str]] | None:
    """``(global options, ["fit", ...])`` when the subcommand is ``fit``, else ``None``."""
    return _split_command(argv, "fit")


def _split_command(argv: list[str], command: str) -> tuple[list[str], list[str]] | None:
    """``(global options, [command, ...])`` when the subcommand is ``command``, else ``None``.

    The global options are ``--threads N`` / ``--threads=N`` and ``--traceback``; anything else
    before the subcommand (``-h``, a typo) is left to argparse.
    """
    i = 0
    while i < len(argv):
        if argv[i] == "--threads":
            i += 2
        elif argv[i].startswith("--threads=") or argv[i] == "--traceback":
            i += 1
        else:
            break
    if i < len(argv) and argv[i] == command:
        return argv[:i], argv[i:]
    return None


def _set_threads(threads: int | None) -> None:
    import torch

    if threads is not None:
        if threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the processes it starts (DDP ranks) too


def _wants_traceback(argv: Sequence[str]) -> bool:
    """``--traceback`` among the global options (before the subcommand), or the environment variable."""
    i = 0
    while i < len(argv):
        if argv[i] == "--traceback":
            return True
        i += 2 if argv[i] == "--threads" else 1 if argv[i].startswith("--threads=") else len(argv)
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() not in ("", "0", "false", "no")


# What a user fixes in the file system, and how: a full disk, a folder that is read-only or not theirs,
# a file that is not there or not a file.
_FIX = "choose another output folder (e.g. --trainer.default_root_dir, --out)"
FILE_SYSTEM_ERRORS = {
    errno.ENOSPC: f"free space on that disk or {_FIX}",
    errno.EDQUOT: f"free space within your quota or {_FIX}",
    errno.EACCES: f"the folder is read-only or not yours: {_FIX}",
    errno.EPERM: f"the folder is read-only or not yours: {_FIX}",
    errno.EROFS: f"the file system is read-only: {_FIX}",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "check the path: a part of it is a file",
    errno.EISDIR: "name a file, not a folder",
}
"""``{errno: what to do}`` of the ``OSError`` s the command line answers with :func:`short_error`."""


def user_error(err: BaseException) -> BaseException | None:
    """The error a user can fix behind ``err``: ``err`` or an error it was raised from that is a
    ``ValueError``, ``TypeError``, :class:`~tlt_lightning.validation.UserError`, a missing extra
    (:class:`~tlt_lightning.validation.MissingExtraError`), ``FileNotFoundError``,
    ``PermissionError`` or an ``OSError`` of :data:`FILE_SYSTEM_ERRORS`; ``None`` when there is none (a
    bug: the traceback is worth seeing)."""
    while err is not None:
        if isinstance(err, (ValueError, TypeError, UserError, MissingExtraError)):
            return err
        if isinstance(err, OSError) and (
            err.errno in FILE_SYSTEM_ERRORS or isinstance(err, (FileNotFoundError, PermissionError))
        ):
            return err
        err = err.__cause__
    return None


def short_error(err: BaseException) -> str:
    """One screen for a user-input error: its type and message, where it was raised, how to see more.

    An ``OSError`` of :data:`FILE_SYSTEM_ERRORS` says which file or folder, the error's name (``ENOSPC``)
    and what to do.

    Example:
        >>> print(short_error(ValueError("group_size must be an int >= 2, got 1")).splitlines()[0])
        tlt-lightning: error: ValueError: group_size must be an int >= 2, got 1
    """
    message = f"{type(err).__name__}: {err}"
    if isinstance(err, OSError) and err.errno in FILE_SYSTEM_ERRORS:
        where = f" ({err.filename})" if err.filename else ""
        message = f"{err.strerror} [{errno.errorcode[err.errno]}]{where}: {FILE_SYSTEM_ERRORS[err.errno]}"
    lines = [f"tlt-lightning: error: {message}"]
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename)
        parts = path.parts
        shown = str(Path(*parts[parts.index("tlt_lightning") :])) if "tlt_lightning" in parts else path.name
        lines.append(f"  (raised in {shown}:{tb.tb_lineno})")
    lines.append(f"  full traceback: tlt-lightning --traceback ... or {TRACEBACK_ENV}=1")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, short_errors: bool | None = None) -> int:
    """Run ``tlt-lightning`` with ``argv`` (default: the command line).

    Args:
        argv: the arguments after the program name; ``None``: ``sys.argv[1:]``.
        short_errors: an error a user can fix (:func:`user_error`) prints :func:`short_error` to
            stderr and returns 1 instead of propagating (unless ``--traceback`` or the environment
            variable asks for the traceback); ``None``: only on the command line (``argv is None``),
            so that Python callers get the exception itself.
    """
    if short_errors is None:
        short_errors = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not short_errors or _wants_traceback(argv):
        return _main(argv)
    try:
        return _main(argv)
    except Exception as err:
        fixable = user_error(err)  # user input: the message says what and how to fix it
        if fixable is None:
            raise
        print(short_error(fixable), file=sys.stderr)
        return 1


# Dependencies that warn on every command about what this project documents instead: torchao 0.15's
# C++ kernels do not load beside torch 2.13 (transformers imports torchao whenever it is installed; only
# INT4 QAT uses it), its deprecated import paths, and no Triton on a CPU. Quieted here, at the command
# line only: a library user keeps every warning.
QUIET_LOGGERS = ("torchao",)
QUIET_WARNING_MODULES = r"(torchao|triton)(\..*)?$"


def _main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may wait on a hub download
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=QUIET_WARNING_MODULES)
    if _split_command(argv, "bench") is not None:  # users' scripts: one line, whatever followed
        print(BENCH_MOVED, file=sys.stderr)
        return 2
    fit = _split_fit(argv)
    if fit is not None:
        global_args, fit_args = fit
        threads = argparse.ArgumentParser(prog="tlt-lightning", add_help=False)
        threads.add_argument("--threads", type=int, default=None)
        threads.add_argument("--traceback", action="store_true")
        _set_threads(threads.parse_args(global_args).threads)
        from tlt_lightning import fit as fit_job

        fit_job.main(fit_args)
        return 0
    # Not for fit: Lightning and MLflow configure their own loggers, a root handler would repeat them.
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args = command_args(argv)
    _set_threads(args.threads)
    if args.command == "models":
        from tlt_lightning.models import available_models

        print("\n".join(available_models()))
    elif (args.command, args.name) in _RUNS:
        module, function = _RUNS[args.command, args.name].split(":")
        getattr(import_module(module), function)(args)
    return 0


# Commands, each run by one function of ``args``: grouped ones by (group, name), the others by (name, name).
_RUNS = {
    ("drafter", "warmup"): "tlt_lightning.recipes.drafter_warmup:run",
    ("drafter", "evaluate"): "tlt_lightning.recipes.drafter_evaluate:run",
    ("export-drafter", "export-drafter"): "tlt_lightning.recipes.export_drafter:run",
    ("torchtune", "torchtune"): "tlt_lightning.recipes.grpo_torchtune:run_command",
    ("certify", "certify"): "tlt_lightning.recipes.certify:run",
}


def command_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv`` (not ``fit``): the command's own options, flat, with ``command``, ``name`` (a grouped
    command's own name, else the command's), ``threads``, ``traceback`` and ``argv`` beside them, as the
    commands' ``run(args)`` read them.

    Example:
        >>> args = command_args(["--threads", "1", "drafter", "warmup", "--steps", "10"])
        >>> args.command, args.name, args.steps, args.threads
        ('drafter', 'warmup', 10, 1)
    """
    parsed = build_parser(description=__doc__.split("\n")[0]).parse_args(list(argv))
    command = name = parsed.command
    options = parsed[command]
    if command in GROUPS:  # drafter warmup: parsed.drafter.warmup
        name = options[command]
        options = options[name]
    return argparse.Namespace(
        **options.as_dict(),
        command=command,
        name=name,
        threads=parsed.threads,
        traceback=parsed.traceback,
        argv=list(argv),
    )


if __name__ == "__main__":
    raise SystemExit(main())
