"""One short screen for every error a user can fix on the command line (the traceback behind
``--traceback``): bad rewards and losses, files and folders, misspelt keys, bad URIs and stores."""

from __future__ import annotations

import errno
import os
import re
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from tlt_lightning import cli
from tlt_lightning.rl import TokenPromptSource
from tlt_lightning.rl.listeners import RolloutListener
from tlt_lightning.tracking import mlflow_available

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "grpo_tiny.yaml")


def nan_reward(prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> float:
    return float("nan")


class NanRewardSource(TokenPromptSource):
    """A prompt source whose reward function returns NaN (built from a config by class path)."""

    def __init__(self) -> None:
        super().__init__([[1, 2, 3, 4]] * 8, nan_reward, name="nan-task")


class _Poison(RolloutListener):
    def __init__(self, module) -> None:
        self.module = module

    def after_rollout(self, result) -> None:  # after sampling, before the loss: the loss is NaN
        next(self.module.policy.parameters()).data.fill_(float("nan"))


class PoisonPolicy(L.Callback):
    """Makes the policy's weights NaN after the first rollout, as a diverged run would have them."""

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.add_rollout_listener(_Poison(pl_module))


def short_fit(tmp_path: Path, capsys, *extra: str) -> list[str]:
    """Run the tiny fit on the command line (``short_errors``); its stderr lines, checked short."""
    argv = [
        "--threads",
        "1",
        "fit",
        "--config",
        TINY,
        "--trainer.max_steps=2",
        "--trainer.logger=false",
        "--model.rollout_progress=false",
        f"--trainer.default_root_dir={tmp_path / 'fit'}",
        *extra,
    ]
    assert cli.main(argv, short_errors=True) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and 1 <= len(lines) <= 5, err
    assert cli.TRACEBACK_ENV in lines[-1]
    return lines


@pytest.fixture(autouse=True)
def _command_line(monkeypatch):
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    monkeypatch.setattr(sys, "argv", ["tlt-lightning"])


def test_a_nan_reward_is_one_short_error(tmp_path, capsys):
    lines = short_fit(tmp_path, capsys, f"--model.prompt_source={__name__}.NanRewardSource")
    assert lines[0].startswith("tlt-lightning: error: RewardError: the reward total of task 'nan-task'")
    assert " is nan" in lines[0] and "fix the reward function" in lines[0]


def test_a_non_finite_loss_is_one_short_error(tmp_path, capsys):
    lines = short_fit(tmp_path, capsys, f"--trainer.callbacks+={__name__}.PoisonPolicy")
    assert lines[0].startswith("tlt-lightning: error: NonFiniteLossError:")


def read_only_folder(tmp_path: Path) -> Path:
    """A folder nothing may be written into: a read-only one, or one /sys refuses (as root)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    if not os.access(folder, os.W_OK):
        return folder
    probe = Path("/sys/tlt-lightning-test")
    try:
        probe.mkdir()
    except OSError:
        return probe
    probe.rmdir()
    pytest.skip("no folder here refuses writes to this user")


def test_a_read_only_output_folder_is_one_short_error_naming_it(tmp_path, capsys):
    folder = read_only_folder(tmp_path)
    lines = short_fit(tmp_path, capsys, f"--trainer.default_root_dir={folder}/run")
    assert re.match(
        rf"tlt-lightning: error: (Permission denied|Operation not permitted|Read-only file system) "
        rf"\[E(ACCES|PERM|ROFS)\] \({folder}.*\): .*choose another output folder",
        lines[0],
    ), lines


def test_a_full_disk_is_one_line_naming_the_file_and_errno(tmp_path, capsys, monkeypatch):
    def full(trainer, filepath, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filepath))

    monkeypatch.setattr(L.Trainer, "save_checkpoint", full)
    lines = short_fit(tmp_path, capsys)
    assert re.match(
        rf"tlt-lightning: error: No space left on device \[ENOSPC\] \({tmp_path}/fit/.*last.ckpt\): "
        r"free space on that disk",
        lines[0],
    ), lines


def test_a_misspelt_key_in_a_callbacks_arguments_is_a_short_error(capsys):
    argv = [
        "fit",
        "--config",
        TINY,
        "--trainer.callbacks+=tlt_lightning.callbacks.BanditCallback",
        "--trainer.callbacks.init_args.heatmap_binz=3",
        "--print_config",
    ]
    with pytest.raises(SystemExit) as info:
        cli.main(argv, short_errors=True)
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) <= 5 and "Option 'heatmap_binz' is not accepted" in lines[0], lines


def test_a_runs_uri_that_goes_up_is_refused(tmp_path):
    argv = ["export-drafter", "runs:/0123/../../../etc", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match=r"^export-drafter: location .* goes up a folder \('\.\.'\)[^\n]*$"):
        cli.main(argv, short_errors=True)


def test_a_missing_rollouts_file_is_one_short_error(tmp_path, capsys):
    argv = [
        "drafter",
        "evaluate",
        "--drafter",
        str(tmp_path),
        "--rollouts",
        str(tmp_path / "none.safetensors"),
    ]
    assert cli.main(argv, short_errors=True) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("tlt-lightning: error: FileNotFoundError: --rollouts") and len(lines) <= 3


@pytest.mark.skipif(not mlflow_available(), reason="the mlflow extra is not installed")
def test_a_store_that_is_a_folder_fails_fast_naming_it(tmp_path):
    start = time.perf_counter()
    with pytest.raises(SystemExit, match=r"store 'sqlite:///.*' is a folder, not a database file"):
        cli.main(
            [
                "fit",
                "--config",
                TINY,
                f"--trainer.logger.init_args.tracking_uri=sqlite:///{tmp_path}",
                f"--trainer.default_root_dir={tmp_path / 'fit'}",
            ]
        )
    assert time.perf_counter() - start < 60  # MLflow alone retries for minutes


def test_other_errors_keep_their_traceback():
    assert cli.user_error(RuntimeError("a bug")) is None
    cause = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("a background write failed")
    wrapped.__cause__ = cause
    assert cli.user_error(wrapped) is cause


def test_traceback_flag_gives_the_user_error_itself(tmp_path):
    from tlt_lightning.rl.scoring import RewardError

    argv = [
        "--traceback",
        "fit",
        "--config",
        TINY,
        "--trainer.max_steps=1",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}",
        f"--model.prompt_source={__name__}.NanRewardSource",
    ]
    with pytest.raises(RewardError, match="the reward total of task 'nan-task'"):
        cli.main(argv, short_errors=True)
