"""The torchtune-style GRPO recipe: ``_component_`` config, ``key=value`` overrides, the same training as fit."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tlt_lightning import cli
from tlt_lightning.fit import GRPOCLI
from tlt_lightning.rl import GRPOModule, SyntheticPromptSource

pytest.importorskip("torchtune")

from tlt_lightning.recipes.grpo_torchtune import load_config, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "grpo_torchtune.yaml")
TINY = str(ROOT / "configs" / "grpo_tiny.yaml")


def quiet(tmp_path: Path, name: str) -> list[str]:
    """Overrides that keep a run small, silent and inside ``tmp_path``."""
    return ["trainer.max_steps=1", "logger=null", f"output_dir={tmp_path / name}", "module.rollout_progress=false"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """One step of the recipe as configured (no logger): ``(trainer, module, policy weights)``."""
    tmp = tmp_path_factory.mktemp("base")
    trainer, module = run(load_config(CONFIG, quiet(tmp, "run")))
    return trainer, module, {k: v.clone() for k, v in module.policy.state_dict().items()}


def test_the_config_builds_what_it_names(base_run):
    trainer, module, _ = base_run
    assert isinstance(module, GRPOModule) and isinstance(module.prompt_source, SyntheticPromptSource)
    assert module.hparams.model == "tiny-llama" and module.hparams.lr == 0.01
    assert module.drafter is not None  # drafter_kind: eagle1 -> speculative rollouts
    assert trainer.global_step == 1 and trainer.logger is None
    assert any(module.last_rollout.stats.step_speculative)


def test_overrides_follow_torchtune_syntax():
    cfg = load_config(CONFIG, ["module.lr=0.5", "seed=3", "~module.rollout_progress", "logger=null",
                               "callbacks=[]", "module=tlt_lightning.rl.module.GRPOModule", "module.kl_coef=0.1",
                               "trainer.max_steps=2"])
    assert cfg["module"]["lr"] == 0.5 and cfg["module"]["kl_coef"] == 0.1  # a new keyword of the component
    assert cfg["module"]["_component_"] == "tlt_lightning.rl.module.GRPOModule"  # node=path swaps it
    assert cfg["module"]["model"] == "tiny-llama"  # ... and keeps its arguments
    assert "rollout_progress" not in cfg["module"]
    assert cfg["module"]["seed"] == cfg["prompt_source"]["seed"] == 3  # ${seed} sees the override
    assert cfg["logger"] is None and cfg["callbacks"] == [] and cfg["trainer"]["max_steps"] == 2
    uri = load_config(CONFIG, ["logger.tracking_uri=sqlite:////tmp/a=b.db"])["logger"]["tracking_uri"]
    assert uri == "sqlite:////tmp/a=b.db"  # only the first '=' splits


@pytest.mark.parametrize(("override", "match"), [
    ("module.lrr=0.5", r"module.lrr: tlt_lightning.rl.GRPOModule has no parameter 'lrr'; allowed: \['model'"),
    ("trainer.max_stepz=3", "trainer.max_stepz: lightning.pytorch.Trainer has no parameter 'max_stepz'"),
    ("callbacks=[{_component_: tlt_lightning.fit.GRPOProgressBar, refresh: 2}]",
     r"callbacks\[0\].refresh: tlt_lightning.fit.GRPOProgressBar has no parameter 'refresh'"),
    ("nosection.x=1", "override 'nosection.x=1': no section 'nosection' in the config"),
    ("modul=3", r"unknown section 'modul'; allowed: \['seed'"),
    ("module.lr", r"overrides must be key=value \(or ~key to delete one\), got 'module.lr'"),
    ("~module.nothing", "no field 'module.nothing' to delete"),
    ("module=no.such.Thing", "module: _component_ 'no.such.Thing' cannot be imported"),
    ("trainer=null", "override 'trainer=null': trainer cannot be null"),
])
def test_bad_overrides_are_named_before_anything_is_built(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(CONFIG, [override])


def test_recipe_runs_the_same_training_as_fit(tmp_path, monkeypatch, base_run):
    """The recipe and `tlt-lightning fit --config configs/grpo_tiny.yaml` train to the same weights."""
    _, module, weights = base_run
    monkeypatch.setattr(sys, "argv", ["tlt-lightning"])
    fit = GRPOCLI(args=["--config", TINY, "--trainer.max_steps=1", "--trainer.logger=false",
                        f"--trainer.default_root_dir={tmp_path}", "--model.rollout_progress=false"], run=False)
    fit.trainer.fit(fit.model)
    assert [r.token_ids.tolist() for r in fit.model.last_rollout.rollouts] == [
        r.token_ids.tolist() for r in module.last_rollout.rollouts]
    theirs = fit.model.policy.state_dict()
    assert weights.keys() == theirs.keys() and all(torch.equal(weights[k], theirs[k]) for k in weights)


def test_an_override_changes_the_run(tmp_path, base_run):
    base_trainer, base_module, base_weights = base_run
    assert max(r.length for r in base_module.last_rollout.rollouts) > 4
    overrides = [*quiet(tmp_path, "run"), "trainer.max_steps=2", "module.max_new_tokens=4", "module.lr=0.5"]
    trainer, module = run(load_config(CONFIG, overrides))
    assert trainer.global_step == 2 and base_trainer.global_step == 1
    assert max(r.length for r in module.last_rollout.rollouts) <= 4
    assert module.hparams.lr == 0.5
    weights = module.policy.state_dict()
    assert any(not torch.equal(weights[k], base_weights[k]) for k in weights)
    saved = yaml.safe_load((tmp_path / "run" / "recipe_config.yaml").read_text())
    assert saved["module"]["max_new_tokens"] == 4 and saved["trainer"]["max_steps"] == 2


def test_cli_subcommand_runs_the_recipe(tmp_path):
    out = tmp_path / "cli"
    assert cli.main(["--threads", "1", "torchtune", "--config", CONFIG, *quiet(tmp_path, "cli")]) == 0
    (ckpt,) = out.glob("**/last.ckpt")  # the config's ModelCheckpoint callback
    assert torch.load(ckpt, weights_only=False)["global_step"] == 1
    assert yaml.safe_load((out / "recipe_config.yaml").read_text())["logger"] is None
    with pytest.raises(SystemExit, match="torchtune: module.lrr: tlt_lightning.rl.GRPOModule has no parameter 'lrr'"):
        cli.main(["torchtune", "--config", CONFIG, "module.lrr=1"])


def test_missing_extra_names_it(monkeypatch):
    for name in [n for n in sys.modules if n == "torchtune" or n.startswith("torchtune.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"the torchtune recipe needs torchtune: pip install 'tlt-lightning\[torchtune\]'"):
        load_config(CONFIG)


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed")
def test_a_resumed_recipe_continues_its_mlflow_run(tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    common = [f"output_dir={tmp_path / 'out'}", "module.rollout_progress=false", f"logger.tracking_uri={uri}"]
    first, _ = run(load_config(CONFIG, [*common, "trainer.max_steps=1"]))
    (last,) = (tmp_path / "out").glob(f"*/{first.logger.run_id}/checkpoints/last.ckpt")
    second, _ = run(load_config(CONFIG, [*common, "trainer.max_steps=2", f"ckpt_path={last}"]))
    assert second.global_step == 2 and second.logger.run_id == first.logger.run_id
    client = mlflow.MlflowClient(tracking_uri=uri)
    (found,) = client.search_runs([first.logger.experiment_id])
    assert found.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(found.info.run_id, "reward/mean")) == [0, 1]
