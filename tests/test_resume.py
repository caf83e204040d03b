"""``tlt-lightning fit --ckpt_path``: exact resume by default, overrides refused or applied, bad files."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import assert_same, callback_state
from tlt_lightning import cli
from tlt_lightning.resume import check_resume, read_checkpoint, resume_conflicts
from tlt_lightning.rl import OptimConfig
from tlt_lightning.tracking.run_directory import latest_checkpoint
from tlt_lightning.validation import check_resumed_settings

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "grpo_tiny.yaml"


# ---------------------------------------------------------------------------------- units


def test_conflicts_compare_saved_settings_with_the_config():
    saved = {"lr": 0.01, "seed": 0, "task": {"name": "chain_sum", "size": 8}, "_instantiator": "x", "gone": 1}
    current = {"lr": 0.01, "seed": 1, "task": None, "new": 2}
    # task None is the default TaskConfig; keys only one side has are not conflicts.
    conflicts = resume_conflicts(saved, current)
    assert set(conflicts) == {"seed", "task.size"} and conflicts["seed"] == (0, 1)
    assert resume_conflicts({"task": {"name": "chain_sum", "size": 256}}, {"task": None}) == {}
    # Groups compare field by field, defaults filled in, as saved dicts or as configs.
    assert resume_conflicts({"optim": {"lr": 0.01, "kl_coef": 0.0}}, {"optim": OptimConfig(lr=0.5)}) == {
        "optim.lr": (0.01, 0.5)
    }


def test_check_resume_refuses_listing_every_key_and_the_ways_on():
    saved, current = (
        {"lr": 0.01, "seed": 0, "rollout_progress": True},
        {"lr": 0.5, "seed": 3, "rollout_progress": False},
    )
    match = (
        r"settings that differ from the checkpoint's \(checkpoint -> now\):\n  model.lr: 0.01 -> 0.5\n"
        r"  model.seed: 0 -> 3\nTo continue .* exactly, drop these overrides.*--resume_overrides=apply.*"
        r"--resume_overrides=checkpoint"
    )
    with pytest.raises(ValueError, match=match):
        check_resume("x.ckpt", saved, current)
    # Display / check settings change nothing that is learned: taken without asking.
    assert check_resume("x.ckpt", {"rollout_progress": True}, {"rollout_progress": False}) == {
        "rollout_progress": (True, False)
    }
    assert set(check_resume("x.ckpt", saved, current, "apply")) == {"lr", "seed", "rollout_progress"}
    with pytest.raises(
        ValueError, match=r"resume_overrides must be one of \('refuse', 'apply', 'checkpoint'\), got 'yes'"
    ):
        check_resume("x.ckpt", saved, current, "yes")


def test_read_checkpoint_names_missing_empty_and_corrupt_files(tmp_path):
    with pytest.raises(ValueError, match=r"ckpt_path '.*nope.ckpt' is not a file"):
        read_checkpoint(tmp_path / "nope.ckpt")
    (tmp_path / "empty.ckpt").write_bytes(b"")
    with pytest.raises(
        ValueError, match=r"'.*empty.ckpt' is empty \(0 bytes\).*resume from an older checkpoint"
    ):
        read_checkpoint(tmp_path / "empty.ckpt")
    (tmp_path / "bad.ckpt").write_bytes(b"PK\x03\x04 not really a zip" * 4)
    with pytest.raises(ValueError, match=r"'.*bad.ckpt' is corrupt or not a Lightning checkpoint"):
        read_checkpoint(tmp_path / "bad.ckpt")
    torch.save({"weights": torch.zeros(1)}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match=r"'.*plain.pt' is not a Lightning checkpoint \(no state_dict\)"):
        read_checkpoint(tmp_path / "plain.pt")


# ---------------------------------------------------------------------------------- fit


def tlt_config(tmp_path: Path) -> Path:
    """The tiny config with TLT on: a spot-trained drafter (step-bounded) and a reproducible bandit."""
    config = yaml.safe_load(TINY.read_text())
    config["model"]["rollout_progress"] = False
    config["trainer"]["callbacks"][1:1] = [
        {
            "class_path": "tlt_lightning.callbacks.SpotDrafterCallback",
            "init_args": {
                "config": {
                    "training": {"max_steps_per_rollout": 2, "max_seconds_per_rollout": None},
                    "draft_vocab_size": None,
                    "checkpoint_interval": None,
                },
                "timeline": False,
            },
        },
        {
            "class_path": "tlt_lightning.callbacks.BanditCallback",
            "init_args": {
                "reproducible": True,
                "strategy": {
                    "class_path": "tlt_lightning.scheduling.BEGMABStrategy",
                    "init_args": {"epsilon": 0.3, "seed": 1},
                },
            },
        },
    ]
    config["model"]["speculative"]["drafter_kind"] = None  # the callback builds and trains the drafter
    path = tmp_path / "tlt.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def fit(tmp_path: Path, config: Path, name: str, *extra: str) -> tuple[list[float], dict]:
    """Run ``tlt-lightning fit`` to a CSV logger; ``(reward/mean per step, the last checkpoint)``."""
    argv = [
        "--threads",
        "1",
        "fit",
        "--config",
        str(config),
        f"--trainer.default_root_dir={tmp_path / name}",
        f"--trainer.logger.init_args.fallback_dir={tmp_path / name}",
        *extra,
    ]
    assert cli.main(argv) == 0
    (metrics,) = (tmp_path / name).rglob("metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("reward/mean")]
    (last,) = (tmp_path / name).rglob("last.ckpt")
    return [float(r["reward/mean"]) for r in rows], torch.load(last, weights_only=False)


def test_fit_resumed_from_a_checkpoint_is_the_uninterrupted_run(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["tlt-lightning"])
    monkeypatch.setattr(
        "tlt_lightning.tracking.logger.mlflow_available", lambda uri=None: False
    )  # CSV: metrics per step
    monkeypatch.chdir(tmp_path)
    config = tlt_config(tmp_path)
    rewards, full = fit(tmp_path, config, "full", "--trainer.max_steps=4")
    first, half = fit(tmp_path, config, "half", "--trainer.max_steps=2")
    assert half["global_step"] == 2 and first == rewards[:2]
    second, resumed = fit(
        tmp_path,
        config,
        "resumed",
        "--trainer.max_steps=4",
        f"--ckpt_path={next((tmp_path / 'half').rglob('last.ckpt'))}",
    )
    assert resumed["global_step"] == 4 and len(rewards) == 4
    assert second == rewards[2:]  # identical rewards after the resume, exactly
    assert_same(resumed["state_dict"], full["state_dict"], "policy")
    assert_same(resumed["optimizer_states"], full["optimizer_states"], "optimizer")
    # The drafter (weights, optimizer, buffer) and the reproducible bandit continued exactly too.
    spot_full, spot_resumed = (
        callback_state(full, "SpotDrafterCallback"),
        callback_state(resumed, "SpotDrafterCallback"),
    )
    assert_same(spot_resumed["drafter"], spot_full["drafter"], "drafter")
    assert spot_full["buffer"]["items"]  # the buffer is in the checkpoint by default
    bandit_full = callback_state(full, "BanditCallback")
    assert bandit_full["num_updates"] > 0 and bandit_full["cost_model"] is not None
    assert callback_state(resumed, "BanditCallback") == bandit_full


def test_resume_with_other_settings_is_refused_listing_the_keys(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["tlt-lightning"])
    monkeypatch.chdir(tmp_path)
    base = [
        "fit",
        "--config",
        str(TINY),
        "--trainer.logger=false",
        "--model.rollout_progress=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    assert cli.main([*base, "--trainer.max_steps=1"]) == 0
    ckpt = latest_checkpoint(tmp_path)  # without a logger, each fit in its own version_<N>/checkpoints
    resume = [*base, "--trainer.max_steps=2", f"--ckpt_path={ckpt}"]
    with pytest.raises(
        ValueError, match=r"(?s)model.optim.lr: 0.01 -> 0.5\n  model.seed: 0 -> 3\n.*--resume_overrides=apply"
    ):
        cli.main([*resume, "--model.optim.lr=0.5", "--model.seed=3"])
    # On the command line: a short error with the keys, exit status 1, nothing trained.
    assert cli.main([*resume, "--model.optim.lr=0.5"], short_errors=True) == 1
    err = capsys.readouterr().err
    assert "model.optim.lr: 0.01 -> 0.5" in err and "Traceback" not in err
    assert torch.load(ckpt, weights_only=False)["global_step"] == 1
    # Applied on request: the new lr reaches the optimizer, the module warns about the seed.
    with pytest.warns(UserWarning, match="resuming with seed=3 from a checkpoint trained with seed=0"):
        assert cli.main([*resume, "--model.optim.lr=0.5", "--model.seed=3", "--resume_overrides=apply"]) == 0
    after = torch.load(latest_checkpoint(tmp_path), weights_only=False)
    assert after["global_step"] == 2 and after["hyper_parameters"]["optim"]["lr"] == 0.5
    assert after["optimizer_states"][0]["param_groups"][0]["lr"] == 0.5
    # Or the checkpoint's values (Lightning's behaviour), now said out loud.
    assert (
        cli.main(
            [
                *base,
                "--trainer.max_steps=3",
                "--ckpt_path=last",  # the newest: the resumed fit's, step 2
                "--model.optim.lr=0.1",
                "--resume_overrides=checkpoint",
            ]
        )
        == 0
    )
    final = torch.load(latest_checkpoint(tmp_path), weights_only=False)
    assert final["global_step"] == 3 and final["hyper_parameters"]["optim"]["lr"] == 0.5


def test_resume_overrides_takes_only_its_three_values(capsys):
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", str(TINY), "--resume_overrides=maybe", "--print_config"])
    err = capsys.readouterr().err
    assert "resume_overrides" in err and "maybe" in err


def test_resume_from_an_empty_checkpoint_is_a_short_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["tlt-lightning"])
    (tmp_path / "last.ckpt").write_bytes(b"")
    argv = [
        "fit",
        "--config",
        str(TINY),
        "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}",
        f"--ckpt_path={tmp_path / 'last.ckpt'}",
    ]
    assert cli.main(argv, short_errors=True) == 1
    err = capsys.readouterr().err
    assert "ValueError: ckpt_path" in err and "is empty (0 bytes)" in err and "EOFError" not in err


def test_ckpt_path_last_takes_the_newest_run_and_runs_without_logger_share_no_checkpoint(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(sys, "argv", ["tlt-lightning"])
    base = [
        "fit",
        "--config",
        str(TINY),
        "--trainer.logger=false",
        "--model.rollout_progress=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    # Nothing to resume: refused in one line naming where it looked, nothing started.
    assert cli.main([*base, "--ckpt_path=last"], short_errors=True) == 1
    looked = f"ckpt_path 'last': no checkpoint matches '{tmp_path}/**/checkpoints/last*.ckpt'"
    assert looked in capsys.readouterr().err and not list(tmp_path.iterdir())
    # Two runs on one root dir: each its own version_<N>/checkpoints/last.ckpt.
    for seed in (1, 2):
        assert cli.main([*base, "--trainer.max_steps=1", f"--model.seed={seed}"]) == 0
    first, second = sorted(tmp_path.glob("version_*/checkpoints/last.ckpt"))
    assert (first.parts[-3], second.parts[-3]) == ("version_0", "version_1")
    # `last` is the newest run's (seed 2: the first run's seed 1 would be refused as a changed setting).
    assert cli.main([*base, "--trainer.max_steps=2", "--model.seed=2", "--ckpt_path=last"]) == 0
    resumed = latest_checkpoint(tmp_path)
    assert resumed.parts[-3] == "version_2" and torch.load(resumed, weights_only=False)["global_step"] == 2
    assert [torch.load(p, weights_only=False)["global_step"] for p in (first, second)] == [1, 1]


# ---------------------------------------------------------------------------------- prompts, callbacks


def test_check_resumed_settings_refuses_applies_and_never_changes_fixed_ones():
    saved, now = (
        {"kind": "eagle1", "training": {"lr": 0.1, "seed": 0}},
        {"kind": "eagle1", "training": {"lr": 0.2, "seed": 0}},
    )
    with pytest.raises(
        ValueError, match=r"Spot settings that differ .*:\n  Spot.training.lr: 0.1 -> 0.2\n.*apply"
    ):
        check_resumed_settings("Spot", saved, now)
    with pytest.raises(ValueError, match=r"Spot.training.lr: 0.1 -> 0.2"):
        check_resumed_settings("Spot", saved, now, "checkpoint")  # cannot be restored into built objects
    assert check_resumed_settings("Spot", saved, now, "apply") == {"training.lr": (0.1, 0.2)}
    fixed = {"kind": "weights of the old kind"}
    with pytest.raises(ValueError, match=r"cannot change .*\n  Spot.kind: 'eagle1' -> 'eagle3' \(weights of"):
        check_resumed_settings("Spot", saved, {**now, "kind": "eagle3"}, "apply", fixed)
    assert check_resumed_settings("Spot", None, now) == {}  # a checkpoint from before settings were saved


def resume_argv(tmp_path: Path, config: Path, *extra: str) -> list[str]:
    return [
        "--threads",
        "1",
        "fit",
        "--config",
        str(config),
        "--trainer.max_steps=3",
        f"--trainer.default_root_dir={tmp_path / 'resumed'}",
        f"--trainer.logger.init_args.fallback_dir={tmp_path / 'resumed'}",
        f"--ckpt_path={next((tmp_path / 'half').rglob('last.ckpt'))}",
        *extra,
    ]


def test_resume_refuses_another_prompt_source_and_callback_settings_or_applies_them(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["tlt-lightning"])
    monkeypatch.setattr("tlt_lightning.tracking.logger.mlflow_available", lambda uri=None: False)
    monkeypatch.chdir(tmp_path)
    config = tlt_config(tmp_path)
    _, half = fit(tmp_path, config, "half", "--trainer.max_steps=2")
    assert callback_state(half, "SpotDrafterCallback")["settings"]["config"]["kind"] == "eagle1"
    assert callback_state(half, "BanditCallback")["settings"]["strategy/epsilon"] == 0.3
    assert len(half["grpo"]["prompt_source"]["sha256"]) == 16
    other = yaml.safe_load(config.read_text())
    source = other["model"]["prompt_source"]["init_args"]
    source["seed"] = 1  # the same task and size, other prompts
    spot, bandit = other["trainer"]["callbacks"][1:3]
    spot["init_args"]["config"]["training"]["lr"] = 1e-3
    bandit["init_args"]["strategy"]["init_args"]["epsilon"] = 0.5
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(other))
    with pytest.raises(
        ValueError, match=r"prompt_source settings .*\n  prompt_source.sha256: '\w+' -> '\w+'"
    ):
        cli.main(resume_argv(tmp_path, changed))
    source["seed"] = 0
    changed.write_text(yaml.safe_dump(other))
    with pytest.raises(ValueError, match=r"SpotDrafterCallback.config.training.lr: 0.0003 -> 0.001\n.*apply"):
        cli.main(resume_argv(tmp_path, changed))
    spot["init_args"]["config"]["training"]["lr"] = 3e-4
    changed.write_text(yaml.safe_dump(other))
    with pytest.raises(ValueError, match=r"BanditCallback.strategy/epsilon: 0.3 -> 0.5\n"):
        cli.main(resume_argv(tmp_path, changed, "--resume_overrides=checkpoint"))
    # Never applicable: the drafter's weights and the bandit's random state are the checkpoint's.
    spot["init_args"]["config"]["kind"] = "eagle3"
    changed.write_text(yaml.safe_dump(other))
    with pytest.raises(
        ValueError, match=r"cannot change .*\n  SpotDrafterCallback.config.kind: 'eagle1' -> 'eagle3'"
    ):
        cli.main(resume_argv(tmp_path, changed, "--resume_overrides=apply"))
    spot["init_args"]["config"]["kind"] = "eagle1"
    bandit["init_args"]["strategy"]["init_args"]["seed"] = 2
    changed.write_text(yaml.safe_dump(other))
    with pytest.raises(
        ValueError, match=r"BanditCallback.strategy/seed: 1 -> 2 \(the strategy's random state"
    ):
        cli.main(resume_argv(tmp_path, changed, "--resume_overrides=apply"))
    # Applied on request: the new prompts, the bandit's epsilon, the drafter's lr (its optimizer too).
    bandit["init_args"]["strategy"]["init_args"]["seed"] = 1
    source["seed"] = 1
    spot["init_args"]["config"]["training"]["lr"] = 1e-3
    changed.write_text(yaml.safe_dump(other))
    assert cli.main(resume_argv(tmp_path, changed, "--resume_overrides=apply")) == 0
    resumed = torch.load(next((tmp_path / "resumed").rglob("last.ckpt")), weights_only=False)
    assert resumed["global_step"] == 3
    assert resumed["grpo"]["prompt_source"]["sha256"] != half["grpo"]["prompt_source"]["sha256"]
    assert callback_state(resumed, "BanditCallback")["settings"]["strategy/epsilon"] == 0.5
    spot_state = callback_state(resumed, "SpotDrafterCallback")
    assert spot_state["settings"]["config"]["training"]["lr"] == 1e-3
    assert spot_state["optimizer"]["param_groups"][0]["lr"] == 1e-3
