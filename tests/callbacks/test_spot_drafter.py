"""SpotDrafterCallback on a tiny GRPO fit: defaults, publishing, paid budget, resume, DDP, errors."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from tests.rl.test_module import PROMPTS, make_module, make_trainer
from tlt_lightning.callbacks import SpotDrafterCallback
from tlt_lightning.drafter import Drafter, DrafterConfig, load_drafter, save_drafter
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rl import RolloutListener
from tlt_lightning.rl.module import GRPOModule
from tlt_lightning.spot import SpotConfig, SpotTrainer, SpotTrainerConfig
from tlt_lightning.spot import trainer as spot_trainer


def budget(steps: int | None = 4, seconds: float | None = 2.0, **config) -> SpotConfig:
    """A SpotConfig whose paid budget (``training``) is ``steps`` drafter steps and ``seconds``."""
    training = SpotTrainerConfig(max_steps_per_rollout=steps, max_seconds_per_rollout=seconds)
    return SpotConfig(training, **config)


def weights(drafter: Drafter) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in drafter.state_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


class Watch(L.Callback, RolloutListener):
    """Placed after the SpotDrafterCallback: what each rollout drafted with (a rollout listener after the
    callback's), what each step produced."""

    def __init__(self, callback: SpotDrafterCallback) -> None:
        self.callback = callback
        self.rollout_weights, self.published, self.versions, self.tokens = [], [], [], []

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.add_rollout_listener(self)

    def begin_step(self, module) -> None:
        assert module.drafter is not self.callback.spot.drafter  # a serving copy, not the trained one
        self.rollout_weights.append(weights(module.drafter))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.published.append(weights(self.callback.spot.drafter))
        self.versions.append(self.callback.spot.publisher.version)
        self.tokens.append(sum(r.length for r in outputs["rollout"].rollouts if r.length >= 2))


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """Trainers default to the working directory for their outputs (plots, drafter checkpoints)."""
    monkeypatch.chdir(tmp_path)


# ---------------------------------------------------------------------------------- defaults


def test_defaults_fit_trains_publishes_and_logs(tmp_path):
    module = make_module()
    callback = SpotDrafterCallback()
    watch = Watch(callback)
    trainer = make_trainer(2, callbacks=[callback, watch], default_root_dir=tmp_path)
    trainer.fit(module)

    # A drafter was built for the tiny target (draft vocabulary capped at its 128 tokens) ...
    drafter = callback.spot.drafter
    assert drafter.config.kind == "eagle1" and drafter.config.draft_vocab_size is None
    assert module.rollout_feature_layers == callback.spot.drafter.config.rollout_feature_layers
    assert module.drafter is callback.spot.drafter and "rollout" not in vars(module)  # restored after fit
    # ... trained between the rollouts (single worker: the paid budget) and published each step.
    per_step = callback.config.training.max_steps_per_rollout
    assert watch.versions == [1, 2] and callback.spot.steps == 2 * per_step
    # Each rollout drafted with the version published before it, not with half-updated weights.
    assert_same(watch.rollout_weights[1], watch.published[0])
    assert not all(torch.equal(watch.rollout_weights[0][k], v) for k, v in watch.published[0].items())
    # The buffer holds every rollout's tokens (rollouts shorter than 2 tokens have no sample).
    assert callback.spot.buffer.num_tokens == sum(watch.tokens) > 0
    assert callback.spot.buffer.stats()["newest_step"] == 1.0
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert math.isfinite(metrics["drafter/loss"]) and 0 <= metrics["drafter/top1"] <= 1
    assert metrics["drafter/version"] == 2.0
    assert metrics["drafter/buffer_tokens"] == sum(watch.tokens)
    assert metrics["drafter/buffer_mb"] == pytest.approx(callback.spot.buffer.size_mb)
    assert metrics["drafter/accept_length"] >= 1.0  # the rollouts speculated with the drafter
    # Honest single-worker accounting: training was paid for, no idle time was recovered.
    assert metrics["drafter/paid_steps"] == metrics["drafter/steps"] == 4
    assert metrics["drafter/tail_steps"] == 0 and metrics["drafter/idle_fraction_recovered"] == 0.0
    assert metrics["drafter/train_seconds"] == metrics["drafter/paid_seconds"] > 0
    assert metrics["drafter/overhead_fraction"] > 0
    # What the speculative steps saved against the rollouts' plain steps (tests/spot/test_savings.py),
    # logged whether or not it bounds the paid budget.
    assert math.isfinite(metrics["drafter/saved_seconds"])
    # Timeline PNGs, the summary and a final async checkpoint, loadable as a deployable drafter, all in
    # the run's own directory (no logger: the first free version_N under default_root_dir).
    assert callback.run_dir == tmp_path / "version_0"
    root = callback.run_dir / "drafter"
    assert (root / "timeline" / "epoch-000.png").stat().st_size > 0
    assert (root / "timeline" / "fit.png").stat().st_size > 0
    summary = json.loads((root / "summary.json").read_text())
    assert summary["checkpoint"] == str(root / "checkpoints" / "step-00000002")
    assert (root / "accept_length.png").stat().st_size > 5_000
    (checkpoint,) = (root / "checkpoints").iterdir()
    assert checkpoint.name == "step-00000002"
    assert_same(weights(load_drafter(checkpoint, module.rollout_target)), weights(callback.spot.drafter))


def test_paid_budget_in_steps_and_seconds(monkeypatch):
    callback = SpotDrafterCallback(budget(3, None))
    trainer = make_trainer(1, callbacks=[callback])
    trainer.fit(make_module())
    assert callback.spot.local_stats["paid_steps"] == 3 and callback.spot.paid_steps == 3

    # The seconds budget on a clock that advances 0.06 s per drafter step (no wall-clock in the test):
    # steps start while elapsed + mean step <= 0.2 s, i.e. at 0, 0.06 and 0.12 s; the one at 0.18 s
    # would end at 0.24 s, past the budget, so it is not started.
    clock, real_train_one = [0.0], SpotTrainer.train_one

    def train_one(self, *args, **kwargs):
        clock[0] += 0.06
        return real_train_one(self, *args, **kwargs)

    monkeypatch.setattr(SpotTrainer, "train_one", train_one)
    monkeypatch.setattr(spot_trainer, "time", SimpleNamespace(time=time.time, perf_counter=lambda: clock[0]))
    callback = SpotDrafterCallback(budget(None, 0.2))
    trainer = make_trainer(1, callbacks=[callback])
    trainer.fit(make_module())
    stats = callback.spot.local_stats
    assert stats["paid_steps"] == 3 and stats["paid_s"] == pytest.approx(0.18)

    callback = SpotDrafterCallback(budget(0))  # only idle time: a single worker never trains
    make_trainer(1, callbacks=[callback]).fit(make_module())
    assert callback.spot.steps == 0 and callback.spot.publisher.version == 0


def test_module_drafter_is_taken_over_and_drafter_path_loads(tmp_path):
    module = make_module(drafter_kind="eagle1")
    module.configure_model()
    own = module.drafter
    callback = SpotDrafterCallback(budget(1))
    make_trainer(1, callbacks=[callback]).fit(module)
    assert callback.spot.drafter is own and module.drafter is own

    target = HFTarget(load_model("tiny-llama", seed=0).model)
    torch.manual_seed(7)
    saved = save_drafter(Drafter(DrafterConfig.from_target(target, "eagle3"), target), tmp_path / "warm")
    callback = SpotDrafterCallback(budget(1, drafter_path=saved))
    loaded = {}

    class AtStart(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            loaded.update(weights(callback.spot.drafter))

    make_trainer(1, callbacks=[callback, AtStart()]).fit(make_module())
    assert callback.spot.drafter.config.kind == "eagle3"
    assert_same(loaded, weights(load_drafter(saved, target)))
    assert callback.spot.buffer.stats()["rollouts"] > 0  # eagle3 features (3 layers + final) were harvested

    with pytest.raises(ValueError, match="drafter_path=.* but the module already has a drafter"):
        trainer = make_trainer(1, callbacks=[SpotDrafterCallback(SpotConfig(drafter_path=saved))])
        trainer.fit(make_module(drafter_kind="eagle1"))
    with pytest.raises(ValueError, match="drafter_path '.*nowhere' is not a drafter directory"):
        callback = SpotDrafterCallback(SpotConfig(drafter_path=tmp_path / "nowhere"))
        make_trainer(1, callbacks=[callback]).fit(make_module())


def test_fp32_drafter_training_with_bf16_rollouts():
    """The trainer's drafter is fp32 on the fp32 policy; rollouts draft with bf16 copies on the mirror."""
    module, callback = make_module(rollout_dtype="bfloat16", drafter_kind="eagle1"), SpotDrafterCallback()
    served = []

    class Served(L.Callback, RolloutListener):
        def on_fit_start(self, trainer, pl_module) -> None:
            pl_module.add_rollout_listener(self)

        def begin_step(self, module) -> None:
            d = module.drafter
            on_mirror = d._refs.head is module.rollout_policy.get_output_embeddings()
            served.append((d.dtype, on_mirror, weights(d)))

    trainer = make_trainer(2, callbacks=[callback, Served()])
    trainer.fit(module)
    assert callback.spot.drafter.dtype == torch.float32
    assert callback.spot.drafter._refs.head is module.policy.get_output_embeddings()
    assert [(dtype, on_mirror) for dtype, on_mirror, _ in served] == [(torch.bfloat16, True)] * 2
    per_step = callback.config.training.max_steps_per_rollout
    assert callback.spot.steps == 2 * per_step and callback.spot.publisher.version == 2
    # Step 2 drafted with version 1: the trainer's weights after step 1, rounded to bf16.
    assert not all(torch.equal(served[0][2][k], v) for k, v in served[1][2].items())
    assert float(trainer.callback_metrics["drafter/accept_length"]) >= 1.0
    final = {k: v.to(torch.bfloat16) for k, v in weights(callback.spot.drafter).items()}
    with callback.spot.publisher.acquire() as lease:
        assert_same(weights(lease.drafter), final)


def test_two_runs_on_one_root_dir_keep_each_others_drafter_checkpoints(tmp_path):
    """The reported loss: a 2-step run after a 4-step run on one default_root_dir (keep=2 each)."""
    long_run, short_run = (
        SpotDrafterCallback(budget(1, checkpoint_interval=1), timeline=False) for _ in range(2)
    )
    make_trainer(4, callbacks=[long_run], default_root_dir=tmp_path).fit(make_module())
    make_trainer(2, callbacks=[short_run], default_root_dir=tmp_path).fit(make_module())
    assert (long_run.run_dir, short_run.run_dir) == (tmp_path / "version_0", tmp_path / "version_1")
    for callback, steps in ((long_run, [3, 4]), (short_run, [1, 2])):
        folder = callback.run_dir / "drafter" / "checkpoints"
        assert sorted(p.name for p in folder.iterdir()) == [f"step-{s:08d}" for s in steps]
        summary = json.loads((callback.run_dir / "drafter" / "summary.json").read_text())
        assert summary["checkpoint"] == str(folder / f"step-{steps[-1]:08d}")


# ---------------------------------------------------------------------------------- resume


def spot_state(callback: SpotDrafterCallback) -> dict:
    spot = callback.spot
    return {
        "drafter": weights(spot.drafter),
        "optimizer": spot.optimizer.state_dict(),
        "buffer": spot.buffer.state_dict(include_data=True),
        "coordinator": spot.coordinator.state_dict(),
        "version": spot.publisher.version,
        "counters": (spot.steps, spot.tail_steps, spot.paid_steps, spot.rl_steps),
    }


def assert_same_state(a: dict, b: dict) -> None:
    assert_same(a["drafter"], b["drafter"])
    for p, state in a["optimizer"]["state"].items():
        assert_same(state, b["optimizer"]["state"][p])
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    items_a, items_b = a["buffer"].pop("items"), b["buffer"].pop("items")
    assert a["buffer"] == b["buffer"] and len(items_a) == len(items_b)
    for x, y in zip(items_a, items_b):
        assert x["step"] == y["step"]
        assert_same({k: v for k, v in x.items() if k != "step"}, {k: v for k, v in y.items() if k != "step"})
    assert a["coordinator"] == b["coordinator"]
    assert a["version"] == b["version"] and a["counters"] == b["counters"]


def test_resume_restores_the_drafter_exactly(tmp_path):
    config = budget(3, None)  # save_buffer: the default
    # Uninterrupted: 2 steps, checkpoints after each; the state after step 1 is kept.
    full, after_1 = SpotDrafterCallback(config), {}

    class Keep(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                after_1.update(spot_state(full))

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    make_trainer(
        2, callbacks=[full, Keep(), ckpt], enable_checkpointing=True, default_root_dir=tmp_path / "full"
    ).fit(make_module())

    # Resumed from step 1: restored exactly at load time, then step 2 gives the same drafter.
    resumed, at_load = SpotDrafterCallback(config), {}

    class AtStart(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            at_load.update(spot_state(resumed))

    make_trainer(2, callbacks=[resumed, AtStart()], default_root_dir=tmp_path / "resumed").fit(
        make_module(), ckpt_path=tmp_path / "ckpt" / "epoch=0-step=1.ckpt"
    )
    assert_same_state(at_load, after_1)
    assert resumed.spot.publisher.version == full.spot.publisher.version == 2
    assert_same(weights(resumed.spot.drafter), weights(full.spot.drafter))
    assert (resumed.spot.steps, resumed.spot.rl_steps) == (full.spot.steps, full.spot.rl_steps) == (6, 2)


def test_load_state_dict_tolerates_missing_keys():
    callback = SpotDrafterCallback(budget(1))
    callback.load_state_dict({"counters": {"steps": 5}})  # before fit: applied at fit start
    seen = {}

    class DuringFit(L.Callback):  # a strategy that restores after setup loads during the fit
        def on_train_start(self, trainer, pl_module):
            before = weights(callback.spot.drafter)
            callback.load_state_dict({"publisher": {"version": 10}})
            seen.update(
                version=callback.spot.publisher.version,
                steps=callback.spot.steps,
                before=before,
                same=weights(callback.spot.drafter),
            )

    make_trainer(1, callbacks=[callback, DuringFit()]).fit(make_module())
    assert seen["version"] == 11 and seen["steps"] == 5  # version restored (and republished), rest kept
    assert_same(seen["same"], seen["before"])
    # 5 restored + 1 trained, published once more
    assert callback.spot.steps == 6 and callback.spot.publisher.version == 12
    assert callback.state_dict()["buffer"]["items"]  # the buffer's data is checkpointed by default
    callback.save_buffer = False  # as SpotDrafterCallback(save_buffer=False): counters only
    assert "items" not in callback.state_dict()["buffer"] and callback.state_dict()["buffer"]["added"] > 0


# ---------------------------------------------------------------------------------- DDP


class Rank1IsTheTail(GRPOModule):
    """Rank 1's rollout takes 0.6 s longer: rank 0 finishes early and should train meanwhile."""

    def rollout(self, prompts, generator=None):
        result = super().rollout(prompts, generator)
        if self.global_rank == 1:
            time.sleep(0.6)
        return result


class SaveRank(L.Callback):
    def __init__(self, directory: Path, callback: SpotDrafterCallback) -> None:
        self.directory, self.callback, self.tail = directory, callback, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.tail.append(self.callback.spot.local_stats["tail_steps"])

    def on_train_end(self, trainer, pl_module) -> None:
        spot = self.callback.spot
        torch.save(
            {
                "drafter": weights(spot.drafter),
                "optimizer": spot.optimizer.state_dict(),
                "tail": self.tail,
                "version": spot.publisher.version,
                "latencies": list(spot.coordinator.latencies),
                "timeline": [(w, str(st.value), a, b) for w, st, a, b in spot.coordinator.timeline()],
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            },
            self.directory / f"rank{trainer.global_rank}.pt",
        )


@pytest.mark.slow  # 25-45 s here: two spawned processes import torch, lightning and transformers
def test_ddp_tail_training_ends_identical_on_both_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    module = make_module(cls=Rank1IsTheTail, prompts_per_step=1)
    # min_idle_s (default 0.05 s): the straggler's "all done" collective completes within it, so the
    # straggler does not start a step; with 0 it could run one before it sees that the tail is over.
    callback = SpotDrafterCallback()
    strategy = DDPStrategy(process_group_backend="gloo", start_method="spawn")
    trainer = make_trainer(
        2,
        devices=2,
        strategy=strategy,
        default_root_dir=tmp_path,
        callbacks=[callback, SaveRank(tmp_path, callback)],
    )
    trainer.fit(module)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    # The early finisher trained in the other's tail, the straggler did not (and paid nothing) ...
    assert all(n > 0 for n in ranks[0]["tail"]) and ranks[1]["tail"] == [0, 0]
    metrics = ranks[0]["metrics"]
    assert metrics["drafter/paid_steps"] == 0 and metrics["drafter/tail_steps"] == ranks[0]["tail"][-1]
    assert 0 < metrics["drafter/idle_fraction_recovered"] <= 1
    # ... it trained through the whole tail and stopped when the tail ended: every training span of
    # rank 0 ends after the straggler's rollout it overlaps ended (preempted by that, not before) ...
    assert ranks[0]["latencies"]  # preempted windows
    training = [(a, b) for _, state, a, b in ranks[0]["timeline"] if state == "training"]
    straggler = [(a, b) for _, state, a, b in ranks[1]["timeline"] if state == "busy"]
    assert training
    for start, end in training:
        (busy_end,) = [b for a, b in straggler if a <= start < b]
        assert end >= busy_end
    # ... and the sync made both ranks' drafters and optimizer states identical.
    assert ranks[0]["version"] == ranks[1]["version"] == 2
    assert_same(ranks[0]["drafter"], ranks[1]["drafter"])
    for p, state in ranks[0]["optimizer"]["state"].items():
        assert_same(state, ranks[1]["optimizer"]["state"][p])
    assert (tmp_path / "version_0" / "drafter" / "timeline" / "fit.png").is_file()


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (dict(training=dict(lr=-1e-3)), "lr must be a finite number > 0, got -0.001"),
        (dict(training=dict(lr=float("nan"))), "lr must be a finite number > 0"),
        (dict(buffer_mb=0), r"buffer_mb must be a finite number > 0 \(MiB\), got 0"),
        (dict(training=dict(packing_budget=1)), "packing_budget must be an int >= 2, got 1"),
        (dict(checkpoint_interval=0), "checkpoint_interval must be an int >= 1 or None, got 0"),
        (dict(min_idle_s=-1), "min_idle_s must be a finite number >= 0, got -1"),
        (
            dict(training=dict(max_steps_per_rollout=-1)),
            "max_steps_per_rollout must be an int >= 0 or None, got -1",
        ),
        (
            dict(training=dict(max_seconds_per_rollout=0)),
            "max_seconds_per_rollout must be a finite number > 0 or None",
        ),
        (
            dict(training=dict(max_steps_per_rollout=None, max_seconds_per_rollout=None)),
            "max_steps_per_rollout and max_seconds_per_rollout are both None",
        ),
        (dict(kind="eagle2"), r"kind must be one of \('eagle1', 'eagle3'\), got 'eagle2'"),
        (dict(draft_vocab_size=0), "draft_vocab_size must be an int >= 1 or None, got 0"),
        (
            dict(drafter_path=3),
            "drafter_path must be a directory path, a models:/ or runs:/ URI, or None, got 3",
        ),
        (dict(recency_decay=0.0), r"recency_decay must be in \(0, 1\], got 0.0"),
        (dict(training=dict(weight_decay=-1)), "weight_decay must be a number >= 0, got -1"),
        (dict(training=dict(max_grad_norm=0)), "max_grad_norm must be a number > 0 or None, got 0"),
        (dict(training=dict(seed=-1)), "seed must be an int >= 0, got -1"),
    ],
)
def test_bad_settings_name_the_setting(config, match):
    with pytest.raises(ValueError, match=match):
        SpotDrafterCallback(config)


def test_config_is_a_spot_config_or_a_dict_of_its_fields():
    callback = SpotDrafterCallback({"kind": "eagle3", "training": {"max_steps_per_rollout": 2}})
    assert callback.config == SpotConfig(SpotTrainerConfig(max_steps_per_rollout=2), kind="eagle3")
    with pytest.raises(ValueError, match=r"lr is a setting of SpotConfig.training: pass \{'training'"):
        SpotDrafterCallback({"lr": 1e-3})
    with pytest.raises(ValueError, match="lrr is not a field of SpotConfig; its fields are"):
        SpotDrafterCallback({"lrr": 1e-3})
    with pytest.raises(TypeError, match="config must be a SpotConfig or a dict of its fields, got int"):
        SpotDrafterCallback(3)


def test_a_fit_config_sets_the_spot_config_as_lightning_cli_does():
    """LightningCLI parses callbacks with jsonargparse: ``init_args: {config: {...}}`` fills the dataclass,
    and its defaults are shown (``fit --print_config``)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(SpotDrafterCallback, "spot")
    init_args = {"config": {"kind": "eagle3", "training": {"max_steps_per_rollout": 2}}, "timeline": False}
    callback = parser.instantiate(parser.parse_object({"spot": init_args})).spot
    assert callback.config == SpotConfig(SpotTrainerConfig(max_steps_per_rollout=2), kind="eagle3")
    assert not callback.timeline
    shown = parser.get_defaults().spot.config
    assert shown.training.max_steps_per_rollout == 4 and shown.kind == "eagle1" and shown.buffer_mb == 256.0


def test_needs_a_grpo_module():
    class Plain(L.LightningModule):
        pass

    callback = SpotDrafterCallback()
    with pytest.raises(TypeError, match="SpotDrafterCallback needs a GRPOModule, got Plain"):
        callback.on_fit_start(make_trainer(1), Plain())


def test_rollouts_after_fit_do_not_train():
    # The wrapper is removed at teardown: a later plain rollout neither trains nor touches the buffer.
    module = make_module()
    callback = SpotDrafterCallback(budget(1))
    make_trainer(1, callbacks=[callback]).fit(module)
    added, steps = callback.spot.buffer.added, callback.spot.steps
    module.rollout([PROMPTS[0]], torch.Generator().manual_seed(0))
    assert (callback.spot.buffer.added, callback.spot.steps) == (added, steps)
