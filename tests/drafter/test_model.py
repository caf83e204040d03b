from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tlt_lightning.drafter import Drafter, DrafterConfig
from tlt_lightning.rollout.engine import causal_decode_mask

from .conftest import make_drafter

H, V = 64, 128


def causal(n: int, q: int) -> torch.Tensor:
    return torch.ones(q, q, dtype=torch.bool).tril().expand(n, 1, q, q)


def inputs(drafter: Drafter, n: int = 2, q: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (n, q), generator=g)
    features = torch.randn(n, q, drafter.config.num_features, H, generator=g)
    positions = torch.arange(q).expand(n, q) + 3
    return tokens, drafter.lift(features), positions


def test_eagle1_parameter_names_and_shapes(target):
    d = make_drafter(target, "eagle1")
    shapes = {k: tuple(v.shape) for k, v in d.state_dict().items()}
    bias = target.info.model_type == "qwen2"
    expected = {
        "fc.weight": (H, 2 * H),
        "layers.0.self_attn.q_proj.weight": (64, H),
        "layers.0.self_attn.k_proj.weight": (32, H),
        "layers.0.self_attn.v_proj.weight": (32, H),
        "layers.0.self_attn.o_proj.weight": (H, 64),
        "layers.0.post_attention_layernorm.weight": (H,),
        "layers.0.mlp.gate_proj.weight": (128, H),
        "layers.0.mlp.up_proj.weight": (128, H),
        "layers.0.mlp.down_proj.weight": (H, 128),
    }
    if bias:
        expected |= {f"layers.0.self_attn.{p}_proj.bias": (s,) for p, s in (("q", 64), ("k", 32), ("v", 32))}
    assert shapes == expected  # no input_layernorm (skipped), no embedding, no LM head


def test_eagle3_parameter_names_and_shapes(target):
    d = make_drafter(target, "eagle3", draft_vocab_size=32)
    shapes = {k: tuple(v.shape) for k, v in d.state_dict().items()}
    expected = {
        "fc.weight": (H, 3 * H),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (64, 2 * H),
        "midlayer.self_attn.k_proj.weight": (32, 2 * H),
        "midlayer.self_attn.v_proj.weight": (32, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, 64),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (128, H),
        "midlayer.mlp.up_proj.weight": (128, H),
        "midlayer.mlp.down_proj.weight": (H, 128),
        "norm.weight": (H,),
        "d2t": (32,),
        "t2d": (V,),
    }
    if target.info.model_type == "qwen2":
        expected |= {f"midlayer.self_attn.{p}_proj.bias": (s,) for p, s in (("q", 64), ("k", 32), ("v", 32))}
    assert shapes == expected
    assert d.state_dict()["d2t"].dtype == torch.int64 and d.state_dict()["t2d"].dtype == torch.bool


def test_parameter_count_relative_to_target(llama):
    d = make_drafter(llama)
    target_params = sum(p.numel() for p in llama.parameters())
    non_embedding = target_params - llama.model.get_input_embeddings().weight.numel()  # tied head
    layer = sum(p.numel() for p in llama.model.model.layers[0].parameters())
    assert d.num_trainable_parameters() == layer - H + 2 * H * H == 45_120  # one layer + fc, no input norm
    assert target_params == 156_224 and non_embedding == 148_032
    assert all(p.requires_grad for p in d.parameters())


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_embedding_and_head_get_no_gradient(qwen2, kind):
    d = make_drafter(qwen2, kind, draft_vocab_size=48 if kind == "eagle3" else None)
    qwen2.zero_grad(set_to_none=True)
    tokens, g, positions = inputs(d)
    d.logits(d(tokens, g, positions, causal(2, 10))).logsumexp(-1).sum().backward()
    assert all(p.grad is None for p in qwen2.parameters())  # the target (policy) is untouched
    assert all(p.grad is not None for p in d.parameters())
    names = set(d.state_dict())
    assert not any("embed" in k or "lm_head" in k for k in names)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_cached_decode_equals_full_forward(target, kind):
    d = make_drafter(target, kind).eval()
    n, q = 2, 10
    tokens, g, positions = inputs(d, n, q)
    with torch.no_grad():
        full = d(tokens, g, positions, causal(n, q))
        # Prefill 4 positions at once, then one at a time, through the target's KVCache class.
        cache = d.new_cache(n, 16)
        steps, start = [], 0
        for width in (4, *([1] * (q - 4))):
            pos = positions[:, start : start + width]
            cache.lengths[:n] = pos[:, 0]
            kv_len = int(pos.max()) + 1
            # Positions start at 3: cache slots 0..2 hold nothing and are masked out.
            mask = causal_decode_mask(cache.lengths[:n], width, kv_len) & (torch.arange(kv_len) >= 3)
            steps.append(d(tokens[:, start : start + width], g[:, start : start + width], pos, mask, cache))
            start += width
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_mask_is_used_without_cache(llama):
    d = make_drafter(llama, "eagle3")
    tokens, g, positions = inputs(d, 1, 6)
    with torch.no_grad():
        full = d(tokens, g, positions, causal(1, 6))
        prefix = d(tokens[:, :3], g[:, :3], positions[:, :3], causal(1, 3))
    torch.testing.assert_close(full[:, :3], prefix)  # causal: later tokens do not leak back


