"""GRPOModule under Lightning: fits on a tiny model, accumulation, failures, resume, SD rollouts, DDP."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy

from tlt_lightning.models import load_model
from tlt_lightning.rl import OptimConfig, RolloutListener, SpeculativeConfig, TaskConfig
from tlt_lightning.rl.module import GRPOModule, NonFiniteLossError, RewardError
from tlt_lightning.rl.sources import PromptIndexLoader, TaskPromptSource, TokenPromptSource
from tlt_lightning.rollout import RolloutConfig
from tlt_lightning.speculative import DraftSpec

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [3, 4]]


def even_reward(prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> float:
    """Share of even tokens: varies within a group, so GRPO has a signal."""
    return float((completion_ids % 2 == 0).float().mean())


def nan_on_prompt_3(prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> float:
    return float("nan") if prompt_ids.tolist() == PROMPTS[3] else even_reward(prompt_ids, completion_ids)


def raising_reward(prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> float:
    raise ValueError("boom")


GROUPS = {"rollout": RolloutConfig, "optim": OptimConfig, "speculative": SpeculativeConfig}


def grouped(**kwargs) -> dict:
    """Flat settings (``lr=``, ``max_new_tokens=``, ``speculative=False``) as GRPOModule's groups, as
    dicts of fields (so that the module itself builds and checks them)."""
    out, groups = {}, {name: {} for name in GROUPS}
    for key, value in kwargs.items():
        if key == "speculative" and isinstance(value, bool):
            key = "enabled"
        group = next((g for g, cls in GROUPS.items() if key in {f.name for f in fields(cls)}), None)
        if group is None:
            out[key] = value
        else:
            groups[group][key] = value
    return {**out, **{name: values for name, values in groups.items() if values}}


def make_module(reward=even_reward, cls=GRPOModule, **kwargs) -> GRPOModule:
    args = dict(
        model="tiny-llama",
        group_size=4,
        prompts_per_step=2,
        max_new_tokens=8,
        lr=1e-2,
        prompt_source=TokenPromptSource(PROMPTS, reward),
    )
    return cls(**grouped(**{**args, **kwargs}))


def make_trainer(max_steps: int, **kwargs) -> L.Trainer:
    args = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(max_steps=max_steps, **{**args, **kwargs})


def initial_params() -> dict[str, torch.Tensor]:
    return dict(load_model("tiny-llama", seed=0).model.named_parameters())


def params(module: GRPOModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.policy.named_parameters()}


class Record(L.Callback):
    """Keeps what each step produced: batches, outputs, rollouts, gradients before the step."""

    def __init__(self) -> None:
        self.batches, self.tokens, self.outputs, self.grads, self.params = [], [], [], [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append({k: p.grad.clone() for k, p in pl_module.policy.named_parameters()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches.append(batch.tolist())
        self.tokens.append([r.token_ids.tolist() for r in outputs["rollout"].rollouts])
        self.outputs.append(outputs)
        self.params.append(params(pl_module))


# ---------------------------------------------------------------------------------- fit


def test_two_step_fit_trains_and_logs(tmp_path):
    module, record = make_module(), Record()
    trainer = make_trainer(2, callbacks=[record], logger=CSVLogger(tmp_path), log_every_n_steps=1)
    trainer.fit(module)
    assert trainer.global_step == 2
    assert record.batches == [[0, 1], [2, 3]]
    out = record.outputs[-1]
    assert math.isfinite(float(out["loss"]))
    assert out["rewards"].total.shape == (8,) and out["advantages"].shape == (8,)
    before = initial_params()
    changed = [k for k, v in params(module).items() if not torch.equal(v, before[k])]
    assert len(changed) == len(before)  # every parameter moved (AdamW, lr 1e-2)
    expected = {
        "reward/mean",
        "reward/std",
        "reward/accuracy",
        "response/length_mean",
        "response/length_max",
        "rollout/accept_length",
        "rollout/tokens_per_s",
        "time/rollout_s",
        "time/reward_s",
        "time/train_s",
        "train/loss",
        "train/pg_loss",
        "train/kl",
        "train/clip_fraction",
        "train/ratio_mean",
        "train/grad_norm",
        "train/logprob_drift",
    }
    assert expected <= set(trainer.logged_metrics)
    prog_bar = {"reward/mean", "rollout/accept_length", "rollout/tokens_per_s"}
    assert set(trainer.progress_bar_metrics) == prog_bar
    # One optimizer step per rollout batch: the ratio is exactly 1, nothing is clipped.
    assert float(trainer.logged_metrics["train/ratio_mean"]) == 1.0
    assert float(trainer.logged_metrics["train/clip_fraction"]) == 0.0
    assert float(trainer.logged_metrics["train/logprob_drift"]) < 1e-4
    # No drafter, no speculative step: the accept length is NaN (a gap in the history), never 0.
    assert math.isnan(float(trainer.logged_metrics["rollout/accept_length"]))
    (csv,) = tmp_path.rglob("metrics.csv")
    assert "reward/mean" in csv.read_text().splitlines()[0]


def test_state_dict_holds_only_the_policy():
    module = make_module(kl_coef=0.1, drafter_kind="eagle1")
    module.configure_model()
    assert module.reference is not None and module.drafter is not None
    assert all(k.startswith("policy.") for k in module.state_dict())
    assert {id(p) for p in module.parameters()} == {id(p) for p in module.policy.parameters()}


# ---------------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize(("aggregation", "kl_coef"), [("token", 0.0), ("sequence", 0.0), ("token", 0.5)])
def test_micro_batches_give_the_big_batch_gradient(aggregation, kl_coef):
    grads = []
    # all rows at once, 3 rows, 1 row, and packed longest first to 30 padded tokens (1-3 rows)
    for micro in (
        {"micro_batch_size": None},
        {"micro_batch_size": 3},
        {"micro_batch_size": 1},
        {"micro_batch_tokens": 30},
    ):
        record = Record()
        module = make_module(**micro, aggregation=aggregation, kl_coef=kl_coef, max_grad_norm=None)
        make_trainer(1, callbacks=[record]).fit(module)
        grads.append(record.grads[0])
    assert any(float(g.abs().max()) > 0 for g in grads[0].values())
    for other in grads[1:]:
        for name, g in grads[0].items():
            torch.testing.assert_close(other[name], g, rtol=1e-4, atol=1e-7, msg=name)


# ---------------------------------------------------------------------------------- failures


def test_nan_reward_names_task_and_prompt_index():
    match = (
        r"reward total of task 'synthetic' \(reward fn 'nan_on_prompt_3'\) on prompt index 3 "
        r"\(sample 0 of its group\) is nan: rewards must be finite"
    )
    with pytest.raises(RewardError, match=match):
        make_trainer(2).fit(make_module(reward=nan_on_prompt_3))


def huge_reward(prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> float:
    return 3e38 if int(completion_ids.numel()) % 2 else -3e38


def none_reward(prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> float:
    even_reward(prompt_ids, completion_ids)  # forgot to return it


def test_absurd_reward_is_refused_naming_the_limit_and_the_fix():
    match = (
        r"reward total of task 'synthetic' \(reward fn 'huge_reward'\).* is -?3e\+38.*max_abs_reward=1e\+06"
    )
    with pytest.raises(RewardError, match=match):
        make_trainer(1).fit(make_module(reward=huge_reward))
    # A larger limit admits it (the user said so); float32 still holds the values.
    module = make_module(reward=huge_reward, max_abs_reward=1e39)
    assert module.hparams.max_abs_reward == 1e39


def test_reward_fn_returning_none_is_a_reward_error_naming_the_fn():
    match = r"reward fn 'none_reward'.*returned None: it must return a float.*missing `return`"
    with pytest.raises(RewardError, match=match):
        make_trainer(1).fit(make_module(reward=none_reward))


class NoneScoreSource(TokenPromptSource):
    def score(self, index, prompt_ids, completion_ids):
        return None


class NaNCorrectnessSource(TokenPromptSource):
    def score(self, index, prompt_ids, completion_ids):
        return super().score(index, prompt_ids, completion_ids)._replace(correctness=float("nan"))


def test_prompt_source_returning_none_or_nan_correctness_is_refused():
    module = make_module(prompt_source=NoneScoreSource(PROMPTS, even_reward, name="mine"))
    with pytest.raises(
        RewardError, match=r"task 'mine'.* is None, not a Reward with .total and .correctness"
    ):
        make_trainer(1).fit(module)
    module = make_module(prompt_source=NaNCorrectnessSource(PROMPTS, even_reward, name="mine"))
    with pytest.raises(RewardError, match=r"reward correctness of task 'mine'.* is nan"):
        make_trainer(1).fit(module)


class NaNCorrectnessRewards(GRPOModule):
    def compute_rewards(self, indices, result):
        rewards = super().compute_rewards(indices, result)
        return rewards._replace(correctness=torch.full_like(rewards.correctness, float("nan")))


def test_overridden_compute_rewards_with_nan_correctness_is_refused():
    with pytest.raises(RewardError, match=r"reward correctness of task 'synthetic' is nan on prompt index 0"):
        make_trainer(1).fit(make_module(cls=NaNCorrectnessRewards))


def test_raising_reward_names_task_and_prompt_index():
    match = (
        r"task 'synthetic' \(reward fn 'raising_reward'\) on prompt index 0 \(sample 0 of its group\) "
        r"failed: ValueError: boom"
    )
    with pytest.raises(RewardError, match=match):
        make_trainer(1).fit(make_module(reward=raising_reward))


class NaNLossAtStep1(GRPOModule):
    def policy_loss(self, batch, logprobs, num_items):
        out = super().policy_loss(batch, logprobs, num_items)
        return out._replace(loss=out.loss * float("nan")) if self.global_step == 1 else out


def test_non_finite_loss_is_caught_before_the_optimizer_step(tmp_path):
    module, record = make_module(cls=NaNLossAtStep1), Record()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(3, callbacks=[record, ckpt], enable_checkpointing=True)
    match = "non-finite loss or gradient at step 1.*weights are unchanged"
    with pytest.raises(NonFiniteLossError, match=match):
        trainer.fit(module)
    after_step_1 = record.params[0]
    for name, value in params(module).items():
        assert torch.equal(value, after_step_1[name]), name
    # What was saved before the failure is intact and holds the same weights.
    saved = torch.load(tmp_path / "epoch=0-step=1.ckpt", weights_only=False)["state_dict"]
    for name, value in after_step_1.items():
        assert torch.equal(saved[f"policy.{name}"], value), name


class CorruptRolloutLogprobs(GRPOModule):
    def rollout(self, prompts, generator=None):
        result = super().rollout(prompts, generator)
        for r in result.rollouts:
            r.logprobs = r.logprobs - 1.0
        return result


def test_rollout_logprobs_that_disagree_with_the_policy_stop_the_run():
    module = make_module(cls=CorruptRolloutLogprobs)
    with pytest.raises(RuntimeError, match="differ from the rollout's by 1 nats on average"):
        make_trainer(1).fit(module)
    for name, value in params(module).items():
        assert torch.equal(value, initial_params()[name]), name


def test_constructor_errors_name_the_field():
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        make_module(temperature=0.0)
    with pytest.raises(ValueError, match="group_size must be an int >= 2 .*trains nothing.*, got 0"):
        make_module(group_size=0)
    with pytest.raises(ValueError, match=r"group_size must be an int >= 2 \(GRPO's advantage.*, got 1"):
        make_module(group_size=1)
    with pytest.raises(ValueError, match="max_abs_reward must be a finite number > 0, got inf"):
        make_module(max_abs_reward=float("inf"))
    with pytest.raises(ValueError, match="aggregation must be one of"):
        make_module(aggregation="mean")
    with pytest.raises(ValueError, match="top_p must be in"):
        make_module(top_p=0.0)
    with pytest.raises(ValueError, match="name must be one of"):
        GRPOModule(task={"name": "nope"})
    with pytest.raises(
        ValueError, match=r"rollout_decode must be one of \('auto', 'hf', 'lean', 'compiled'\)"
    ):
        make_module(rollout_decode="fast")
    with pytest.raises(ValueError, match="'tiny-llama' has no tokenizer.*TokenPromptSource"):
        GRPOModule(model="tiny-llama").configure_model()


# ---------------------------------------------------------------------------------- resume


def test_resume_continues_identically(tmp_path):
    full, record_full = make_module(), Record()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    make_trainer(3, callbacks=[record_full, ckpt], enable_checkpointing=True).fit(full)

    resumed, record_resumed = make_module(), Record()
    make_trainer(3, callbacks=[record_resumed]).fit(resumed, ckpt_path=tmp_path / "epoch=0-step=1.ckpt")
    # Steps 2 and 3 (the second crosses into epoch 1): same prompts, same samples, same weights.
    assert record_resumed.batches == record_full.batches[1:] == [[2, 3], [0, 1]]
    assert record_resumed.tokens == record_full.tokens[1:]
    for name, value in params(full).items():
        assert torch.equal(params(resumed)[name], value), name
    # load_from_checkpoint builds the model before loading the weights into it.
    loaded = GRPOModule.load_from_checkpoint(
        tmp_path / "epoch=0-step=1.ckpt", prompt_source=TokenPromptSource(PROMPTS, even_reward)
    )
    for name, value in record_full.params[0].items():
        assert torch.equal(params(loaded)[name], value), name


class GlobalDraws(L.Callback):
    """Draws from the global RNGs every step, as user code (a reward, a callback) may."""

    def __init__(self) -> None:
        self.draws = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import random

        import numpy as np

        self.draws.append((float(torch.rand(1)), random.random(), float(np.random.rand())))


def test_resume_restores_the_global_rngs(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    full = GlobalDraws()
    L.seed_everything(0)
    make_trainer(3, callbacks=[full, ckpt], enable_checkpointing=True).fit(make_module())
    resumed = GlobalDraws()
    L.seed_everything(0)  # as the CLI does: without the saved states the draws would repeat step 1's
    make_trainer(3, callbacks=[resumed]).fit(make_module(), ckpt_path=tmp_path / "epoch=0-step=1.ckpt")
    assert resumed.draws == full.draws[1:]
    saved = torch.load(tmp_path / "epoch=0-step=1.ckpt", weights_only=True)["grpo"]
    assert saved["version"] == 2 and set(saved["rng"]) >= {"torch", "python", "numpy"}


def test_resume_on_other_prompts_is_refused_unless_applied(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    make_trainer(1, callbacks=[ckpt], enable_checkpointing=True).fit(make_module())
    other = TokenPromptSource([*PROMPTS, [7, 7]], even_reward, name="other")
    match = (
        r"prompt_source settings that differ from the checkpoint's \(checkpoint -> now\):\n"
        r"  prompt_source.name: 'synthetic' -> 'other'\n  prompt_source.sha256: .*\n"
        r"  prompt_source.size: 4 -> 5\n.*resume_overrides='apply'"
    )
    with pytest.raises(ValueError, match=match):
        make_trainer(2).fit(make_module(prompt_source=other), ckpt_path=tmp_path / "epoch=0-step=1.ckpt")
    module = make_module(prompt_source=other)
    module.resume_overrides = "apply"
    make_trainer(2).fit(module, ckpt_path=tmp_path / "epoch=0-step=1.ckpt")
    assert module.global_step == 2


def test_prompt_index_loader_skips_what_it_served():
    loader = PromptIndexLoader(list(range(6)), batch_size=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    again = PromptIndexLoader(list(range(6)), batch_size=2)
    again.load_state_dict(state)
    assert [b.tolist() for b in again] == [[2, 3], [4, 5]]
    assert [b.tolist() for b in again] == [[0, 1], [2, 3], [4, 5]]  # the next epoch starts over
    again.load_state_dict({"served": 3})  # saved at the end of an epoch: the next starts at 0
    assert len(list(again)) == 3
    again.load_state_dict({})  # missing keys are tolerated
    assert len(list(again)) == 3


# ---------------------------------------------------------------------------------- speculative


class SpecRecord(L.Callback):
    def __init__(self) -> None:
        self.speculative, self.strategies = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stats = pl_module.last_rollout.stats
        self.speculative.append(any(stats.step_speculative))
        self.strategies.extend(s for s in stats.step_arms if s is not None)


def test_speculative_rollouts_in_the_module():
    module, record = make_module(drafter_kind="eagle1", max_new_tokens=12), SpecRecord()
    trainer = make_trainer(2, callbacks=[record])
    trainer.fit(module)
    assert record.speculative == [True, True]
    assert set(record.strategies) == {DraftSpec(4)}
    assert float(trainer.logged_metrics["rollout/accept_length"]) >= 1.0
    # Speculative rollouts are lossless: their log-probs agree with the training forward's.
    assert float(trainer.logged_metrics["train/logprob_drift"]) < 1e-4


def test_injected_strategy_and_speculative_off():
    module, record = make_module(drafter_kind="eagle1"), SpecRecord()
    module.draft_strategy = DraftSpec(2)
    make_trainer(1, callbacks=[record]).fit(module)
    assert set(record.strategies) == {DraftSpec(2)}

    module, record = make_module(drafter_kind="eagle1", speculative=False), SpecRecord()
    make_trainer(1, callbacks=[record]).fit(module)
    assert record.speculative == [False]


class MirrorRecord(L.Callback):
    """Whether the bf16 rollout mirror equals the (rounded) policy when each rollout starts."""

    def __init__(self) -> None:
        self.in_sync, self.drifts = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        mirror = dict(pl_module.rollout_policy.named_parameters())
        self.in_sync.append(
            all(torch.equal(mirror[k], p.to(torch.bfloat16)) for k, p in pl_module.policy.named_parameters())
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.drifts.append(float(trainer.logged_metrics["train/logprob_drift"]))


class ToleranceRecord(L.Callback):
    """The log-probability tolerance each optimizer step is checked against."""

    def __init__(self) -> None:
        self.tolerances: list[float | None] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.tolerances.append(pl_module._step_check.tolerance)


@pytest.mark.parametrize(("precision", "tolerance"), [("32-true", 0.01), ("bf16-mixed", 0.2)])
def test_default_logprob_tolerance_follows_the_training_precision(precision, tolerance):
    # fp32 weights and rollouts: only the trainer's precision differs (fit picks bf16-mixed where
    # bf16 is native), and a bf16 training forward drifts past fp32's 0.01 nats.
    record = ToleranceRecord()
    make_trainer(2, precision=precision, callbacks=[record]).fit(make_module(rollout_dtype=None))
    assert record.tolerances == [tolerance, tolerance]


def test_bf16_rollout_mirror_follows_the_policy():
    module, record = (
        make_module(rollout_dtype="bfloat16", drafter_kind="eagle1", max_new_tokens=12),
        MirrorRecord(),
    )
    trainer = make_trainer(3, callbacks=[record])
    trainer.fit(module)
    assert module.policy.dtype == torch.float32 and module.rollout_policy.dtype == torch.bfloat16
    assert (
        module.rollout_target.model is module.rollout_policy and module.policy_target.model is module.policy
    )
    assert module.drafter.dtype == torch.bfloat16  # a module drafter drafts on the rollout target
    # Every rollout sampled on the weights of the latest optimizer step (the policy moves: lr 1e-2).
    assert record.in_sync == [True, True, True]
    assert initial_params().keys() == params(module).keys()
    assert not all(torch.equal(v, initial_params()[k]) for k, v in params(module).items())
    # bf16 sampling, fp32 training: the log-probabilities differ, within the 16-bit tolerance.
    assert all(0 < d < 0.2 for d in record.drifts)
    assert all(k.startswith("policy.") for k in module.state_dict())  # the mirror is not checkpointed
    with pytest.raises(
        ValueError, match="rollout_dtype must be 'auto', 'float32', 'bfloat16', 'float16' or None"
    ):
        make_module(rollout_dtype="int8")


@pytest.mark.parametrize(("flags", "mirror"), [(["avx512_bf16"], torch.bfloat16), ([], None)])
def test_auto_rollout_dtype_mirrors_in_bf16_only_where_bf16_is_native(monkeypatch, flags, mirror):
    monkeypatch.setattr("tlt_lightning.models.hardware.cpu_bf16_instructions", lambda: flags)
    module = make_module(rollout_dtype="auto")
    make_trainer(1).fit(module)
    assert module.hparams.rollout_dtype == "auto"
    assert module.rollout_dtype == ("bfloat16" if mirror else "float32")
    assert (module.rollout_policy.dtype if module.rollout_policy is not None else None) == mirror


@pytest.mark.parametrize(("flags", "dtype"), [(["amx_bf16"], torch.bfloat16), ([], torch.float32)])
def test_auto_dtype_trains_a_bf16_policy_only_where_bf16_is_native(monkeypatch, flags, dtype):
    monkeypatch.setattr("tlt_lightning.models.hardware.cpu_bf16_instructions", lambda: flags)
    module = make_module(dtype="auto", rollout_dtype="auto")
    make_trainer(1).fit(module)
    assert module.hparams.dtype == "auto" and module.policy.dtype == dtype
    assert module.policy_dtype == str(dtype).removeprefix("torch.")
    assert module.rollout_policy is None  # bf16: the policy samples itself; fp32: no bf16 mirror either
    optimizer = module.optimizers().optimizer
    assert isinstance(optimizer, torch.optim.AdamW) == (dtype == torch.float32)  # bf16: stochastic rounding
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        make_module(dtype="fp8")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_trains_without_the_rollouts_weight_copies(dtype):
    """The packed copies the rollouts decode with are stale once the policy steps: dropped before training
    (remade by the next rollouts), not held through the training peak."""
    module = make_module(dtype=dtype)
    make_trainer(2).fit(module)
    assert module.rollout_target.weight_layout == "packed"
    assert module.rollout_target.release_weight_copies() == 0


@pytest.mark.parametrize(
    ("layout", "rollout_dtype", "column_major"),
    [("in_out", None, True), ("out_in", None, False), ("in_out", "bfloat16", True)],
)
def test_weight_layout_of_the_rollout_model(layout, rollout_dtype, column_major):
    module = make_module(weight_layout=layout, rollout_dtype=rollout_dtype)
    make_trainer(1).fit(module)  # trains through the relaid weights
    rollout_model = module.policy if module.rollout_policy is None else module.rollout_policy
    q_proj = rollout_model.model.layers[0].self_attn.q_proj.weight
    assert module.rollout_target.weight_layout == ("in_out" if column_major else "out_in")
    assert q_proj.is_contiguous() != column_major
    # With a bf16 mirror only the mirror is relaid; the trained fp32 policy keeps PyTorch's layout.
    policy_q_proj = module.policy.model.layers[0].self_attn.q_proj.weight
    assert policy_q_proj.is_contiguous() != (rollout_dtype is None and column_major)
    with pytest.raises(ValueError, match="weight_layout must be one of"):
        make_module(weight_layout="auto")


# ---------------------------------------------------------------------------------- DDP


class SaveRankState(L.Callback):
    def __init__(self, directory: Path) -> None:
        self.directory, self.batches, self.tokens = directory, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches.append(batch.tolist())
        self.tokens.append([r.token_ids.tolist() for r in outputs["rollout"].rollouts])

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(
            {
                "params": params(pl_module),
                "batches": self.batches,
                "tokens": self.tokens,
                "world_size": trainer.world_size,
                "metrics": {k: float(v) for k, v in trainer.logged_metrics.items()},
            },
            self.directory / f"rank{trainer.global_rank}.pt",
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: stochastic rounding alike on both ranks
def test_ddp_two_processes_on_gloo(tmp_path, monkeypatch, dtype):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    module = make_module(prompts_per_step=1, micro_batch_size=2, dtype=dtype)
    strategy = DDPStrategy(process_group_backend="gloo", start_method="spawn")
    trainer = make_trainer(2, devices=2, strategy=strategy, callbacks=[SaveRankState(tmp_path)])
    trainer.fit(module)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [s["world_size"] for s in ranks] == [2, 2]
    assert [len(s["batches"]) for s in ranks] == [2, 2]  # both ranks took both optimizer steps
    # Each rank rolled out its own share of prompts (Lightning's DistributedSampler, seeded shuffle) ...
    shares = [sum(s["batches"], []) for s in ranks]
    assert sorted(shares[0] + shares[1]) == [0, 1, 2, 3]
    assert ranks[0]["tokens"] != ranks[1]["tokens"]
    # ... and DDP kept the replicas identical: the gradients were all-reduced.
    before = initial_params()
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name
    assert any(not torch.equal(v, before[k]) for k, v in ranks[0]["params"].items())
    assert math.isfinite(ranks[0]["metrics"]["train/loss"])
    # The main process got rank 0's weights back.
    for name, value in params(module).items():
        assert torch.equal(value, ranks[0]["params"][name]), name


# ---------------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_smollm2_one_step_on_the_default_task():
    module = GRPOModule(
        model="smollm2-135m",
        task=TaskConfig(name="chain_sum", size=8),
        rollout=RolloutConfig(max_new_tokens=32),
        optim=OptimConfig(group_size=2, prompts_per_step=2),
        rollout_decode="hf",  # as the demo's; compiled rollouts on SmolLM2 are tested in tests/models
    )
    record = Record()
    trainer = make_trainer(1, callbacks=[record])
    trainer.fit(module)
    assert isinstance(module.prompt_source, TaskPromptSource)
    assert math.isfinite(float(record.outputs[0]["loss"]))
    metrics = trainer.logged_metrics
    assert 0 <= float(metrics["reward/mean"]) <= 1.1
    assert 1 <= float(metrics["response/length_max"]) <= 32
    assert float(metrics["train/logprob_drift"]) < 0.05
    assert float(metrics["train/grad_norm"]) > 0 or float(metrics["reward/std"]) == 0


class TensorRewards(GRPOModule):
    def compute_rewards(self, indices, result):
        return torch.zeros(len(result.rollouts))


def test_compute_rewards_must_return_a_reward_batch():
    with pytest.raises(TypeError, match="compute_rewards must return a RewardBatch, got Tensor"):
        make_trainer(1).fit(make_module(cls=TensorRewards))


def test_a_policy_changed_after_setup_no_longer_fits_its_mirror():
    module = make_module(rollout_dtype="bfloat16")
    module.configure_model()
    module.policy.extra = torch.nn.Linear(2, 2)  # e.g. an adapter added after configure_model
    with pytest.raises(ValueError, match=r"no longer match its rollout_dtype mirror \(e.g. \['extra.bias'"):
        module.sync_rollout_policy()


def test_rollout_listeners_hear_each_training_rollout_until_removed():
    class Listener(RolloutListener):
        def __init__(self, name: str, calls: list) -> None:
            self.name, self.calls = name, calls

        def begin_step(self, module) -> None:
            self.calls.append((self.name, "begin", module.global_step))

        def before_rollout(self) -> None:
            self.calls.append((self.name, "before"))

        def after_rollout(self, result) -> None:
            self.calls.append((self.name, "after", len(result.rollouts)))

        def end_step(self, module, result) -> None:  # after the policy update
            self.calls.append((self.name, "end", module.global_step, result is module.last_rollout))

    class OnlyAfter(RolloutListener):  # every event has a default: override only what is needed
        def after_rollout(self, result) -> None:
            calls.append(("c", "after", len(result.rollouts)))

    calls: list = []
    module, first, second = make_module(), Listener("a", calls), Listener("b", calls)
    module.add_rollout_listener(first)
    module.add_rollout_listener(second)
    module.add_rollout_listener(OnlyAfter())
    make_trainer(1).fit(module)
    assert calls == [
        ("a", "begin", 0),
        ("b", "begin", 0),
        ("a", "before"),
        ("b", "before"),
        ("a", "after", 8),
        ("b", "after", 8),
        ("c", "after", 8),
        ("a", "end", 1, True),
        ("b", "end", 1, True),
    ]
    module.remove_rollout_listener(first)
    module.remove_rollout_listener(first)  # not added (any more): ignored
    module.rollout([PROMPTS[0]], torch.Generator().manual_seed(0))  # outside a training step: not heard
    make_trainer(1).fit(module)
    assert calls[9:] == [
        ("b", "begin", 0),
        ("b", "before"),
        ("b", "after", 8),
        ("c", "after", 8),
        ("b", "end", 1, True),
    ]


# ---------------------------------------------------------------------------------- rollout decode


class GraphCounter(L.Callback):
    """The compiled rollout graphs after each step, and each step's ``times``."""

    def __init__(self):
        self.graphs, self.times = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.graphs.append(dict(pl_module.rollout_target.compile_times))
        self.times.append(outputs["times"])


