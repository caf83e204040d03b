"""The torchtune GRPO recipe: `tune run` by dotted path, torchtune's sections and overrides, the same
training as fit."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tlt_lightning import cli
from tlt_lightning.fit import GRPOCLI
from tlt_lightning.rl import GRPOModule, SyntheticPromptSource

pytest.importorskip("torchtune")

from torchtune.modules import TransformerDecoder

from tlt_lightning.recipes.grpo_torchtune import build_module, load_config, run
from tlt_lightning.rl.torchtune_module import TorchtuneGRPOModule

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "grpo_torchtune.yaml")
SMOLLM2 = str(ROOT / "configs" / "grpo_torchtune_smollm2.yaml")
USER_CACHE = os.environ.get("TLT_LIGHTNING_CACHE")  # where SmolLM2's converted copy is
TINY = str(ROOT / "configs" / "grpo_tiny.yaml")
TUNE = Path(sys.executable).with_name("tune")
# The module's own model instead of torchtune's sections (`node=null` disables an optional node).
NAMED = ["model=null", "checkpointer=null", "module.model=tiny-llama"]


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    """The tiny model's transformers directory (``checkpoint_dir: tiny-llama``) goes to a temporary cache."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TLT_LIGHTNING_CACHE", str(path))
        yield path


def quiet(tmp_path: Path, name: str) -> list[str]:
    """Overrides that keep a run small, silent and inside ``tmp_path``."""
    return [
        "trainer.max_steps=1",
        "logger=null",
        f"output_dir={tmp_path / name}",
        "module.rollout_progress=false",
    ]


def rollouts(module: GRPOModule) -> list[list[int]]:
    return [r.token_ids.tolist() for r in module.last_rollout.rollouts]


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """One step of the recipe as configured (no logger): ``(trainer, module, policy weights)``."""
    tmp = tmp_path_factory.mktemp("base")
    trainer, module = run(load_config(CONFIG, quiet(tmp, "run")))
    return trainer, module, {k: v.clone() for k, v in module.policy.state_dict().items()}


def test_torchtune_sections_build_the_policy(base_run, cache):
    trainer, module, _ = base_run
    assert isinstance(module, TorchtuneGRPOModule) and isinstance(module.policy, TransformerDecoder)
    assert isinstance(module.prompt_source, SyntheticPromptSource)
    assert module.hparams.builder["_component_"] == "torchtune.models.llama3_2.llama3_2"
    assert (
        module.hparams.checkpointer["checkpoint_dir"] == module.hparams.model == "tiny-llama"
    )  # names the model
    assert (cache / "tiny-llama-seed0" / "model.safetensors").is_file()  # what the checkpointer read
    assert module.drafter is not None and any(module.last_rollout.stats.step_speculative)
    assert trainer.global_step == 1 and trainer.logger is None


def test_builder_and_checkpointer_train_as_the_model_name_does(tmp_path, base_run):
    """torchtune's builder + checkpointer give the decoder that torchtune_from_hf converts from tiny-llama."""
    _, module, weights = base_run
    _, named = run(load_config(CONFIG, [*quiet(tmp_path, "named"), *NAMED]))
    assert named.hparams.get("builder") is None and isinstance(named.policy, TransformerDecoder)
    assert rollouts(named) == rollouts(module)
    # The twin's LM head is the embedding parameter registered twice; llama3_2's TiedLinear has none of
    # its own.
    theirs = named.policy.state_dict()
    assert torch.equal(theirs.pop("output.weight"), theirs["tok_embeddings.weight"])
    assert same_weights(weights, theirs)


def test_recipe_runs_the_same_training_as_fit(tmp_path, monkeypatch, base_run):
    """With the transformers policy, the recipe and `tlt-lightning fit` (grpo_tiny.yaml) train to the
    same weights."""
    _, recipe = run(
        load_config(CONFIG, [*quiet(tmp_path, "hf"), *NAMED, "module=tlt_lightning.rl.GRPOModule"])
    )
    assert type(recipe) is GRPOModule
    monkeypatch.setattr(sys, "argv", ["tlt-lightning"])
    fit = GRPOCLI(
        args=[
            "--config",
            TINY,
            "--trainer.max_steps=1",
            "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path / 'fit'}",
            "--model.rollout_progress=false",
        ],
        run=False,
    )
    fit.trainer.fit(fit.model)
    assert rollouts(fit.model) == rollouts(recipe)
    assert same_weights(recipe.policy.state_dict(), fit.model.policy.state_dict())


