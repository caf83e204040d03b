"""The torchtune target adapter: same weights as the HF adapter, same rollouts (skipped without torchtune)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tlt_lightning.drafter import Drafter, DrafterConfig
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop


@pytest.fixture(scope="module")
def tt():
    pytest.importorskip("torchtune")
    return importlib.import_module("tlt_lightning.models.torchtune_target")


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def pair(request, tt):
    """``(HFTarget, TorchtuneTarget)`` over the same weights."""
    model = load_model(request.param, seed=0).model
    return HFTarget(model), tt.TorchtuneTarget.from_hf(model)


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (n,), generator=g).tolist()  # ragged: rows of different lengths
    return [torch.randint(3, 128, (k,), generator=g).tolist() for k in lengths]


def test_greedy_rollout_equals_the_hf_adapters(pair):
    hf, tune = pair
    config = RolloutConfig(max_new_tokens=32, temperature=0.0, feature_layers=(1, 2, 4))
    a = RolloutEngine(hf, config).generate(prompts())
    b = RolloutEngine(tune, config).generate(prompts())
    assert [r.token_ids.tolist() for r in b.rollouts] == [r.token_ids.tolist() for r in a.rollouts]
    assert sum(r.length for r in a.rollouts) > 6 * 8  # real responses, not an immediate EOS everywhere
    assert [r.finish_reason for r in b.rollouts] == [r.finish_reason for r in a.rollouts]
    for x, y in zip(a.rollouts, b.rollouts):
        torch.testing.assert_close(y.features, x.features, rtol=1e-4, atol=1e-4)


def test_forward_matches_hf_with_tree_slots_and_features(pair):
    """A ragged prefill then a tree step (siblings share a position, not a slot) through both adapters."""
    hf, tune = pair
    outs = []
    for target in (hf, tune):
        cache = target.new_cache(2, 16)
        ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
        lens = torch.tensor([4, 2])
        slots = torch.arange(4)
        mask = (slots[None, None] <= slots[None, :, None]) & (slots[None, None] < lens[:, None, None])
        with torch.no_grad():
            first = target(ids, slots.expand(2, 4), mask[:, None], cache, (0, 2, 4))
            cache.lengths[:] = lens
            # Tree: node 0 at position len, nodes 1 and 2 both children of node 0 (position len + 1).
            pos = lens[:, None] + torch.tensor([0, 1, 1])
            tree_slots = lens[:, None] + torch.arange(3)
            kv = int(tree_slots.max()) + 1
            m = torch.arange(kv)[None, None] < lens[:, None, None]  # the committed prefix
            m = m.expand(2, 3, kv).clone()
            for r in range(2):
                L = int(lens[r])
                m[r, 0, L] = True
                m[r, 1, [L, L + 1]] = True
                m[r, 2, [L, L + 2]] = True
            second = target(
                torch.tensor([[11, 12, 13], [14, 15, 16]]), pos, m[:, None], cache, (3,), tree_slots
            )
        outs.append((first, second, target.lm_head(second.hidden)))
    (f1, s1, l1), (f2, s2, l2) = outs
    for x, y in ((f1.hidden, f2.hidden), (f1.features, f2.features), (s1.features, s2.features), (l1, l2)):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)
    assert torch.equal(tune.embed(torch.tensor([3, 4])), hf.embed(torch.tensor([3, 4])))
    assert tune.info == hf.info


def test_grouped_query_layers_attend_without_expanding_the_cache(pair, tt, monkeypatch):
    """Without autograd the grouped path runs for verify-sized steps (equal to the HF adapter's and
    to torchtune's own attention, under autograd or switched off); the layers are restored after
    every forward, one that raises included."""
    hf, tune = pair
    calls = []
    real = tt.grouped_sdpa
    monkeypatch.setattr(tt, "grouped_sdpa", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    attns = [layer.attn for layer in tune.decoder.layers]
    before = [(a.num_kv_heads, a._attention_call) for a in attns]
    n, q = 2, tt.MAX_GROUPED_QUERIES + 6  # a prefill longer than the grouped path takes, then 7 tokens
    ids = torch.randint(3, 128, (n, q + 7), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(q + 7).expand(n, -1)
    causal = pos[:, :, None] >= pos[:, None, :]
    outs = {}
    for name, target, grad in (
        ("hf", hf, False),
        ("grouped", tune, False),
        ("torchtune", tune, True),
        ("switched off", tune, False),
    ):
        cache = target.new_cache(n, q + 7)
        tune.grouped_attention = name != "switched off"
        with torch.set_grad_enabled(grad):
            first = target(ids[:, :q], pos[:, :q], causal[:, None, :q, :q], cache)
            cache.lengths[:] = q
            second = target(ids[:, q:], pos[:, q:], causal[:, None, q:], cache)
        outs[name] = torch.cat([first.hidden, second.hidden], 1).detach()
        if name == "grouped":  # only the 7-token step went grouped, in every layer, with H_kv heads
            assert calls == [torch.Size([n, hf.info.num_kv_heads, q + 7, hf.info.head_dim])] * len(attns)
            calls.clear()
        assert [(a.num_kv_heads, a._attention_call) for a in attns] == before
    assert not calls  # autograd, or switched off: torchtune's own attention
    torch.testing.assert_close(outs["grouped"], outs["hf"], rtol=1e-4, atol=1e-4)
    for name in ("torchtune", "switched off"):
        torch.testing.assert_close(outs["grouped"], outs[name], rtol=1e-5, atol=1e-5)
    tune.grouped_attention = True

    def boom(x):
        raise RuntimeError("boom")

    monkeypatch.setattr(tune.decoder.layers[-1].mlp, "forward", boom)
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
        tune(ids[:, :2], pos[:, :2], causal[:, None, :2, :2], tune.new_cache(n, 2))
    assert [(a.num_kv_heads, a._attention_call) for a in attns] == before


def test_speculative_rollouts_run_on_the_torchtune_target(pair):
    """Lossless: speculative greedy decoding on the torchtune target gives the plain greedy tokens."""
    hf, tune = pair
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(hf, "eagle3"), hf)  # reads the same embedding / LM head
    config = RolloutConfig(max_new_tokens=24, temperature=0.0)
    plain = RolloutEngine(tune, config).generate(prompts(seed=1))
    spec = SpeculativeRolloutLoop(tune, drafter, config).generate(prompts(seed=1))
    assert [r.token_ids.tolist() for r in spec.rollouts] == [r.token_ids.tolist() for r in plain.rollouts]
    assert any(spec.stats.step_speculative)


def test_tied_embeddings_stay_tied(tt):
    model = load_model("tiny-llama").model
    decoder = tt.torchtune_from_hf(model)
    assert decoder.output.weight is decoder.tok_embeddings.weight
    assert not decoder.training


def test_mismatches_and_unsupported_models_are_refused(tt):
    from torchtune.models.llama3 import llama3

    model = load_model("tiny-llama").model
    decoder = tt.torchtune_from_hf(model)
    wrong = LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": 5})
    with pytest.raises(
        ValueError, match="hf_config does not match the decoder: num_hidden_layers is 5, decoder has 4"
    ):
        tt.TorchtuneTarget(decoder, wrong)
    with pytest.raises(
        TypeError, match="decoder must be a torchtune TransformerDecoder, got LlamaForCausalLM"
    ):
        tt.TorchtuneTarget(model, model.config)
    cached = llama3(
        vocab_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=64,
        max_seq_len=64,
        intermediate_dim=128,
    )
    cached.setup_caches(batch_size=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="KV caches set up; build it without setup_caches"):
        tt.TorchtuneTarget(cached, model.config)
    gelu = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "hidden_act": "gelu"}))
    with pytest.raises(
        ValueError, match="hidden_act must be 'silu' to convert a llama model to torchtune, got 'gelu'"
    ):
        tt.torchtune_from_hf(gelu)
    biased = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "attention_bias": True}))
    with pytest.raises(ValueError, match="attention_bias must be False"):
        tt.torchtune_from_hf(biased)
    target = tt.TorchtuneTarget(decoder, model.config)
    cache = target.new_cache(1, 8)
    with pytest.raises(ValueError, match=r"attention_mask must be \[n, 1, q, kv_len\] = \[1, 1, 2, 2\]"):
        target(
            torch.tensor([[3, 4]]), torch.tensor([[0, 1]]), torch.ones(1, 1, 2, 3, dtype=torch.bool), cache
        )


def test_missing_extra_names_it(monkeypatch):
    from tlt_lightning import models

    for name in [n for n in sys.modules if n == "torchtune" or n.startswith("torchtune.")] or ["torchtune"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "tlt_lightning.models.torchtune_target", raising=False)
    monkeypatch.delattr(models, "torchtune_target", raising=False)
    with pytest.raises(ImportError, match=r"needs torchtune: pip install 'tlt-lightning\[torchtune\]'"):
        importlib.import_module("tlt_lightning.models.torchtune_target")
    with pytest.raises(ImportError, match="needs torchtune"):
        models.TorchtuneTarget  # noqa: B018


def test_importing_the_models_package_never_imports_torchtune():
    code = "import sys, tlt_lightning.models; assert 'torchtune' not in sys.modules, 'imported torchtune'"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