def test_forward_shape_errors(llama):
    d = make_drafter(llama)
    tokens, g, positions = inputs(d, 2, 5)
    with pytest.raises(ValueError, match=r"attention_mask must be \[n, 1, q, kv_len\] = \[2, 1, 5, 5\]"):
        d(tokens, g, positions, causal(2, 4))
    with pytest.raises(ValueError, match=r"hidden_in must be \[n, q, H\] = \[2, 5, 64\]"):
        d(tokens, g[:, :4], positions, causal(2, 5))
    with pytest.raises(ValueError, match=r"features must be \[..., C=1, H=64\], got \[2, 5, 3, 64\]"):
        d.lift(torch.zeros(2, 5, 3, H))


def test_mismatched_target_raises_at_construction(llama, qwen2):
    cfg = DrafterConfig.from_target(llama)
    with pytest.raises(ValueError, match="model_type is 'llama', target has 'qwen2'"):
        Drafter(cfg, qwen2)
    with pytest.raises(ValueError, match="hidden_size is 32, target has 64"):
        Drafter(dataclasses.replace(cfg, hidden_size=32), llama)
    with pytest.raises(ValueError, match="vocab_size is 256, target has 128"):
        Drafter(dataclasses.replace(cfg, vocab_size=256), llama)
    with pytest.raises(ValueError, match="num_target_layers is 6, target has 4"):
        Drafter(dataclasses.replace(cfg, num_target_layers=6, feature_layers=None), llama)
    with pytest.raises(
        ValueError, match=r"feature_layers must lie in \[0, num_target_layers=4\], got \(1, 2, 7\)"
    ):
        Drafter(dataclasses.replace(cfg, kind="eagle3", feature_layers=(1, 2, 7)), llama)
    with pytest.raises(
        TypeError, match=r"supported adapters: HFTarget and TorchtuneTarget \(torchtune extra\), got Fake"
    ):
        Drafter(cfg, type("Fake", (), {"info": llama.info})())  # type: ignore[arg-type]


def test_reduced_vocab_mapping_and_logits(llama):
    counts = torch.zeros(V)
    counts[[100, 5, 50, 7]] = torch.tensor([10.0, 9.0, 8.0, 8.0])
    d = make_drafter(llama, "eagle1", draft_vocab_size=3, token_counts=counts)
    # Top-3 by count; the tie between 50 and 7 goes to the lower id; draft ids ascend with target ids.
    assert d.draft_ids.tolist() == [5, 7, 100]
    assert d.d2t.tolist() == [5, 6, 98]
    assert d.t2d.nonzero().flatten().tolist() == [5, 7, 100]
    assert d.draft_to_target(torch.tensor([[2, 0], [1, 1]])).tolist() == [[100, 5], [7, 7]]
    h = torch.randn(2, 3, H)
    logits = d.logits(h)
    assert logits.shape == (2, 3, 3)
    torch.testing.assert_close(logits, llama.lm_head(h)[..., [5, 7, 100]])
    probs = d.to_target_vocab(logits.softmax(-1))
    assert probs.shape == (2, 3, V) and torch.allclose(probs.sum(-1), torch.ones(2, 3))
    assert probs[..., [5, 7, 100]].equal(logits.softmax(-1)) and probs.count_nonzero() == 18
    assert d.to_target_vocab(logits, fill=float("-inf"))[..., 0].eq(float("-inf")).all()
    # A new vocabulary invalidates the cached head rows.
    counts[1] = 100.0
    d.set_draft_vocab(counts)
    assert d.draft_ids.tolist() == [1, 5, 100]
    torch.testing.assert_close(d.logits(h), llama.lm_head(h)[..., [1, 5, 100]])


def test_full_vocab_helpers_are_identity(llama):
    d = make_drafter(llama)
    ids = torch.tensor([3, 9])
    assert d.draft_to_target(ids) is ids and d.draft_ids.equal(torch.arange(V))
    x = torch.randn(2, V)
    assert d.to_target_vocab(x) is x and d.logits(torch.randn(2, H)).shape == (2, V)
    with pytest.raises(ValueError, match="draft_vocab_size; it is None"):
        d.set_draft_vocab(torch.ones(V))
    with pytest.raises(ValueError, match="token_counts given but config.draft_vocab_size is None"):
        make_drafter(llama, token_counts=torch.ones(V))
    with pytest.raises(ValueError, match=r"token_counts must have shape \[128\], got \[5\]"):
        make_drafter(llama, draft_vocab_size=8).set_draft_vocab(torch.ones(5))


def test_head_follows_target_updates_and_deepcopy_shares_target(llama):
    d = make_drafter(llama, draft_vocab_size=16)
    h = torch.randn(1, H)
    before = d.logits(h)
    head = llama.model.get_output_embeddings().weight
    clone = copy.deepcopy(d)
    try:
        with torch.no_grad():
            head.add_(1.0)  # an RL update changes the policy in place: the drafter reads the live weights
        assert not torch.allclose(d.logits(h), before)
        torch.testing.assert_close(clone.logits(h), d.logits(h))
    finally:
        with torch.no_grad():
            head.sub_(1.0)
    assert clone._refs is d._refs


def test_bf16_target_gives_bf16_drafter(llama):
    from tlt_lightning.models import HFTarget, load_model

    target = HFTarget(load_model("tiny-llama", dtype="bfloat16").model)
    d = make_drafter(target, "eagle3")
    assert d.dtype == torch.bfloat16 and d.rotary_emb.inv_freq.dtype == torch.float32
    tokens = torch.randint(0, V, (1, 4))
    out = d(tokens, d.lift(torch.randn(1, 4, 3, H)), torch.arange(4)[None], causal(1, 4))
    assert d.logits(out).dtype == torch.bfloat16
    assert d.new_cache(2, 8).keys.dtype == torch.bfloat16
