"""The ``tlt-lightning`` parser: jsonargparse for every subcommand, quick plain-text help, short errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tlt_lightning import cli
from tlt_lightning.cli_options import BENCH_MOVED, COMMANDS, GROUPS, TOP_COMMANDS, build_parser

HEAVY = ("torch", "transformers", "lightning", "tlt_lightning.recipes.drafter_warmup")


def _run(*args: str, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *flags, "-m", "tlt_lightning.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.parametrize("argv", [["--help"], ["drafter", "warmup", "--help"]])
def test_help_imports_no_torch_nor_the_implementation(argv):
    probe = (
        "import sys, runpy\nsys.argv = ['tlt-lightning', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('tlt_lightning.cli', run_name='__main__')\nexcept SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        f"    print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "usage: tlt-lightning" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "HEAVY []"


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        build_parser("``tlt-lightning``: see :class:`~tlt_lightning.fit.GRPOCLI`").parse_args(
            [*argv, "--help"]
        )
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


def test_every_help_is_plain_text(capsys):
    commands = [
        [],
        *([g] for g in GROUPS),
        *([g, n] for g, n, _, _ in COMMANDS),
        *([n] for n, _, _ in TOP_COMMANDS),
    ]
    assert len(commands) == 1 + 1 + 2 + 5
    for argv in commands:
        text = _help(capsys, argv)
        assert "usage:" in text
        assert "``" not in text and ":class:" not in text and ":mod:" not in text, argv
    assert "tlt-lightning: see GRPOCLI" in _help(capsys, [])


def test_a_misspelt_option_is_a_short_error_naming_the_closest(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["drafter", "warmup", "--batch-sizes", "1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "tlt-lightning drafter warmup: error: unrecognized arguments: --batch-sizes 1",
        "  unknown option --batch-sizes: did you mean --batch-size?",
        "  see: tlt-lightning drafter warmup --help",
    ]


@pytest.mark.parametrize(
    ("argv", "flag", "close"),
    [
        (["--thread", "1", "models"], "--thread", "--threads"),
        (["drafter", "warmup", "--step", "3"], "--step", "--steps"),
        (["export-drafter", "ckpt", "out", "--seed=1", "--engin", "vllm"], "--engin", "--engine"),
    ],
)
def test_options_are_never_abbreviated(capsys, argv, flag, close):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and f"unknown option {flag}: did you mean {close}?" in err[1]


def test_a_bad_choice_names_the_allowed_values(capsys):
    with pytest.raises(SystemExit):
        cli.main(["drafter", "warmup", "--dtype", "float64"])
    err = capsys.readouterr().err
    assert "float64" in err and "bfloat16" in err and len(err.splitlines()) <= 3


def test_command_args_are_flat_with_the_command_and_globals():
    args = cli.command_args(
        ["--threads", "1", "drafter", "warmup", "--steps", "3", "--more-rollouts", "a", "b"]
    )
    assert (args.command, args.name, args.threads, args.traceback) == ("drafter", "warmup", 1, False)
    assert args.steps == 3 and args.more_rollouts == ["a", "b"] and args.max_new_tokens == 256
    export = cli.command_args(["export-drafter", "--from-fit", "run", "out"])
    assert (export.name, export.from_fit, export.checkpoint, export.out) == (
        "export-drafter",
        "run",
        "out",
        None,
    )
    tune = cli.command_args(["torchtune", "--config", "c.yaml", "a=1", "b=2"])
    assert tune.config == "c.yaml" and tune.overrides == ["a=1", "b=2"]


@pytest.mark.parametrize(
    "argv", [["bench"], ["bench", "rollout", "--json", "x.json"], ["--threads", "1", "bench", "-h"]]
)
def test_bench_says_in_one_line_where_the_benchmarks_went(capsys, argv):
    assert cli.main(argv) == 2
    out = capsys.readouterr()
    assert out.err.splitlines() == [BENCH_MOVED] and out.out == ""
    assert "python -m benchmarks NAME" in BENCH_MOVED


def test_bench_exits_2_on_the_command_line():
    out = _run("bench", "rollout")
    assert out.returncode == 2 and out.stderr.strip() == BENCH_MOVED


def test_third_party_warnings_are_filtered_at_the_command_line_only():
    out = _run("models", flags=("-W", "default"))
    assert out.returncode == 0 and "tiny-llama" in out.stdout
    assert out.stderr == ""  # torchao's deprecated import paths and missing kernels, quieted
    library = subprocess.run(
        [sys.executable, "-W", "default", "-c", "import tlt_lightning.models"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert library.returncode == 0 and "torchao" in library.stderr  # a library user keeps every warning


@pytest.mark.parametrize(
    ("argv", "restriction"),
    [
        (["drafter", "warmup", "--rollout-batch", "0"], "v>0"),
        (["drafter", "warmup", "--batch-size", "-3"], "v>0"),
        (["drafter", "warmup", "--max-new-tokens", "-1"], "v>0"),
        (["drafter", "warmup", "--pack", "-1"], "v>=0"),
    ],
)
def test_negative_or_zero_sizes_are_refused(argv, restriction, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert f"does not conform to restriction {restriction}" in capsys.readouterr().err
