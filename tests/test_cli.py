"""``tlt-lightning`` and its ``fit`` job: LightningCLI configs, key checking, MLflow tracking."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger

from tlt_lightning import cli
from tlt_lightning.callbacks import GRPOProgressBar
from tlt_lightning.fit import GRPOCLI
from tlt_lightning.rl import GRPOModule, SyntheticPromptSource
from tlt_lightning.tracking import mlflow_available, tracking_logger

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "grpo_tiny.yaml")
SMOLLM2 = str(ROOT / "configs" / "grpo_smollm2.yaml")

needs_mlflow = pytest.mark.skipif(not mlflow_available(), reason="the mlflow extra is not installed")


def tmp_args(tmp_path: Path) -> list[str]:
    """Overrides that keep a run's files (MLflow store, checkpoints, config) inside ``tmp_path``."""
    return [
        f"--trainer.logger.init_args.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        f"--trainer.logger.init_args.fallback_dir={tmp_path}/csv",
        f"--trainer.default_root_dir={tmp_path}/fit",
    ]


def mlflow_runs(tmp_path: Path, experiment: str) -> tuple:
    """``(client, runs)`` of ``experiment`` in the sqlite store of :func:`tmp_args`, newest first."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    return client, client.search_runs(
        [client.get_experiment_by_name(experiment).experiment_id], order_by=["start_time DESC"]
    )


# ---------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "argv",
    [
        ["fit", "--model.no_such_key=1"],
        ["--threads", "1", "fit", "--config", TINY, "--model.no_such_key=1"],
    ],
)
def test_fit_rejects_a_bad_key_naming_it(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code != 0
    assert "no_such_key" in capsys.readouterr().err


def test_fit_rejects_a_bad_key_in_the_config_file(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("trainer:\n  max_stepz: 3\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", str(config)])
    assert exit_info.value.code != 0
    assert "max_stepz" in capsys.readouterr().err


def test_fit_refuses_abbreviated_options_naming_the_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", TINY, "--trainer.max_ste=2", "--print_config"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "max_steps" not in captured.out  # no config printed: the command stopped
    assert captured.err.splitlines() == [
        "tlt-lightning fit: error: unrecognized arguments: --trainer.max_ste=2",
        "  unknown option --trainer.max_ste: did you mean --trainer.max_steps?",
        "  see: tlt-lightning fit --help",
    ]


def test_fit_help_is_concise_and_points_to_print_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--help"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 120  # the module's and the Trainer's ~600 lines of options are left out
    assert "--model CONFIG" in out and "--trainer CONFIG" in out and "--ckpt_path" in out
    assert "--model.optim.lr LR" not in out and "--trainer.max_steps MAX_STEPS" not in out
    assert "--print_config` prints them all" in " ".join(out.split())
    options = re.split(r"\n  (?=-)", out.split("options:", 1)[1])
    assert [o.split()[0] for o in options if o.count("default:") > 1] == []  # each default said once


@pytest.mark.parametrize(
    ("missing", "argv", "extra"),
    [
        # The task's prompts (no prompt_source) need reasoning-gym: refused before any model loads.
        ("reasoning_gym", ["fit", "--config", TINY, "--model.prompt_source=null"], "tasks"),
        ("torchtune", ["torchtune", "--config", str(ROOT / "configs" / "grpo_torchtune.yaml")], "torchtune"),
    ],
)
def test_a_missing_extra_is_one_short_screen_naming_it(missing, argv, extra, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # nothing is written, and were it, it lands here
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` fails as if it were not installed
    monkeypatch.delitem(sys.modules, "tlt_lightning.recipes.grpo_torchtune", raising=False)
    assert cli.main(argv, short_errors=True) == 1
    err = capsys.readouterr().err
    assert err.startswith("tlt-lightning: error: MissingExtraError: ")
    assert f"pip install 'tlt-lightning[{extra}]'" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 5
    assert not list(tmp_path.iterdir())


def test_print_config_resolves_the_config_and_overrides(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", TINY, "--model.optim.lr=0.5", "--print_config"])
    assert exit_info.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["model"] == "tiny-llama"
    assert config["model"]["optim"]["lr"] == 0.5
    assert config["model"]["prompt_source"]["class_path"] == "tlt_lightning.rl.SyntheticPromptSource"
    assert config["trainer"]["logger"]["class_path"] == "tlt_lightning.tracking.tracking_logger"


def test_default_config_is_the_real_model_on_the_default_task(capsys):
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", SMOLLM2, "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    model, trainer = config["model"], config["trainer"]
    assert model["model"] == "smollm2-135m"
    assert model["task"]["name"] == "chain_sum" and model["task"]["easy"] is True
    assert model["speculative"]["enabled"] is True and model["rollout_progress"] is True
    assert trainer["log_every_n_steps"] == 1 and trainer["max_steps"] > 0
    assert trainer["default_root_dir"] == "runs/fit"
    assert trainer["logger"]["init_args"]["tracking_uri"] == "sqlite:///runs/mlflow.db"
    callbacks = {c["class_path"] for c in trainer["callbacks"]}
    assert "lightning.pytorch.callbacks.ModelCheckpoint" in callbacks
    assert (
        "tlt_lightning.callbacks.GRPOProgressBar" not in callbacks
    )  # the CLI's default bar (enable_progress_bar)
    assert model["rollout_dtype"] == "auto"
    (bandit,) = [
        c for c in trainer["callbacks"] if c["class_path"] == "tlt_lightning.callbacks.BanditCallback"
    ]
    assert bandit["init_args"]["reproducible"] is False  # the switch is there, off: wall-time rewards


def test_reproducible_bandit_is_a_config_switch(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["tlt-lightning"])
    config = yaml.safe_load(Path(SMOLLM2).read_text())
    (bandit,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("BanditCallback")]
    bandit["init_args"]["reproducible"] = True
    bandit["init_args"]["cost_model"] = {"base_time": 0.05}  # a typed dataclass in the config
    path = tmp_path / "reproducible.yaml"
    path.write_text(yaml.safe_dump(config))
    fit = GRPOCLI(
        args=["--config", str(path), "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"],
        run=False,
    )
    from tlt_lightning.callbacks import BanditCallback
    from tlt_lightning.scheduling import StepCostModel

    (callback,) = [c for c in fit.trainer.callbacks if isinstance(c, BanditCallback)]
    assert callback.reproducible and callback.strategy.cost_model == StepCostModel(base_time=0.05)
    assert callback.strategy.epsilon_half_life == 300  # the rest of the config still applies


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default follows the GPU where there is one")
@pytest.mark.parametrize(("flags", "precision"), [(["amx_bf16"], "bf16-mixed"), ([], "32-true")])
def test_training_precision_defaults_to_what_pays_on_this_cpu(monkeypatch, capsys, flags, precision):
    monkeypatch.setattr("tlt_lightning.models.hardware.cpu_bf16_instructions", lambda: flags)
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", SMOLLM2, "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["precision"] == precision
    with pytest.raises(SystemExit):  # a flag (or the config) still decides
        cli.main(["fit", "--config", SMOLLM2, "--trainer.precision=bf16-mixed", "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["precision"] == "bf16-mixed"


def test_global_threads_option_is_split_off_before_fit():
    split = cli._split_fit(["--threads", "1", "fit", "-c", "x.yaml"])
    assert split == (["--threads", "1"], ["fit", "-c", "x.yaml"])
    assert cli._split_fit(["--threads=2", "fit"]) == (["--threads=2"], ["fit"])
    assert cli._split_fit(["fit", "--print_config"]) == ([], ["fit", "--print_config"])
    assert cli._split_fit(["models"]) is None
    assert cli._split_fit(["bench", "rollout", "fit"]) is None


def test_other_subcommands_still_work(capsys):
    assert cli.main(["--threads", "1", "models"]) == 0
    assert "tiny-llama" in capsys.readouterr().out.split()
    with pytest.raises(SystemExit, match="--threads must be >= 1, got 0"):
        cli.main(["--threads", "0", "fit", "--print_config"])


# ---------------------------------------------------------------------------------- tracking


def test_tracking_logger_falls_back_to_csv_without_mlflow(tmp_path, monkeypatch, caplog):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    assert not mlflow_available()
    with caplog.at_level(logging.WARNING, logger="tlt_lightning.tracking.logger"):
        logger = tracking_logger(fallback_dir=str(tmp_path / "csv"))
    assert isinstance(logger, CSVLogger)
    assert Path(logger.save_dir) == tmp_path / "csv"
    assert [r.getMessage() for r in caplog.records] == [
        "MLflow is not installed (pip install 'tlt-lightning[mlflow]'): "
        f"logging to CSV under {tmp_path / 'csv'} instead"
    ]


@needs_mlflow
def test_tracking_logger_is_mlflow_on_a_sqlite_store(tmp_path):
    logger = tracking_logger(f"sqlite:///{tmp_path}/db/mlflow.db", experiment_name="x", run_name="r")
    assert isinstance(logger, MLFlowLogger)
    assert (tmp_path / "db").is_dir()  # sqlite creates the file, not its directory
    experiment = logger.experiment.get_experiment(logger.experiment_id)  # created on first access
    assert experiment.name == "x"
    assert experiment.artifact_location == (tmp_path / "db" / "mlartifacts").resolve().as_uri()
    assert (tmp_path / "db" / "mlflow.db").is_file()


@needs_mlflow
def test_fit_tiny_config_logs_metrics_and_params_to_mlflow(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # anything a relative default would write lands here
    bandit = "--trainer.callbacks+=tlt_lightning.callbacks.BanditCallback"
    argv = ["--threads", "1", "fit", "--config", TINY, "--trainer.max_steps=2", bandit, *tmp_args(tmp_path)]
    assert cli.main(argv) == 0
    client, runs = mlflow_runs(tmp_path, "tlt-lightning-tiny")
    (run,) = runs
    assert run.info.status == "FINISHED"
    assert run.info.run_name.startswith("fit-")
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted(m.step for m in history) == [0, 1]
    expected = {
        "reward/mean",
        "reward/accuracy",
        "response/length_mean",
        "rollout/accept_length",
        "rollout/tokens_per_s",
        "train/loss",
        "train/grad_norm",
        "time/rollout_s",
    }
    assert expected <= set(run.data.metrics)
    params = run.data.params
    assert (
        params["model"] == "tiny-llama" and params["optim/lr"] == "0.01" and params["optim/group_size"] == "4"
    )
    assert params["prompt_source/init_args/reward"] == "even"
    assert params["trainer/max_steps"] == "2" and params["threads"] == "None"
    assert not [name for name in params if name.startswith("_")]  # no internals (LightningCLI's instantiator)
    assert params["bandit/strategy"] == "BEGMABStrategy" and params["bandit/strategy/epsilon"] == "0.1"
    assert params["bandit/strategy/arms"].startswith("1: off chain1 chain2")
    # The resolved config, as an MLflow artifact and beside the run's checkpoints.
    config = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    assert yaml.safe_load(Path(config).read_text())["trainer"]["max_steps"] == 2
    (beside,) = (tmp_path / "fit").glob(f"*/{run.info.run_id}/config.yaml")
    assert yaml.safe_load(beside.read_text())["model"]["model"] == "tiny-llama"
    # The checkpoint callback of the config: last.ckpt beside it, saved at the end of the run.
    checkpoint = beside.parent / "checkpoints" / "last.ckpt"
    assert torch.load(checkpoint, weights_only=False)["global_step"] == 2
    assert not (tmp_path / "runs").exists() and not (tmp_path / "lightning_logs").exists()


@needs_mlflow
def test_tracking_logger_without_arguments_is_the_project_store(tmp_path, monkeypatch):
    # The logger to use from Python where Lightning's MLFlowLogger() fails (./mlruns file store).
    monkeypatch.chdir(tmp_path)
    logger = tracking_logger()
    assert isinstance(logger, MLFlowLogger) and logger._tracking_uri == "sqlite:///runs/mlflow.db"
    assert logger.experiment.get_experiment(logger.experiment_id).name == "tlt-lightning"
    assert (tmp_path / "runs").is_dir() and not (tmp_path / "mlruns").exists()


@needs_mlflow
def test_fit_plain_mlflow_logger_without_arguments_logs_to_the_sqlite_store(tmp_path, monkeypatch):
    # Lightning's MLFlowLogger() defaults to the ./mlruns file store, which MLflow 3 refuses.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["tlt-lightning"])  # LightningCLI reads args= only
    config = yaml.safe_load(Path(TINY).read_text())
    del config["trainer"]["logger"]  # no tracking_uri anywhere: Lightning's default would apply
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump(config))
    args = ["--config", str(tmp_path / "plain.yaml"), f"--trainer.default_root_dir={tmp_path}/fit"]
    logger = GRPOCLI(args=[*args, "--trainer.logger=MLFlowLogger"], run=False).trainer.logger
    database = (tmp_path / "runs" / "mlflow.db").resolve()
    assert type(logger) is MLFlowLogger and logger._tracking_uri == f"sqlite:///{database}"
    assert database.is_file()  # created (under the store lock) before the logger
    experiment = logger.experiment.get_experiment(logger.experiment_id)
    assert experiment.name == "lightning_logs"  # Lightning's default experiment, in our store
    assert experiment.artifact_location == (tmp_path / "runs" / "mlartifacts").resolve().as_uri()
    assert not (tmp_path / "mlruns").exists()
    given = GRPOCLI(
        args=[
            *args,
            "--trainer.logger=MLFlowLogger",
            f"--trainer.logger.init_args.tracking_uri=sqlite:///{tmp_path}/other.db",
        ],
        run=False,
    )
    assert given.trainer.logger._tracking_uri == f"sqlite:///{tmp_path}/other.db"  # a given URI is kept


@needs_mlflow
def test_fit_reports_a_broken_store_as_a_store_error_not_a_config_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mlflow.db").write_bytes(b"\x00garbage" * 512)  # not a sqlite database
    with pytest.raises(
        SystemExit,
        match=r"tlt-lightning fit: MLflow tracking store 'sqlite:///.*mlflow.db' "
        r"could not be opened \(opening the tracking store\): DatabaseError",
    ):
        cli.main(["fit", "--config", TINY, "--trainer.max_steps=1", *tmp_args(tmp_path)])
    assert "Does not validate" not in capsys.readouterr().err


class StopAt(L.Callback):
    """Ends a fit with an error, as a kill would: after ``step`` (before its checkpoint), or at the end.

    Listed before the SpotDrafterCallback, it runs before that callback's hook of the same name.
    """

    def __init__(self, step: int = 0, at_train_end: bool = False) -> None:
        self.step, self.at_train_end = step, at_train_end

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.at_train_end and trainer.global_step == self.step:
            raise RuntimeError(f"simulated kill at step {self.step}")

    def on_train_end(self, trainer, pl_module) -> None:
        if self.at_train_end:
            raise RuntimeError("simulated kill at the end of training")


def resume_config(tmp_path: Path, name: str, stop: dict | None = None) -> str:
    """The tiny config, a drafter and a Lightning checkpoint every step (and ``StopAt(**stop)``)."""
    config = yaml.safe_load(Path(TINY).read_text())
    config["model"]["rollout_progress"] = False
    config["trainer"]["callbacks"] = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"every_n_train_steps": 1, "save_top_k": 0, "save_last": True},
        },
        *([{"class_path": f"{__name__}.StopAt", "init_args": stop}] if stop is not None else []),
        {
            "class_path": "tlt_lightning.callbacks.SpotDrafterCallback",
            "init_args": {
                "config": {"checkpoint_interval": 1, "training": {"max_steps_per_rollout": 1}},
                "timeline": False,
            },
        },
    ]
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return str(path)


def drafter_versions(client, run_id: str) -> dict[int, str]:
    """``{RL step: version}`` of the drafter versions registered from ``run_id``."""
    found = client.search_model_versions("name='tlt-drafter-tiny-llama'")
    assert {v.run_id for v in found} <= {run_id}
    steps = [int(v.tags["rl_step"]) for v in found]
    assert len(steps) == len(set(steps)), f"a step registered twice: {sorted(steps)}"
    return {int(v.tags["rl_step"]): v.version for v in found}


@needs_mlflow
def test_fit_resumed_after_a_kill_continues_the_same_mlflow_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def fit(config: str, *args: str) -> int:
        return cli.main(
            [
                "--threads",
                "1",
                "fit",
                "--config",
                config,
                "--trainer.enable_progress_bar=false",
                *tmp_args(tmp_path),
                *args,
            ]
        )

    with pytest.raises(RuntimeError, match="simulated kill at step 3"):
        fit(resume_config(tmp_path, "first.yaml", stop={"step": 3}), "--trainer.max_steps=3")
    client, (run,) = mlflow_runs(tmp_path, "tlt-lightning-tiny")
    run_id = run.info.run_id
    client.update_run(run_id, status="RUNNING")  # what a SIGKILL leaves (an exception leaves FAILED)
    (last,) = (tmp_path / "fit").glob(f"*/{run_id}/checkpoints/last.ckpt")
    assert torch.load(last, weights_only=False)["global_step"] == 2

    assert fit(resume_config(tmp_path, "second.yaml"), "--trainer.max_steps=4", f"--ckpt_path={last}") == 0
    client, runs = mlflow_runs(tmp_path, "tlt-lightning-tiny")
    assert [(r.info.run_id, r.info.status) for r in runs] == [(run_id, "FINISHED")]  # one run, finished
    # Every drafter saved is a version of that run: before the kill, at the resume step, after it.
    assert sorted(drafter_versions(client, run_id)) == [1, 2, 3, 4]
    assert sorted(m.step for m in client.get_metric_history(run_id, "reward/mean"))[-1] == 3
    # A parameter the resumed fit changed is kept as a tag (MLflow keeps the first value).
    resumed = client.get_run(run_id).data
    assert resumed.params["trainer/max_steps"] == "3" and resumed.tags["resumed.trainer/max_steps"] == "4"
    # The run's own directory holds both configs and its drafter checkpoints, nothing stray.
    run_dir = last.parent.parent
    assert {"config.yaml", "config-resume-1.yaml"} <= {p.name for p in run_dir.iterdir()}
    assert sorted(p.name for p in (run_dir / "drafter" / "checkpoints").iterdir()) == [
        "step-00000003",
        "step-00000004",
    ]


@needs_mlflow
def test_fit_resumed_after_a_kill_at_the_end_registers_the_final_drafter(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def fit(config: str, *args: str) -> int:
        return cli.main(
            [
                "--threads",
                "1",
                "fit",
                "--config",
                config,
                "--trainer.enable_progress_bar=false",
                "--trainer.max_steps=2",
                *tmp_args(tmp_path),
                *args,
            ]
        )

    with pytest.raises(RuntimeError, match="simulated kill at the end of training"):
        fit(resume_config(tmp_path, "first.yaml", stop={"at_train_end": True}))
    client, (run,) = mlflow_runs(tmp_path, "tlt-lightning-tiny")
    run_id = run.info.run_id
    assert run.info.status == "FAILED"
    assert sorted(drafter_versions(client, run_id)) == [1]  # the final drafter was never registered
    (last,) = (tmp_path / "fit").glob(f"*/{run_id}/checkpoints/last.ckpt")

    # Nothing left to train: the resumed fit only saves and registers the final drafter and finishes the run.
    assert fit(resume_config(tmp_path, "second.yaml"), f"--ckpt_path={last}") == 0
    client, runs = mlflow_runs(tmp_path, "tlt-lightning-tiny")
    assert [(r.info.run_id, r.info.status) for r in runs] == [(run_id, "FINISHED")]
    assert sorted(drafter_versions(client, run_id)) == [1, 2]
    summary = json.loads((last.parent.parent / "drafter" / "summary.json").read_text())
    assert summary["rl_steps"] == 2 and summary["checkpoint"].endswith("step-00000002")


def test_fit_saves_last_ckpt_at_the_final_step_whatever_the_interval(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["tlt-lightning"])
    # The tiny config checkpoints every 5 steps: Lightning alone leaves last.ckpt at step 5 of 7.
    assert (
        cli.main(
            [
                "--threads",
                "1",
                "fit",
                "--config",
                TINY,
                "--trainer.max_steps=7",
                "--trainer.logger=false",
                "--model.rollout_progress=false",
                f"--trainer.default_root_dir={tmp_path}",
            ]
        )
        == 0
    )
    (last,) = tmp_path.glob("version_*/checkpoints/last.ckpt")  # no logger: the run's own version_<N>
    assert torch.load(last, weights_only=False)["global_step"] == 7


def test_fit_without_mlflow_logs_to_csv(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tlt_lightning.tracking.logger.mlflow_available", lambda uri=None: False)
    assert cli.main(["fit", "--config", TINY, "--trainer.max_steps=1", *tmp_args(tmp_path)]) == 0
    (metrics,) = (tmp_path / "csv").rglob("metrics.csv")
    assert "reward/mean" in metrics.read_text().splitlines()[0]
    assert not (tmp_path / "mlflow.db").exists()


def test_cli_builds_the_module_progress_bar_and_trainer_from_the_tiny_config(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["tlt-lightning"])  # args only (LightningCLI warns about both)
    args = [
        "--config",
        TINY,
        "--trainer.max_steps=2",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}",
        "--model.prompt_source.init_args.reward=copy",
    ]
    fit = GRPOCLI(args=args, run=False)
    assert isinstance(fit.model, GRPOModule)
    assert isinstance(fit.model.prompt_source, SyntheticPromptSource)
    assert fit.model.prompt_source.name == "synthetic:copy"
    bar = fit.trainer.progress_bar_callback
    assert isinstance(bar, GRPOProgressBar)
    fit.trainer.fit(fit.model)
    assert fit.trainer.global_step == 2
    assert bar.train_progress_bar.n == 2 and bar.train_progress_bar.total == 2
    shown = bar.get_metrics(fit.trainer, fit.model)
    assert list(shown) == ["reward", "acc", "len", "accept", "tok/s"]
    reward = float(fit.trainer.callback_metrics["reward/mean"])
    assert float(shown["reward"]) == pytest.approx(reward, abs=1e-3)
    assert float(shown["accept"]) >= 1.0  # the config attaches a fresh drafter: speculative rollouts


@pytest.mark.parametrize(
    ("flags", "bar"),
    [
        (["--trainer.enable_progress_bar=false"], None),
        (["--trainer.callbacks+=lightning.pytorch.callbacks.RichProgressBar"], "RichProgressBar"),
    ],
)
def test_the_grpo_bar_is_the_default_bar_only(tmp_path, monkeypatch, flags, bar):
    monkeypatch.setattr(sys, "argv", ["tlt-lightning"])
    args = ["--config", TINY, "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}", *flags]
    fit = GRPOCLI(
        args=args, run=False
    )  # a listed bar beside the default one, or any with the bar off, would raise
    assert type(fit.trainer.progress_bar_callback).__name__ == (bar or "NoneType")
    assert not any(isinstance(c, GRPOProgressBar) for c in fit.trainer.callbacks)


def test_threads_inside_fit_sets_torch_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["tlt-lightning"])
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    GRPOCLI(
        args=[
            "--config",
            TINY,
            "--threads=1",
            "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        run=False,
    )
    assert calls == [1]


# ---------------------------------------------------------------------------------- real model


@pytest.mark.slow
@needs_mlflow
def test_fit_default_config_one_small_step_on_smollm2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small = [
        "--trainer.max_steps=1",
        "--model.optim.prompts_per_step=2",
        "--model.optim.group_size=2",
        "--model.rollout.max_new_tokens=16",
    ]
    assert cli.main(["--threads", "1", "fit", "--config", SMOLLM2, *small, *tmp_args(tmp_path)]) == 0
    client, (run,) = mlflow_runs(tmp_path, "tlt-lightning")
    assert run.info.status == "FINISHED"
    metrics, params = run.data.metrics, run.data.params
    assert 0 <= metrics["reward/mean"] <= 1.1
    assert 1 <= metrics["response/length_max"] <= 16
    # TLT is on: 4 requests are below the threshold of 8, so BEG-MAB may speculate with the spot
    # drafter at every step, which then trains paid steps (a single worker), up to 4 and only as far as
    # half the savings of speculation fund them, and is published if it trained.
    assert metrics["rollout/accept_length"] >= 1.0
    paid = metrics["drafter/paid_steps"]
    assert 0 <= paid <= 4 and (paid > 0) == (metrics["drafter/saved_seconds"] > 0)
    assert metrics["drafter/version"] == float(paid > 0)
    assert params["rollout_dtype"] == "auto"
    assert params["model"] == "smollm2-135m" and params["task/name"] == "chain_sum"
    assert params["task/easy"] == "True" and params["rollout/max_new_tokens"] == "16"
    (checkpoint,) = (tmp_path / "fit").glob(f"*/{run.info.run_id}/checkpoints/*.ckpt")
    assert checkpoint.name == "last.ckpt"
    assert torch.load(checkpoint, weights_only=False, mmap=True)["global_step"] == 1


# ---------------------------------------------------------------------------------- short errors


def test_user_input_errors_print_one_short_screen_on_the_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    argv = [
        "fit",
        "--config",
        TINY,
        "--model.optim.group_size=1",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    assert cli.main(argv, short_errors=True) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[0].startswith("tlt-lightning: error: ValueError: optim.group_size must be an int >= 2")
    assert "got 1" in lines[0] and "Traceback" not in err and len(lines) <= 4
    assert re.fullmatch(r"  \(raised in \S+\.py:\d+\)", lines[1])  # where, whichever module checks it
    assert cli.TRACEBACK_ENV in lines[-1] and "--traceback" in lines[-1]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_traceback_flag_or_env_var_gives_the_exception(tmp_path, monkeypatch, how):
    argv = [
        "fit",
        "--config",
        TINY,
        "--model.optim.group_size=1",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    if how == "flag":
        argv = ["--traceback", "--threads", "1", *argv]
    else:
        monkeypatch.setenv(cli.TRACEBACK_ENV, "1")
    with pytest.raises(ValueError, match="optim.group_size must be an int >= 2"):
        cli.main(argv, short_errors=True)


def test_python_callers_get_the_exception_and_other_subcommands_are_short_too(capsys, monkeypatch):
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    with pytest.raises(ValueError, match="--steps must be >= 1, got 0"):
        cli.main(["drafter", "warmup", "--steps", "0", "--model", "tiny-llama"])
    assert cli.main(["drafter", "warmup", "--steps", "0", "--model", "tiny-llama"], short_errors=True) == 1
    assert capsys.readouterr().err.startswith("tlt-lightning: error: ValueError: --steps must be >= 1, got 0")


def test_console_script_prints_a_short_error(tmp_path):
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop(cli.TRACEBACK_ENV, None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tlt_lightning.cli",
            "fit",
            "--config",
            TINY,
            "--model.max_abs_reward=-1",
            "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 1
    assert (
        "tlt-lightning: error: ValueError: max_abs_reward must be a finite number > 0, got -1" in out.stderr
    )
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) <= 6


def test_a_command_line_error_is_one_line_without_third_party_warnings(tmp_path):
    """torchao and friends warn at import about what the docs already say: the CLI keeps them quiet."""
    import os
    import subprocess
    import sys

    missing = tmp_path / "none"
    out = subprocess.run(
        [sys.executable, "-m", "tlt_lightning.cli", "export-drafter", str(missing), str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"export-drafter: {missing}/config.json not found: {missing} is not a drafter checkpoint"
    ]


def test_flags_are_never_abbreviated(capsys):
    with pytest.raises(SystemExit):
        cli.main(["export-drafter", "ckpt", "out", "--engin", "sglang"])
    assert "unrecognized arguments: --engin sglang\n  unknown option --engin: did you mean --engine?" in (
        capsys.readouterr().err
    )
