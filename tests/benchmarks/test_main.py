"""``python -m benchmarks``: one jsonargparse parser, quick plain-text help, short errors, ``--threads``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import PROG, build_parser, main, parse
from benchmarks.options import BENCHMARKS, DECODE_PATHS, EFFICIENCY_PARTS, SPOT_PARTS, WEIGHT_LAYOUTS

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "lightning", "benchmarks.rollout", "benchmarks.common")


def _run(*args: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    command = [sys.executable, "-m", "benchmarks", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


@pytest.mark.parametrize("argv", [["--help"], ["rollout", "--help"]])
def test_help_imports_no_torch_nor_the_benchmark(argv):
    probe = (
        "import sys, runpy\nsys.argv = ['benchmarks', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('benchmarks', run_name='__main__')\nexcept SystemExit as e:\n"
        f"    assert e.code in (0, None), e.code\n"
        f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert f"usage: {PROG}" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "HEAVY []"


def test_every_benchmark_is_listed_with_plain_help(capsys):
    names = [name for name, *_ in BENCHMARKS]
    assert names == [
        "rollout",
        "bandit",
        "activation-checkpointing",
        "strategies",
        "e2e",
        "lengths",
        "memory",
        "spot",
        "efficiency",
        "layout",
        "peers",
    ]
    for argv in [[], *([name] for name, *_ in BENCHMARKS)]:
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args([*argv, "--help"])
        assert exit_info.value.code in (0, None)
        text = capsys.readouterr().out
        assert text.startswith(f"usage: {PROG}") and all(name in text.splitlines()[0] for name in argv)
        assert "``" not in text and ":class:" not in text, argv
        assert ("benchmarks.compiled_steps" in text) == (argv == [])  # the experiments run as modules


def test_options_are_those_of_the_former_bench_command():
    args = parse(["--threads", "1", "rollout", "--batch-sizes", "1", "8", "--json", "r.json"])
    assert (args.name, args.threads, args.traceback) == ("rollout", 1, False)
    assert args.batch_sizes == [1, 8] and args.json == "r.json"
    assert args.argv == ["--threads", "1", "rollout", "--batch-sizes", "1", "8", "--json", "r.json"]
    assert args.max_new_tokens == 128 and args.decode == "hf" and args.plot is None
    assert parse(["efficiency", "--part", "qat"]).json is None


def test_a_misspelt_option_is_a_short_error_naming_the_closest(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["rollout", "--batch-size", "1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{PROG} rollout: error: unrecognized arguments: --batch-size 1",
        "  unknown option --batch-size: did you mean --batch-sizes?",
        f"  see: {PROG} rollout --help",
    ]


@pytest.mark.parametrize(
    ("argv", "flag", "close"),
    [
        (["--thread", "1", "bandit"], "--thread", "--threads"),
        (["efficiency", "--part", "qat", "--seed=1", "--kd-temp", "2"], "--kd-temp", "--kd-temperature"),
    ],
)
def test_options_are_never_abbreviated(capsys, argv, flag, close):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and f"unknown option {flag}: did you mean {close}?" in err[1]


def test_a_bad_choice_names_the_allowed_values(capsys):
    with pytest.raises(SystemExit):
        main(["rollout", "--dtype", "float64"])
    err = capsys.readouterr().err
    assert "float64" in err and "bfloat16" in err and len(err.splitlines()) <= 3


def test_a_bad_setting_is_a_short_error_on_the_command_line_only(capsys, monkeypatch):
    monkeypatch.delenv("TLT_LIGHTNING_TRACEBACK", raising=False)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        main(["bandit", "--steps", "0"])  # a Python caller gets the exception
    assert main(["bandit", "--steps", "0"], short_errors=True) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"{PROG}: error: ValueError: steps must be an int >= 1, got 0"
    assert err[-1] == f"  full traceback: {PROG} --traceback ... or TLT_LIGHTNING_TRACEBACK=1"
    with pytest.raises(ValueError, match="steps"):
        main(["--traceback", "bandit", "--steps", "0"], short_errors=True)
    with pytest.raises(ValueError, match="--threads must be a positive int, got 0"):
        main(["--threads", "0", "bandit"])


def test_the_command_line_runs_a_benchmark_with_threads(tmp_path):
    out = _run("--threads", "1", "bandit", "--steps", "200", "--json", str(tmp_path / "b.json"))
    assert out.returncode == 0, out.stderr
    assert "[bench bandit] wrote" in out.stdout and (tmp_path / "b.png").is_file()
    bad = _run("bandit", "--steps", "0")
    assert bad.returncode == 1 and bad.stderr.startswith(f"{PROG}: error: ValueError: steps must be")


def test_choices_match_the_library():
    from benchmarks import efficiency, spot
    from benchmarks.options_training import ROLLOUT_DECODES
    from tlt_lightning.models import DECODE_PATHS as decode_paths
    from tlt_lightning.models.layout import WEIGHT_LAYOUTS as weight_layouts
    from tlt_lightning.rl.module_settings import ROLLOUT_DECODES as rollout_decodes

    assert DECODE_PATHS == decode_paths and WEIGHT_LAYOUTS == weight_layouts
    assert ROLLOUT_DECODES == rollout_decodes
    assert SPOT_PARTS == spot.PARTS and EFFICIENCY_PARTS == efficiency.PARTS


@pytest.mark.parametrize(
    "argv",
    [
        ["rollout", "--batch-sizes", "-3"],
        ["rollout", "--batch-sizes", "1", "0"],
        ["rollout", "--max-new-tokens", "0"],
        ["strategies", "--requests", "-1"],
    ],
)
def test_negative_or_zero_sizes_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert "does not conform to restriction v>0" in capsys.readouterr().err
