"""The efficiency helpers on a GRPOModule fit (tiny-llama, 2 steps) and DoRA on the drafter."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from tests.rl.test_module import initial_params, make_module, make_trainer, params
from tlt_lightning.efficiency.activation_checkpointing import is_activation_checkpointed
from tlt_lightning.efficiency.callbacks import ActivationCheckpointingCallback, LayerwisePrecisionCallback
from tlt_lightning.efficiency.grpo import grpo_policy_loss, grpo_profile_batch
from tlt_lightning.efficiency.precision import PrecisionConfig

# peft 0.18 still asks transformers for the deprecated name; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


class StepRecord(L.Callback):
    """Per step: the rollout tokens, the gradients the callbacks see before the step, the logged grad norm."""

    def __init__(self) -> None:
        self.tokens, self.grads, self.grad_norms = [], [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append(
            {k: p.grad.clone() for k, p in pl_module.policy.named_parameters() if p.grad is not None}
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.tokens.append([r.token_ids.tolist() for r in outputs["rollout"].rollouts])
        self.grad_norms.append(float(trainer.callback_metrics["train/grad_norm"]))


def _norm(tensors) -> float:
    return float(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors]))
    )


# ---------------------------------------------------------------------------------- dynamic checkpointing


class TrainingCalls(L.Callback):
    """Counts each policy MLP's calls per step from the training forward on (so the backward's
    recomputation counts, the rollout's decoding before it does not)."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.flags: list[list[bool]] = []
        self.training = False

    def on_fit_start(self, trainer, pl_module) -> None:
        for i, layer in enumerate(pl_module.policy.model.layers):
            layer.mlp.register_forward_pre_hook(lambda m, a, i=i: self._count(i))  # recomputation stops early

    def _count(self, i: int) -> None:
        self.training |= torch.is_grad_enabled()  # the rollout decodes without grad
        if self.training and self.calls:
            self.calls[-1][i] += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.calls.append([0] * len(pl_module.policy.model.layers))  # after profiling (callback order)
        self.training = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.flags.append([is_activation_checkpointed(b) for b in pl_module.policy.model.layers])


