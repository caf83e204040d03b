"""BanditCallback: the bandit drives the speculative rollouts, is logged, checkpointed and plotted."""

from __future__ import annotations

import importlib.util
import json

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import Strategy, StrategyRegistry

from tests.helpers import callback_state
from tests.rl.test_module import make_module, make_trainer
from tlt_lightning.callbacks import BanditCallback, SpotDrafterCallback
from tlt_lightning.callbacks.bandit import bucket_table
from tlt_lightning.scheduling import BEGMABStrategy, FixedStrategy, StepCostModel, UCBStrategy
from tlt_lightning.speculative import DraftSpec, arm_key


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """Trainers default to the working directory for their outputs (plots, drafter checkpoints)."""
    monkeypatch.chdir(tmp_path)


def test_both_callbacks_fit_two_steps(tmp_path):
    bandit, spot = BanditCallback(), SpotDrafterCallback()
    module = make_module(max_new_tokens=12)
    trainer = make_trainer(2, callbacks=[spot, bandit], default_root_dir=tmp_path)
    trainer.fit(module)
    strategy = bandit.strategy
    assert isinstance(strategy, BEGMABStrategy) and module.draft_strategy is strategy
    # The rollouts consulted the bandit at every decode step below the threshold and reported back.
    history = strategy.history
    assert history and {d.mode for d in history} <= {"untried", "explore", "exploit", "unpaired"}
    assert len({arm_key(d.arm) for d in history}) > 1  # it explores several arms
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    last = module.last_rollout.stats
    buckets = {strategy.bucket_labels[strategy.bucket_of(n)] for n in last.step_batch_sizes if n < 32}
    for label in buckets:
        assert metrics[f"bandit/{label}/decisions"] >= 1 and metrics[f"bandit/{label}/reward"] > 0
        assert 0 <= metrics[f"bandit/{label}/best_arm"] < len(strategy.arms[0])
        counts = [metrics[f"bandit/{label}/count/{arm_key(a).replace('/', '_')}"] for a in strategy.arms[0]]
        assert sum(counts) == metrics[f"bandit/{label}/decisions"]
    assert metrics["drafter/version"] == 2.0 and "drafter/loss" in metrics
    # The heat map and the best arms are written at the end of fit, in the run's own directory.
    assert bandit.run_dir == spot.run_dir == tmp_path / "version_0"
    assert (bandit.run_dir / "bandit" / "heatmap.png").stat().st_size > 0
    summary = json.loads((bandit.run_dir / "bandit" / "best_arms.json").read_text())
    assert summary["best_arms"] == {
        label: {"arm": arm_key(arm), "index": strategy.arms[0].index(arm)}
        for label, arm in strategy.best_arms().items()
    }
    assert summary["buckets"] == bucket_table(strategy.values())
    for label, row in summary["buckets"].items():  # the chosen arm is the best-rated one
        if row["chosen"] is not None:
            assert row["chosen"] == summary["best_arms"][label]["arm"]