def test_overrides_follow_torchtune_syntax():
    cfg = load_config(
        CONFIG,
        [
            "module.optim.lr=0.5",
            "seed=3",
            "~module.rollout_progress",
            "logger=null",
            "callbacks=[]",
            "module=tlt_lightning.rl.torchtune_module.TorchtuneGRPOModule",
            "module.optim.kl_coef=0.1",
            "trainer.max_steps=2",
            "model.num_layers=2",
        ],
    )
    assert cfg.module.optim.lr == 0.5 and cfg.module.optim.kl_coef == 0.1  # a new keyword of the group
    assert (
        cfg.module._component_ == "tlt_lightning.rl.torchtune_module.TorchtuneGRPOModule"
    )  # node=path swaps it
    assert cfg.module.optim.group_size == 4  # ... and keeps its arguments
    assert "rollout_progress" not in cfg.module
    assert cfg.module.seed == cfg.prompt_source.seed == 3  # ${seed} sees the override
    assert cfg.logger._component_ is None  # torchtune's node=null: the node is off
    assert list(cfg.callbacks) == [] and cfg.trainer.max_steps == 2 and cfg.model.num_layers == 2


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (
            "module.lrr=0.5",
            r"module: TorchtuneGRPOModule got an unexpected keyword argument 'lrr'; allowed: \['model'",
        ),
        ("trainer.max_stepz=3", "trainer: Trainer got an unexpected keyword argument 'max_stepz'"),
        (
            "model.num_layerz=3",
            r"model: llama3_2 got an unexpected keyword argument 'num_layerz'; allowed: \['vocab_size'",
        ),
        (
            "checkpointer.checkpoint_dirr=x",
            "checkpointer: FullModelHFCheckpointer got an unexpected keyword argument",
        ),
        (
            "callbacks=[{_component_: tlt_lightning.callbacks.GRPOProgressBar, refresh: 2}]",
            r"callbacks\[0\]: GRPOProgressBar got an unexpected keyword argument 'refresh'",
        ),
        ("nosection.x=1", r"unknown config sections \['nosection'\]; allowed: \['seed'"),
        ("modul=3", r"unknown config sections \['modul'\]"),
        ("module.lr", "Command-line overrides must be in the form of key=value, got module.lr"),
        ("~module.nothing", "Could not find key module.nothing in yaml config to remove"),
        ("module=no.such.Thing", "module: _component_ 'no.such.Thing' cannot be imported"),
        ("trainer=null", "trainer must be a node with a _component_"),
        ("model=null", "model and checkpointer go together"),
        (
            "module=tlt_lightning.rl.GRPOModule",
            "with a model section the module must take torchtune builders",
        ),
    ],
)
def test_bad_overrides_are_named_before_anything_is_built(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(CONFIG, [override])


def test_an_override_changes_the_run(tmp_path, base_run):
    base_trainer, base_module, base_weights = base_run
    assert max(r.length for r in base_module.last_rollout.rollouts) > 4
    overrides = [
        *quiet(tmp_path, "run"),
        "trainer.max_steps=2",
        "module.rollout.max_new_tokens=4",
        "module.optim.lr=0.5",
    ]
    trainer, module = run(load_config(CONFIG, overrides))
    assert trainer.global_step == 2 and base_trainer.global_step == 1
    assert max(r.length for r in module.last_rollout.rollouts) <= 4
    assert module.optim_config.lr == 0.5
    assert not same_weights(module.policy.state_dict(), base_weights)
    (saved,) = (tmp_path / "run").glob("version_*/config.yaml")  # no logger: the run's own directory
    saved = yaml.safe_load(saved.read_text())
    assert saved["module"]["rollout"]["max_new_tokens"] == 4 and saved["trainer"]["max_steps"] == 2


def test_sigterm_saves_the_step_and_exits_143_as_fit_does(tmp_path, capsys):
    cfg = load_config(CONFIG, [*quiet(tmp_path, "run"), "trainer.max_steps=4"])
    signal_at_2 = {
        "_component_": "tests.callbacks.test_signals.SignalAt",
        "sig": int(signal.SIGTERM),
        "step": 2,
    }
    cfg.callbacks = [*cfg.callbacks, signal_at_2]
    with pytest.raises(SystemExit) as stopped:
        run(cfg)
    assert stopped.value.code == 143
    (saved,) = (tmp_path / "run").rglob("last.ckpt")
    assert torch.load(saved, weights_only=False)["global_step"] == 2  # the step it was in, saved
    assert (
        f"tlt-lightning torchtune: stopped by SIGTERM after step 2: saved {saved}" in capsys.readouterr().err
    )


def test_cli_subcommand_runs_the_recipe(tmp_path):
    out = tmp_path / "cli"
    assert cli.main(["--threads", "1", "torchtune", "--config", CONFIG, *quiet(tmp_path, "cli")]) == 0
    (ckpt,) = out.glob("**/last.ckpt")  # the config's ModelCheckpoint callback
    assert torch.load(ckpt, weights_only=False)["global_step"] == 1
    with pytest.raises(
        SystemExit, match="torchtune: module: TorchtuneGRPOModule got an unexpected keyword argument 'lrr'"
    ):
        cli.main(["torchtune", "--config", CONFIG, "module.lrr=1"])


def _tune(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "TLT_LIGHTNING_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run([str(TUNE), "run", *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(
    not TUNE.is_file() or importlib.util.find_spec("mlflow") is None,
    reason="torchtune's `tune` or mlflow is not installed",
)
def test_tune_run_launches_the_recipe_by_dotted_path_and_tracks_it_as_fit_does(tmp_path, cache):
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    done = _tune(
        [
            "tlt_lightning.recipes.grpo_torchtune",
            "--config",
            CONFIG,
            "trainer.max_steps=1",
            "threads=1",
            f"output_dir={tmp_path / 'out'}",
            "module.rollout_progress=false",
            f"logger.tracking_uri={uri}",
        ],
        cache,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    client = mlflow.MlflowClient(tracking_uri=uri)
    (found,) = client.search_runs([client.get_experiment_by_name("tlt-lightning-torchtune").experiment_id])
    run_dir = tmp_path / "out" / found.info.experiment_id / found.info.run_id
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 1
    params = found.data.params
    # The whole config: the module's hyper-parameters (defaults too), torchtune's sections, trainer,
    # callbacks.
    assert (
        params["optim/lr"] == "0.01"
        and params["optim/kl_coef"] == "0.0"
        and params["builder/num_layers"] == "4"
    )
    assert params["checkpointer/model_type"] == "LLAMA3_2" and params["trainer/max_steps"] == "1"
    assert params["callbacks/1/_component_"] == "lightning.pytorch.callbacks.ModelCheckpoint"
    assert (
        params["seed"] == "0"
        and params["threads"] == "1"
        and params["module/_component_"].endswith("TorchtuneGRPOModule")
    )
    assert len(params) > 57  # what `fit` logs for grpo_tiny.yaml
    text = Path(
        mlflow.artifacts.download_artifacts(
            run_id=found.info.run_id,
            artifact_path="config.yaml",
            tracking_uri=uri,
            dst_path=str(tmp_path / "art"),
        )
    ).read_text()
    assert text == (run_dir / "config.yaml").read_text()
    assert yaml.safe_load(text)["model"]["_component_"] == "torchtune.models.llama3_2.llama3_2"
    assert client.get_metric_history(found.info.run_id, "reward/mean")


def test_tune_run_refuses_a_recipe_that_is_not_one(monkeypatch):
    """torchtune's own `tune run`, in this process: it runs the package as __main__, which refuses the
    name."""
    from torchtune._cli.tune import main as tune

    argv = ["tune", "run", "tlt_lightning.recipes.drafter_warmup", "--config", CONFIG]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, str(TUNE), *argv[1:]])
    monkeypatch.setattr(sys, "path", list(sys.path))  # tune run appends the working directory
    with pytest.raises(
        SystemExit,
        match="tlt_lightning.recipes.drafter_warmup is not a torchtune recipe; the one "
        "here is tlt_lightning.recipes.grpo_torchtune",
    ):
        tune()