def test_dynamic_checkpointing_wraps_policy_blocks_and_keeps_the_gradients():
    callback = ActivationCheckpointingCallback(
        budget_fraction=0.6,
        blocks="policy.model.layers.*",
        repeats=1,
        forward_fn=grpo_policy_loss,
        profile_batch_fn=grpo_profile_batch,
    )
    calls, record = TrainingCalls(), StepRecord()
    module = make_module(max_grad_norm=None)
    trainer = make_trainer(2, callbacks=[callback, calls, record])
    trainer.fit(module)
    plan = callback.plan
    assert plan is not None and 0 < len(plan.indices) < 4  # some, not all, of the 4 policy layers
    assert calls.flags == [list(plan.checkpointed)] * 2  # the chosen policy blocks, on both steps
    # Really recomputed: a checkpointed block runs twice per step (forward, backward), the others once.
    assert calls.calls == [[2 if c else 1 for c in plan.checkpointed]] * 2
    assert trainer.callback_metrics["checkpoint/blocks"] == len(plan.indices)
    assert not any(is_activation_checkpointed(b) for b in module.policy.model.layers)  # undone at teardown

    baseline, base_record = make_module(max_grad_norm=None), StepRecord()
    make_trainer(2, callbacks=[base_record]).fit(baseline)
    assert record.tokens[0] == base_record.tokens[0]  # same batch (profiling generates nothing) ...
    assert any(float(g.abs().max()) > 0 for g in base_record.grads[0].values())
    for name, g in base_record.grads[0].items():  # ... same gradients
        torch.testing.assert_close(record.grads[0][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_grpo_profile_batch_is_the_largest_micro_batch():
    module = make_module(micro_batch_size=3, max_new_tokens=5)
    module.configure_model()
    data = grpo_profile_batch(module, torch.tensor([1, 2]))  # prompts [8, 9] and [10, 11, 12, 13], G = 4
    assert data.input_ids.shape == (3, 4 + 5) and data.tokens.shape == (3, 5) and bool(data.mask.all())
    assert data.prompt_lens.tolist() == [4, 4, 4]  # the longest prompts first
    assert data.input_ids[0, :4].tolist() == [10, 11, 12, 13]
    loss = grpo_policy_loss(module, data)
    assert loss.shape == () and loss.requires_grad
    budgeted = make_module(micro_batch_tokens=2 * 9 + 8, max_new_tokens=5)  # 2 rows of 4 + 5 tokens fit
    budgeted.configure_model()
    assert grpo_profile_batch(budgeted, torch.tensor([1, 2])).input_ids.shape == (2, 9)


def test_dynamic_checkpointing_errors_name_the_argument():
    with pytest.raises(TypeError, match="profile_batch_fn must be callable"):
        ActivationCheckpointingCallback(budget_fraction=0.5, profile_batch_fn="first rollout")
    callback = ActivationCheckpointingCallback(budget_fraction=0.5, blocks="policy.model.layers.*")
    with pytest.raises(
        ValueError, match="forward_fn=None profiles training_step, but GRPOModule uses manual"
    ):
        make_trainer(1, callbacks=[callback]).fit(make_module())


# ---------------------------------------------------------------------------------- layerwise precision


class OutputDtypes(L.Callback):
    """Output dtypes of policy modules inside (q_proj, down_proj) and outside (embeddings, head) the
    groups."""

    def __init__(self) -> None:
        self.dtypes: dict[str, set[torch.dtype]] = {}

    def on_fit_start(self, trainer, pl_module) -> None:
        policy = pl_module.policy
        modules = {
            "q_proj": policy.model.layers[0].self_attn.q_proj,
            "down_proj": policy.model.layers[1].mlp.down_proj,
            "embed_tokens": policy.model.embed_tokens,
            "lm_head": policy.lm_head,
        }
        for name, m in modules.items():
            m.register_forward_hook(lambda mod, a, out, name=name: self._record(name, out))

    def _record(self, name: str, out: torch.Tensor) -> None:
        if torch.is_grad_enabled():  # the training forward, not the rollout
            self.dtypes.setdefault(name, set()).add(out.dtype)


def test_layerwise_precision_bf16_on_the_policy_trains():
    callback, dtypes, record = LayerwisePrecisionCallback(module="policy"), OutputDtypes(), StepRecord()
    module = make_module(
        logprob_tolerance=0.2
    )  # 16-bit compute: rollout and training forward differ a little
    make_trainer(2, callbacks=[callback, dtypes, record]).fit(module)
    assert dtypes.dtypes == {
        "q_proj": {torch.bfloat16},
        "down_proj": {torch.bfloat16},
        "embed_tokens": {torch.float32},
        "lm_head": {torch.float32},
    }
    assert all(math.isfinite(n) and n > 0 for n in record.grad_norms)
    before = initial_params()
    after = params(module)
    assert all(v.dtype == torch.float32 for v in after.values())  # fp32 master weights
    assert all(not torch.equal(v, before[k]) for k, v in after.items())  # every parameter moved
    assert not any("forward" in m.__dict__ for m in module.policy.modules())  # undone at teardown


class TrueAndClippedNorms(L.Callback):
    """After the precision callback (list order): the unscaled gradient norm, and the norm the update used."""

    def __init__(self) -> None:
        self.unscaled, self.used = [], []

    def on_train_start(self, trainer, pl_module) -> None:
        params = list(pl_module.policy.parameters())
        trainer.optimizers[0].register_step_post_hook(
            lambda opt, args, kwargs: self.used.append(_norm([p.grad for p in params if p.grad is not None]))
        )

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.unscaled.append(_norm([p.grad for p in pl_module.policy.parameters() if p.grad is not None]))


def test_layerwise_precision_fp16_unscales_before_grpo_clips():
    config = PrecisionConfig(compute_dtype="float16", init_scale=2.0**12)
    callback, norms, record = (
        LayerwisePrecisionCallback(config, module="policy"),
        TrueAndClippedNorms(),
        StepRecord(),
    )
    module = make_module(logprob_tolerance=0.2, max_grad_norm=1e-3)
    trainer = make_trainer(2, callbacks=[callback, norms, record])
    trainer.fit(module)
    assert callback.skipped_steps == 0 and trainer.callback_metrics["precision/scale/mlp"] == 2.0**12
    # GRPOModule clipped the unscaled gradients: it logged their norm, and the update used norm 1e-3.
    # (Clipping the scaled ones, then unscaling, would log a ~4096x norm and step with ~1e-3 / 4096.)
    assert norms.unscaled[-1] > 1e-2
    assert record.grad_norms == pytest.approx(norms.unscaled, rel=1e-4)
    assert norms.used == pytest.approx([1e-3, 1e-3], rel=1e-3)
    assert not all(torch.equal(v, initial_params()[k]) for k, v in params(module).items())


def test_layerwise_precision_fp16_overflow_skips_grpo_steps():
    config = PrecisionConfig(compute_dtype="float16", init_scale=2.0**60)  # overflows fp16 in every group
    callback = LayerwisePrecisionCallback(config, module="policy")
    module = make_module(logprob_tolerance=0.2)
    make_trainer(2, callbacks=[callback]).fit(module)  # no NonFiniteLossError: the callback drops the step
    assert callback.skipped_steps == 2
    before = initial_params()
    assert all(torch.equal(v, before[k]) for k, v in params(module).items())
    assert all(s["scale"] == 2.0**58 for s in callback.state_dict()["scalers"].values())


# ---------------------------------------------------------------------------------- DoRA


def test_dora_on_the_policy_trains_only_adapters_and_merges_exactly():
    pytest.importorskip("peft")
    from tlt_lightning.efficiency.dora import DoraConfig, apply_dora, merge_dora

    module = make_module()
    module.configure_model()
    plain_keys = list(module.policy.state_dict())
    torch.manual_seed(0)  # peft draws the adapters' initial values from the global generator
    module.policy = apply_dora(module.policy, DoraConfig(rank=4))
    frozen = {n: p.detach().clone() for n, p in module.policy.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    trainer = make_trainer(2)
    trainer.fit(module)
    now = dict(module.policy.named_parameters())
    assert all(torch.equal(now[n], v) for n, v in frozen.items())  # the base weights did not train
    assert all(not torch.equal(now[n], v) for n, v in adapters.items())  # every adapter did
    # Rollouts sampled from the adapted policy (peft adapted the rollout target's modules in place).
    assert float(trainer.logged_metrics["train/logprob_drift"]) < 1e-4

    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    module.policy.eval()
    with torch.no_grad():
        adapted = module.policy(input_ids=ids).logits
        initial = initial_model_logits(ids)
    assert (adapted - initial).abs().max() > 1e-3  # the fit changed the model
    module.policy = merge_dora(module.policy)
    assert (
        type(module.policy).__name__ == "LlamaForCausalLM" and list(module.policy.state_dict()) == plain_keys
    )
    with torch.no_grad():
        torch.testing.assert_close(module.policy(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-4)
        out = module.rollout_target.model(input_ids=ids).logits  # the rollout adapter sees the merged weights
    torch.testing.assert_close(out, adapted, rtol=1e-4, atol=1e-4)


def initial_model_logits(ids: torch.Tensor) -> torch.Tensor:
    from tlt_lightning.models import load_model

    return load_model("tiny-llama", seed=0).model.eval()(input_ids=ids).logits


def test_dora_on_the_drafter_trains_with_drafter_train_step_and_merges_exactly():
    pytest.importorskip("peft")
    from tlt_lightning.drafter import Drafter, DrafterConfig, drafter_train_step, make_batches
    from tlt_lightning.efficiency.dora import DoraConfig, apply_dora, merge_dora
    from tlt_lightning.models import HFTarget, load_model
    from tlt_lightning.rollout import RolloutConfig, RolloutEngine

    target = HFTarget(load_model("tiny-llama", seed=0).model)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(target, "eagle1"), target)
    keys = list(drafter.state_dict())
    prompts = torch.randint(3, 128, (4, 4), generator=torch.Generator().manual_seed(0)).tolist()
    config = RolloutConfig(
        max_new_tokens=12, temperature=1.0, feature_layers=drafter.config.rollout_feature_layers
    )
    rollouts = (
        RolloutEngine(target, config).generate(prompts, generator=torch.Generator().manual_seed(0)).rollouts
    )
    (batch,) = make_batches(rollouts, drafter.config, batch_size=4, shuffle=False)

    model = apply_dora(drafter, DoraConfig(rank=4, trainable_modules=("fc",)))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = [drafter_train_step(model, target, batch, optimizer)["loss"] for _ in range(4)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    now = dict(model.named_parameters())
    assert all(torch.equal(now[n], v) for n, v in frozen.items())  # the drafter's own weights stayed
    assert any("lora_A" in n for n in trained) and all(not torch.equal(now[n], v) for n, v in trained.items())

    B, q = batch.tokens.shape
    mask = torch.ones(q, q, dtype=torch.bool).tril().expand(B, 1, q, q)
    model.eval()
    with torch.no_grad():
        adapted = model(batch.tokens, model.lift(batch.features), batch.positions, mask)
    merged = merge_dora(model)
    assert isinstance(merged, Drafter) and list(merged.state_dict()) == keys  # exports as a plain drafter
    with torch.no_grad():
        out = merged(batch.tokens, merged.lift(batch.features), batch.positions, mask)
    torch.testing.assert_close(out, adapted, rtol=1e-4, atol=1e-4)