def test_with_step_costs_the_fit_logs_the_acceptance_and_the_arms_tried(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_LIGHTNING_CACHE", str(tmp_path / "cache"))
    arms = [None, DraftSpec(2), DraftSpec(4)]
    bandit = BanditCallback(BEGMABStrategy(arms, (1, 2, 5)))
    module = make_module(max_new_tokens=12, drafter_kind="eagle1", threshold=9, crossover="measure")
    trainer = make_trainer(2, callbacks=[bandit], default_root_dir=tmp_path)
    trainer.fit(module)
    strategy = bandit.strategy
    assert strategy.step_costs is not None and list((tmp_path / "cache" / "step_costs").glob("*.json"))
    assert 0 < float(trainer.callback_metrics["bandit/accept_estimate"]) < 1
    summary = json.loads((bandit.run_dir / "bandit" / "best_arms.json").read_text())["crossover"]
    assert summary["accept_estimate"] == strategy.accept_estimate
    for size, tried in summary["arms_tried"].items():
        assert "off" in tried and tried == [arm_key(a) for a in strategy.candidates(int(size))]
    # Every decision at a measured batch size was among the arms the costs let it try then.
    assert all(d.arm in arms for d in strategy.history)


def test_bucket_table_sets_plain_against_the_best_speculative_arm():
    table = bucket_table(
        {
            "1": {"off": 80.0, "chain2": 100.0, "chain4": 120.0},
            "2-4": {"off": 200.0, "chain2": 150.0, "chain4": None},
            "5+": {"off": None, "chain2": None},
        }
    )
    assert table["1"] == {
        "plain": 80.0,
        "speculative_arm": "chain4",
        "speculative": 120.0,
        "ratio": 1.5,
        "chosen": "chain4",
    }
    assert table["2-4"]["ratio"] == 0.75 and table["2-4"]["chosen"] == "off"
    assert table["5+"] == {
        "plain": None,
        "speculative_arm": None,
        "speculative": None,
        "ratio": None,
        "chosen": None,
    }


def test_strategy_state_survives_checkpoint_and_resume(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    first = BanditCallback(BEGMABStrategy(epsilon=0.3, seed=1))
    trainer = make_trainer(1, callbacks=[first, ckpt], enable_checkpointing=True)
    trainer.fit(make_module(drafter_kind="eagle1"))
    saved = first.strategy.state_dict()
    assert saved["num_updates"] > 0

    resumed, at_load = BanditCallback(BEGMABStrategy(epsilon=0.3, seed=1)), {}

    class AtStart(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            at_load.update(resumed.strategy.state_dict())

    make_trainer(2, callbacks=[resumed, AtStart()]).fit(
        make_module(drafter_kind="eagle1"), ckpt_path=tmp_path / "epoch=0-step=1.ckpt"
    )
    assert at_load == saved  # counts, windows, RNG state and history, exactly
    assert resumed.strategy.state_dict()["num_updates"] > saved["num_updates"]  # and it kept learning

    # The callback's state is the strategy's and its settings; missing keys are tolerated.
    fresh = BanditCallback(BEGMABStrategy(epsilon=0.3, seed=1))
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == {**saved, "settings": fresh.settings()}
    settings = fresh.settings()
    assert settings["strategy"] == "BEGMABStrategy" and settings["strategy/epsilon"] == 0.3
    assert settings["strategy/seed"] == 1 and settings["reproducible"] is False
    assert "heatmap_bins" not in settings and "strategy/cost_model" in settings  # None: plain
    fresh.load_state_dict({"num_updates": 3})
    assert fresh.state_dict()["num_updates"] == 3


class Rewards(L.Callback):
    def __init__(self) -> None:
        self.rewards = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rewards.append(outputs["rewards"].total.tolist())


def reproducible_fit(steps, ckpt_path=None, callbacks=(), **kwargs):
    bandit, rewards = BanditCallback(BEGMABStrategy(epsilon=0.3, seed=2), reproducible=True), Rewards()
    trainer = make_trainer(steps, callbacks=[bandit, rewards, *callbacks], **kwargs)
    trainer.fit(make_module(drafter_kind="eagle1", max_new_tokens=12), ckpt_path=ckpt_path)
    return bandit.strategy, rewards.rewards


def test_reproducible_mode_gives_identical_runs_and_exact_resume(tmp_path):
    first, rewards = reproducible_fit(3)
    assert first.reproducible and first.state_dict()["num_updates"] > 0
    assert len({arm_key(d.arm) for d in first.history}) > 1  # it explores: the choices matter
    again, rewards_again = reproducible_fit(3)
    assert again.state_dict() == first.state_dict() and rewards_again == rewards
    # Interrupted after one step and resumed: the same decisions, rewards and bandit state.
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    reproducible_fit(1, callbacks=[ckpt], enable_checkpointing=True)
    resumed, resumed_rewards = reproducible_fit(3, ckpt_path=tmp_path / "epoch=0-step=1.ckpt")
    assert resumed_rewards == rewards[1:]
    assert resumed.state_dict() == first.state_dict()


def test_resuming_a_wall_time_bandit_in_reproducible_mode_is_refused(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    make_trainer(1, callbacks=[BanditCallback(), ckpt], enable_checkpointing=True).fit(
        make_module(drafter_kind="eagle1")
    )
    match = r"BanditCallback.reproducible: False -> True \(the checkpoint's statistics are in other units\)"
    with pytest.raises(ValueError, match=match):
        reproducible_fit(2, ckpt_path=tmp_path / "epoch=0-step=1.ckpt")
    saved = torch.load(tmp_path / "epoch=0-step=1.ckpt", weights_only=False)
    state = callback_state(saved, "BanditCallback")
    del state["settings"]  # a checkpoint from before the settings were saved: the strategy refuses
    with pytest.raises(ValueError, match="learned with wall time but this strategy uses modelled cost"):
        BanditCallback(reproducible=True).load_state_dict(state)


def test_other_strategies_and_no_speculation(tmp_path):
    fixed = BanditCallback(FixedStrategy(DraftSpec(2)))
    module = make_module(drafter_kind="eagle1")
    make_trainer(1, callbacks=[fixed], default_root_dir=tmp_path).fit(module)
    assert {arm_key(d.arm) for d in fixed.strategy.history} == {"chain2"}
    ucb = BanditCallback(UCBStrategy())
    make_trainer(1, callbacks=[ucb], default_root_dir=tmp_path).fit(make_module())  # no drafter: no decisions
    assert ucb.strategy.history == [] and (ucb.run_dir / "bandit" / "heatmap.png").is_file()


def test_begmab_is_not_a_lightning_strategy():
    assert not isinstance(BEGMABStrategy(), Strategy)
    assert not any(
        "begmab" in name.lower() or "bandit" in name.lower()
        for name in StrategyRegistry.available_strategies()
    )
    assert "not** a Lightning ``Strategy``" in BEGMABStrategy.__doc__


def test_bad_arguments():
    with pytest.raises(TypeError, match="strategy must be a BucketedStrategy .* got object"):
        BanditCallback(object())
    with pytest.raises(ValueError, match="heatmap_bins must be an int >= 1, got 0"):
        BanditCallback(heatmap_bins=0)
    with pytest.raises(ValueError, match=r"cost_model=.* is only used with reproducible=True"):
        BanditCallback(cost_model=StepCostModel())
    with pytest.raises(TypeError, match="reproducible must be a bool, got 'yes'"):
        BanditCallback(reproducible="yes")
    # UCB (or any strategy) can be made reproducible; a strategy's own cost model is kept.
    assert BanditCallback(UCBStrategy(), reproducible=True).strategy.cost_model == StepCostModel()
    own = StepCostModel(base_time=0.2)
    assert BanditCallback(BEGMABStrategy(cost_model=own), reproducible=True).strategy.cost_model is own


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed")
def test_mlflow_logger_gets_the_plots_and_the_drafter(tmp_path):
    from lightning.pytorch.loggers import MLFlowLogger

    logger = MLFlowLogger(
        experiment_name="callbacks",
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
        artifact_location=str(tmp_path / "artifacts"),
    )
    spot, bandit = SpotDrafterCallback({"training": {"max_steps_per_rollout": 1}}), BanditCallback()
    trainer = make_trainer(
        1, callbacks=[spot, bandit], logger=logger, default_root_dir=tmp_path / "run", log_every_n_steps=1
    )
    trainer.fit(make_module())
    client, run = logger.experiment, logger.run_id
    # The final drafter checkpoint is a registered model version: a directory that load_drafter reads.
    listed = {
        a.path
        for folder in ("bandit", "drafter", "drafter/timeline", "drafter/model/step-00000001")
        for a in client.list_artifacts(run, folder)
    }
    assert {
        "bandit/heatmap.png",
        "bandit/best_arms.json",
        "drafter/summary.json",
        "drafter/accept_length.png",
        "drafter/timeline/fit.png",
        "drafter/model/step-00000001/model.safetensors",
        "drafter/model/step-00000001/config.json",
    } <= listed
    assert client.get_metric_history(run, "drafter/loss")