@pytest.mark.parametrize("path", [CONFIG, SMOLLM2])
def test_tune_validate_accepts_the_configs(path, monkeypatch, capsys):
    """torchtune's own `tune validate` (signatures of every top-level node) passes the shipped configs."""
    from torchtune._cli.tune import main as tune

    monkeypatch.setattr(sys, "argv", ["tune", "validate", path])
    tune()
    assert "Config is well-formed!" in capsys.readouterr().out


def test_missing_extra_names_it(monkeypatch):
    monkeypatch.delitem(sys.modules, "tlt_lightning.recipes.grpo_torchtune")  # imported afresh, then put back
    for name in [n for n in sys.modules if n == "torchtune" or n.startswith("torchtune.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(
        ImportError, match=r"the torchtune recipe needs torchtune: pip install 'tlt-lightning\[torchtune\]'"
    ):
        importlib.import_module("tlt_lightning.recipes.grpo_torchtune")


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
    assert (last.parents[1] / "config-resume-1.yaml").is_file()  # the first config is kept, as fit does


@pytest.mark.slow
def test_the_smollm2_recipe_builds_smollm2_with_torchtune_builders(monkeypatch, request):
    """configs/grpo_torchtune_smollm2.yaml: llama3_2's builder + the checkpointer compute SmolLM2's function,
    and the task's prompts are rendered by the checkpoint's tokenizer (its chat template)."""
    if USER_CACHE is None:
        monkeypatch.delenv("TLT_LIGHTNING_CACHE")
    else:
        monkeypatch.setenv("TLT_LIGHTNING_CACHE", USER_CACHE)
    smollm2 = request.getfixturevalue("smollm2")  # the user's cache, not this module's temporary one
    module = build_module(load_config(SMOLLM2, ["logger=null"]))
    module.configure_model()
    assert isinstance(module.policy, TransformerDecoder) and module.prompt_source.name == "chain_sum"
    prompt = module.prompt_source.dataset[0]  # SmolLM2's chat template (tokenizer: null: the checkpoint's)
    assert (
        prompt.text.startswith("<|im_start|>") and smollm2.tokenizer.decode(prompt.input_ids) == prompt.text
    )
    ids = torch.tensor([prompt.input_ids])
    with torch.no_grad():
        torch.testing.assert_close(module.policy(ids), smollm2.model(ids).logits, rtol=1e-4, atol=1e-4)