@pytest.mark.parametrize("speculative", [False, True])
def test_compiled_rollouts_compile_before_the_first_rollout_and_never_after(speculative):
    extra = dict(speculative=True, drafter_kind="eagle1", sd_steps=2) if speculative else {}
    module = make_module(rollout_decode="compiled", temperature=1.0, **extra)
    counter = GraphCounter()
    make_trainer(3, callbacks=[counter]).fit(module)
    assert module.rollout_decode == "compiled"
    first, *later = counter.times
    assert first["compile_s"] == module.compile_seconds > 0
    assert all(t["compile_s"] == 0 for t in later)
    # Every graph compiled inside the warm-up, none in a rollout (the warm-up's time holds them all).
    assert counter.graphs[0] and counter.graphs[0] == counter.graphs[-1]
    assert sum(counter.graphs[0].values()) <= module.compile_seconds
    if speculative:  # the verify graphs of the arm (2 drafts + 1: the 3-query bucket) were warmed up
        assert any(bucket.queries == 3 for bucket in counter.graphs[0])


def test_auto_decode_stays_eager_for_a_tiny_model():
    module = make_module()  # rollout_decode="auto"
    make_trainer(1).fit(module)
    assert module.rollout_decode == "hf"
    assert module.compile_seconds == 0.0
