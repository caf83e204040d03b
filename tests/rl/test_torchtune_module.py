"""TorchtuneGRPOModule: GRPO + TLT with a torchtune policy, the same training as GRPOModule's."""

from __future__ import annotations

import base64
import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.rl.test_module import MirrorRecord, Record, SpecRecord, make_module, make_trainer
from tlt_lightning.models import load_model
from tlt_lightning.rl.batch import PolicyBatch, completion_logprobs
from tlt_lightning.rl.module import GRPOModule


@pytest.fixture(scope="module")
def tt():
    """``(torchtune_module, torchtune_target)``; skips without the torchtune extra."""
    pytest.importorskip("torchtune")
    return (
        importlib.import_module("tlt_lightning.rl.torchtune_module"),
        importlib.import_module("tlt_lightning.models.torchtune_target"),
    )


def padded_batch() -> PolicyBatch:
    """Four right-padded prompt + completion rows of different prompt and completion lengths."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [3]]
    completions = [[20, 21, 22, 23], [30, 31, 32, 33, 34, 35], [40], [50, 51, 52]]
    B, S = len(prompts), max(len(p) + len(c) for p, c in zip(prompts, completions))
    T = max(map(len, completions))
    input_ids, attention_mask = torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.long)
    tokens, mask = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attention_mask[i, : len(p) + len(c)] = 1
        tokens[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), True
    prompt_lens = torch.tensor([len(p) for p in prompts])
    return PolicyBatch(
        input_ids, attention_mask, prompt_lens, tokens, mask, torch.zeros(B), torch.zeros(B, T)
    )


def configured(cls, model: str, **kwargs) -> GRPOModule:
    module = make_module(cls=cls, model=model, temperature=0.7, **kwargs)
    module.configure_model()
    return module


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_policy_logprobs_equal_grpo_modules_on_the_same_weights(tt, model):
    """Same log-probabilities (1e-5, fp32) and the same embedding gradient as the transformers policy;
    gradient checkpointing changes neither."""
    TorchtuneGRPOModule = tt[0].TorchtuneGRPOModule
    batch = padded_batch()
    hf = configured(GRPOModule, model)
    tune = configured(TorchtuneGRPOModule, model)
    ckpt = configured(TorchtuneGRPOModule, model, gradient_checkpointing=True)
    results = []
    for module, embedding in (
        (hf, lambda m: m.policy.get_input_embeddings()),
        (tune, lambda m: m.policy.tok_embeddings),
        (ckpt, lambda m: m.policy.tok_embeddings),
    ):
        logprobs = module.policy_logprobs(batch)
        (logprobs * batch.mask).sum().backward()
        results.append((logprobs.detach(), embedding(module).weight.grad))
    (ref, ref_grad), *others = results
    assert ref.shape == (4, 6) and bool((ref[batch.mask] < -0.5).all())  # real, spread distributions
    for logprobs, grad in others:
        torch.testing.assert_close(logprobs[batch.mask], ref[batch.mask], rtol=1e-5, atol=1e-5)
        assert float(ref_grad.norm()) > 0.1
        assert float((grad - ref_grad).norm() / ref_grad.norm()) < 1e-4  # fp32 summation-order noise only


def test_kl_reference_is_the_same_function_as_the_initial_torchtune_policy(tt):
    module = configured(tt[0].TorchtuneGRPOModule, "tiny-llama", kl_coef=0.1)
    batch = padded_batch()
    logprobs = module.policy_logprobs(batch)
    ref = completion_logprobs(module.reference, batch, module.rollout_settings.temperature)
    torch.testing.assert_close(ref[batch.mask], logprobs.detach()[batch.mask], rtol=1e-5, atol=1e-5)
    out = module.policy_loss(
        batch._replace(advantages=torch.tensor([1.0, -1.0, 0.5, -0.5])), logprobs, batch.mask.sum().float()
    )
    assert abs(float(out.kl.detach())) < 1e-9 and math.isfinite(float(out.loss.detach()))


def test_two_step_fit_with_speculative_rollouts_on_the_torchtune_target(tt):
    """The GRPO + TLT step of GRPOModule, on a torchtune policy: it trains, the drafter runs on the
    torchtune target, the rollouts agree with the training forward, and the first step samples what
    GRPOModule samples on the same weights."""
    module_cls, target_mod = tt
    runs = {}
    for cls in (GRPOModule, module_cls.TorchtuneGRPOModule):
        module, record, spec = (
            make_module(cls=cls, drafter_kind="eagle1", max_new_tokens=12),
            Record(),
            SpecRecord(),
        )
        trainer = make_trainer(2, callbacks=[record, spec])
        trainer.fit(module)
        runs[cls] = (module, record, spec, trainer)
    module, record, spec, trainer = runs[module_cls.TorchtuneGRPOModule]
    assert trainer.global_step == 2
    assert isinstance(module.policy, target_mod.TransformerDecoder)
    assert (
        isinstance(module.policy_target, target_mod.TorchtuneTarget)
        and module.policy_target.decoder is module.policy
    )
    assert module.rollout_target is module.policy_target and module.rollout_policy is None
    assert module.drafter._refs.embedding is module.policy.tok_embeddings
    assert spec.speculative == [True, True]
    assert all(math.isfinite(float(out["loss"])) for out in record.outputs)
    assert float(trainer.logged_metrics["train/logprob_drift"]) < 1e-4
    before = dict(target_mod.torchtune_from_hf(load_model("tiny-llama", seed=0).model).named_parameters())
    after = dict(module.policy.named_parameters())
    assert after.keys() == before.keys() and "layers.0.attn.q_proj.weight" in after
    assert all(not torch.equal(after[k], before[k]) for k in before)  # every parameter moved (lr 1e-2)
    assert all(k.startswith("policy.") for k in module.state_dict())
    # Same weights, same seed: the first rollouts are GRPOModule's, token for token.
    hf_record = runs[GRPOModule][1]
    assert record.tokens[0] == hf_record.tokens[0]
    torch.testing.assert_close(record.outputs[0]["loss"], hf_record.outputs[0]["loss"], rtol=1e-4, atol=1e-6)


def test_bf16_rollout_mirror_is_a_torchtune_decoder(tt):
    module_cls, target_mod = tt
    module = make_module(
        cls=module_cls.TorchtuneGRPOModule, rollout_dtype="bfloat16", drafter_kind="eagle1", max_new_tokens=12
    )
    record, spec = MirrorRecord(), SpecRecord()
    make_trainer(2, callbacks=[record, spec]).fit(module)
    mirror = module.rollout_policy
    assert isinstance(mirror, target_mod.TransformerDecoder) and mirror is not module.policy
    assert (
        isinstance(module.rollout_target, target_mod.TorchtuneTarget)
        and module.rollout_target.decoder is mirror
    )
    assert module.rollout_target.dtype == torch.bfloat16 and module.policy_target.dtype == torch.float32
    assert mirror.output.weight is mirror.tok_embeddings.weight  # the copy stays tied, like the policy
    assert module.drafter.dtype == torch.bfloat16 and module.drafter._refs.embedding is mirror.tok_embeddings
    assert spec.speculative == [True, True]
    assert record.in_sync == [True, True]  # each rollout sampled on the latest weights, rounded
    assert all(0 < d < 0.2 for d in record.drifts)  # bf16 sampling, fp32 training
    assert all(k.startswith("policy.") for k in module.state_dict())  # the mirror is not checkpointed


def test_spot_drafter_trains_on_the_torchtune_policy_and_serves_on_its_bf16_mirror(tt, tmp_path):
    """TLT's adaptive drafter: trained in fp32 on the torchtune policy, published to bf16 copies that
    draft on the torchtune mirror."""
    import lightning as L

    from tlt_lightning.callbacks import SpotDrafterCallback
    from tlt_lightning.rl import RolloutListener

    module = make_module(cls=tt[0].TorchtuneGRPOModule, rollout_dtype="bfloat16", drafter_kind="eagle1")
    spot, served = SpotDrafterCallback(), []

    class Served(L.Callback, RolloutListener):  # hears each step after the SpotDrafterCallback's listener
        def on_fit_start(self, trainer, pl_module) -> None:
            pl_module.add_rollout_listener(self)

        def begin_step(self, module) -> None:
            d = module.drafter
            served.append((d.dtype, d._refs.embedding is module.rollout_policy.tok_embeddings))

    trainer = make_trainer(2, callbacks=[spot, Served()], default_root_dir=tmp_path)
    trainer.fit(module)
    drafter = spot.spot.drafter
    assert drafter.dtype == torch.float32 and drafter._refs.embedding is module.policy.tok_embeddings
    assert served == [(torch.bfloat16, True)] * 2
    per_step = spot.config.training.max_steps_per_rollout
    assert spot.spot.steps == 2 * per_step and spot.spot.publisher.version == 2
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert math.isfinite(metrics["drafter/loss"]) and metrics["drafter/accept_length"] >= 1.0


def nodes(directory: Path) -> dict[str, dict]:
    """torchtune's ``model:`` (as ``builder``) and ``checkpointer:`` nodes of tiny-llama's weights in
    ``directory``."""
    builder = {
        "_component_": "torchtune.models.llama3_2.llama3_2",
        "vocab_size": 128,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 2,
        "embed_dim": 64,
        "intermediate_dim": 128,
        "max_seq_len": 512,
        "norm_eps": 1e-6,
        "rope_base": 10000,
        "scale_factor": 1,
        "tie_word_embeddings": True,
    }
    checkpointer = {
        "_component_": "torchtune.training.FullModelHFCheckpointer",
        "checkpoint_dir": str(directory),
        "checkpoint_files": ["model.safetensors"],
        "model_type": "LLAMA3_2",
        "output_dir": str(directory.parent / "out"),
    }
    return {"builder": builder, "checkpointer": checkpointer}


def test_builder_nodes_give_the_policy_and_a_torchtune_kl_reference(tt, tmp_path):
    """torchtune's builder + checkpointer: the decoder of the checkpoint; the reference, a frozen copy of
    it."""
    load_model("tiny-llama", seed=0).model.save_pretrained(tmp_path / "tiny")
    module = configured(tt[0].TorchtuneGRPOModule, "tiny-llama", kl_coef=0.1, **nodes(tmp_path / "tiny"))
    named = configured(tt[0].TorchtuneGRPOModule, "tiny-llama")
    batch = padded_batch()
    logprobs = module.policy_logprobs(batch)
    torch.testing.assert_close(
        logprobs, named.policy_logprobs(batch)
    )  # the same function as the converted twin
    assert isinstance(module.reference, tt[1].TransformerDecoder) and module.reference is not module.policy
    assert not any(p.requires_grad for p in module.reference.parameters())
    torch.testing.assert_close(module.reference_logprobs(batch), logprobs.detach())
    out = module.policy_loss(
        batch._replace(advantages=torch.tensor([1.0, -1.0, 0.5, -0.5])), logprobs, batch.mask.sum().float()
    )
    assert abs(float(out.kl.detach())) < 1e-9 and math.isfinite(float(out.loss.detach()))
    assert module.policy_target.info.eos_token_ids == named.policy_target.info.eos_token_ids == (2,)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"checkpointer": None}, "builder and checkpointer go together"),
        ({"builder": "torchtune.models.llama3_2.llama3_2"}, "builder must be a torchtune config node"),
        (
            {"checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer"}},
            "checkpointer needs a checkpoint_dir",
        ),
    ],
)
def test_bad_builder_nodes_are_named(tt, tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        make_module(cls=tt[0].TorchtuneGRPOModule, **{**nodes(tmp_path), **change})
    with pytest.raises(ValueError, match="tokenizer needs builder and checkpointer"):
        make_module(cls=tt[0].TorchtuneGRPOModule, tokenizer={"_component_": "transformers.AutoTokenizer"})


def test_a_torchtune_tokenizer_renders_and_scores_the_task(tt, tmp_path):
    """The tokenizer node: torchtune's Llama 3 tokenizer (a byte-level vocabulary here) renders the task's
    prompts as torchtune's generate recipe does and decodes completions for the task's scorer."""
    (tmp_path / "bytes.tiktoken").write_text(
        "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))
    )
    load_model("tiny-llama", seed=0).model.save_pretrained(tmp_path / "tiny")
    tokenizer = {
        "_component_": "torchtune.models.llama3.llama3_tokenizer",
        "path": str(tmp_path / "bytes.tiktoken"),
    }
    module = make_module(
        cls=tt[0].TorchtuneGRPOModule,
        prompt_source=None,
        tokenizer=tokenizer,
        task={"name": "basic_arithmetic", "size": 4},
        **nodes(tmp_path / "tiny"),
    )
    module.configure_model()
    prompt = module.prompt_source.dataset[0]
    assert prompt.text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert prompt.text.endswith(
        f"{prompt.question}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert module.prompt_source.prompt_ids(0)[:2] == [
        128000,
        128006,
    ]  # <|begin_of_text|>, <|start_header_id|>
    answer = module.tokenizer.encode(
        f"<answer>{prompt.entry['answer']}</answer>", add_bos=False, add_eos=False
    )
    reward = module.prompt_source.score(0, torch.tensor(prompt.input_ids), torch.tensor([*answer, 128009]))
    assert reward.correctness == 1.0 and reward.format > 0


def test_a_checkpoint_dir_without_a_transformers_config_is_refused(tt, tmp_path):
    module = make_module(cls=tt[0].TorchtuneGRPOModule, **nodes(tmp_path))
    with pytest.raises(
        ValueError, match=r"checkpointer.checkpoint_dir: model '.*' not found: .* The policy's architecture"
    ):
        module.configure_model()


def test_make_target_before_configure_model_says_what_to_do(tt):
    module = make_module(cls=tt[0].TorchtuneGRPOModule)
    with pytest.raises(RuntimeError, match=r"call configure_model\(\) first"):
        module.make_target(torch.nn.Linear(2, 2))


def test_missing_extra_names_it(monkeypatch):
    from tlt_lightning import models, rl

    for name in [n for n in sys.modules if n == "torchtune" or n.startswith("torchtune.")] or ["torchtune"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    for package, name in ((models, "torchtune_target"), (rl, "torchtune_module")):
        monkeypatch.delitem(sys.modules, f"{package.__name__}.{name}", raising=False)
        monkeypatch.delattr(package, name, raising=False)
    with pytest.raises(ImportError, match=r"needs torchtune: pip install 'tlt-lightning\[torchtune\]'"):
        rl.TorchtuneGRPOModule  # noqa: B018


def test_importing_the_rl_package_never_imports_torchtune():
    code = "import sys, tlt_lightning.rl; assert 'torchtune' not in sys.modules, 'imported torchtune'"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
