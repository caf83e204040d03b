import copy
import pickle
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from tlt_lightning import kernels
from tlt_lightning.models import HFTarget, attention, load_model
from tlt_lightning.models.attention import (
    GROUPED_SDPA,
    MAX_GROUPED_QUERIES,
    grouped_matmul_attention,
    grouped_sdpa,
    use_grouped_attention,
)
from tlt_lightning.rollout.engine import causal_decode_mask


def test_grouped_sdpa_takes_outputs_of_any_strides(monkeypatch):
    """CUDA's attention kernels may return a non-contiguous ``[n, H_kv, g*q, D]`` (seen on an H200)."""
    g = torch.Generator().manual_seed(0)
    query, key, value = torch.randn(2, 6, 3, 16, generator=g), *torch.randn(2, 2, 2, 9, 16, generator=g)
    mask = torch.rand(2, 1, 3, 9, generator=g) < 0.7
    mask[..., 0] = True
    expected = grouped_sdpa(query, key, value, mask)
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F,
        "scaled_dot_product_attention",
        lambda *a, **k: sdpa(*a, **k).transpose(1, 2).contiguous().transpose(1, 2),
    )
    torch.testing.assert_close(grouped_sdpa(query, key, value, mask), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "q", "kv"), [(1, 1, 9), (3, 1, 17), (2, 5, 23), (4, 7, 40)])
def test_grouped_sdpa_equals_enable_gqa(dtype, n, q, kv):
    g = torch.Generator().manual_seed(n * 100 + q)
    query = torch.randn(n, 6, q, 16, generator=g).to(dtype)
    key, value = (torch.randn(n, 2, kv, 16, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(n, 1, q, kv, generator=g) < 0.7
    mask[..., 0] = True  # every query sees a key
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    got = grouped_sdpa(query, key, value, mask)
    assert got.shape == expected.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("n", "q", "kv"), [(1, 1, 9), (3, 1, 17), (2, 5, 23), (4, 7, 40)])
def test_grouped_matmul_attention_equals_grouped_sdpa(dtype, atol, n, q, kv):
    """The same attention; in bf16 the probabilities are rounded before the second product (as in
    transformers' eager attention), so outputs differ by a bf16 ulp or so."""
    g = torch.Generator().manual_seed(n * 100 + q)
    query = torch.randn(n, 6, q, 16, generator=g).to(dtype)
    key, value = (torch.randn(n, 2, kv, 16, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(n, 1, q, kv, generator=g) < 0.7
    mask[..., 0] = True
    got = grouped_matmul_attention(query, key, value, mask, scale=0.3)
    assert got.shape == query.shape and got.dtype == dtype
    torch.testing.assert_close(
        got.float(), grouped_sdpa(query, key, value, mask, scale=0.3).float(), atol=atol, rtol=0
    )


def test_grouped_sdpa_per_row_masks_are_not_mixed():
    """Each row's queries follow their own mask: a row that sees only key 0 returns value 0."""
    query, key = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8)
    value = torch.randn(2, 2, 5, 8)
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    mask[1, :, :, 1:] = False
    out = grouped_sdpa(query, key, value, mask)
    expected_row1 = (
        value[1, :, 0].repeat_interleave(2, 0)[:, None].expand(4, 3, 8)
    )  # head h reads kv head h // 2
    torch.testing.assert_close(out[1], expected_row1)


def test_grouped_sdpa_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"query heads \(5\) must be a multiple of key/value heads \(2\)"):
        grouped_sdpa(
            torch.randn(1, 5, 2, 8),
            torch.randn(1, 2, 4, 8),
            torch.randn(1, 2, 4, 8),
            torch.ones(1, 1, 2, 4, dtype=torch.bool),
        )
    with pytest.raises(
        ValueError, match=r"mask must be \[n, 1, q, kv\] = \[1, 1, 2, 4\], got \[1, 4, 2, 4\]"
    ):
        grouped_sdpa(
            torch.randn(1, 4, 2, 8),
            torch.randn(1, 2, 4, 8),
            torch.randn(1, 2, 4, 8),
            torch.ones(1, 4, 2, 4, dtype=torch.bool),
        )


def test_hf_target_switches_sdpa_models_only():
    model = load_model("tiny-llama").model
    assert model.config._attn_implementation == "sdpa"
    HFTarget(model)
    assert model.config._attn_implementation == GROUPED_SDPA
    assert use_grouped_attention(model)  # idempotent
    eager = load_model("tiny-llama").model
    eager.set_attn_implementation("eager")
    HFTarget(eager)
    assert eager.config._attn_implementation == "eager"


def _verify_forward(target):
    """A 4-token verify forward over a 6-token cached context for 2 rows, like a chain step."""
    cache = target.new_cache(2, 16)
    prompt = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    target.forward(
        prompt,
        torch.arange(6).expand(2, 6),
        causal_decode_mask(torch.zeros(2, dtype=torch.long), 6, 6),
        cache,
    )
    L = torch.tensor([6, 6])
    ids = torch.tensor([[20, 21, 22, 23], [30, 31, 32, 33]])
    return target.forward(ids, L[:, None] + torch.arange(4), causal_decode_mask(L, 4, 10), cache, (2,))


def _targets(name="tiny-llama"):
    grouped, reference = HFTarget(load_model(name).model), HFTarget(load_model(name).model)
    reference.model.set_attn_implementation("sdpa")
    return grouped, reference


def _spy(monkeypatch):

    calls = []
    original = attention.grouped_sdpa
    monkeypatch.setattr(
        attention, "grouped_sdpa", lambda *a, **k: calls.append(a[0].shape) or original(*a, **k)
    )
    return calls


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_grouped_target_forward_equals_sdpa(monkeypatch, name):
    """A verify forward takes the grouped path and computes what transformers' sdpa does."""
    grouped, reference = _targets(name)
    calls = _spy(monkeypatch)
    with torch.no_grad():
        got, expected = _verify_forward(grouped), _verify_forward(reference)
    assert [tuple(c) for c in calls] == [(2, 4, 6, 16)] * 4 + [(2, 4, 4, 16)] * 4  # prefill, verify; 4 layers
    torch.testing.assert_close(got.hidden, expected.hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.features, expected.features, atol=1e-5, rtol=1e-5)


def test_training_forward_is_transformers_sdpa(monkeypatch):
    """With autograd on, the grouped implementation hands every call to transformers' sdpa."""
    grouped, reference = _targets()
    calls = _spy(monkeypatch)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[0, :2] = 0  # a left-padded row: transformers builds a boolean 4D mask
    with torch.no_grad():
        grouped.model(ids, attention_mask=padding)
    assert len(calls) == 4  # without autograd the same call is grouped (one per layer)
    calls.clear()
    losses = [t.model(ids, attention_mask=padding, labels=ids).loss for t in (grouped, reference)]
    for loss in losses:
        loss.backward()
    assert calls == []
    torch.testing.assert_close(losses[0], losses[1])
    for a, b in zip(grouped.model.parameters(), reference.model.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_long_queries_and_single_queries_take_transformers_path(monkeypatch):
    """Prefills longer than MAX_GROUPED_QUERIES and single-token decoding are not grouped."""
    grouped, _ = _targets()
    calls = _spy(monkeypatch)
    n = MAX_GROUPED_QUERIES + 1
    cache = grouped.new_cache(1, n + 2)
    zero = torch.zeros(1, dtype=torch.long)
    with torch.no_grad():
        grouped.forward(
            torch.randint(3, 128, (1, n)), torch.arange(n)[None], causal_decode_mask(zero, n, n), cache
        )
        L = torch.tensor([n])
        grouped.forward(torch.tensor([[5]]), L[:, None], causal_decode_mask(L, 1, n + 1), cache)
    assert calls == []


def test_a_switched_model_runs_in_a_process_that_unpickles_it(tmp_path):
    """Importing tlt_lightning.models registers the implementation: no HFTarget needed there."""
    model = load_model("tiny-llama").model
    HFTarget(model)
    path = tmp_path / "model.pkl"
    path.write_bytes(pickle.dumps(model))
    code = (
        "import pickle, sys, torch, tlt_lightning.models\n"
        f"model = pickle.loads(open({str(path)!r}, 'rb').read())\n"
        "assert model.config._attn_implementation == 'tlt_grouped_sdpa'\n"
        "with torch.no_grad():\n"
        "    print(model(torch.tensor([[3, 4, 5]]), attention_mask=torch.tensor([[0, 1, 1]])).logits.shape)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch.Size([1, 3, 128])" in out.stdout


def head_dim_64_qwen2() -> Qwen2ForCausalLM:
    """A small random Qwen2 in bf16 whose heads (64) the C++ kernel has vector code for (seeded: always
    the same)."""
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernel did not build here")
def test_bf16_inference_attends_by_the_cpp_kernel(monkeypatch):
    """bf16 on a CPU, head dim 64, no autograd: a prefill longer than MAX_GROUPED_QUERIES and a decode step
    attend by the C++ kernel, within bf16's tolerance of transformers' sdpa; with autograd, or more scores
    than the kernel holds, sdpa."""
    model = head_dim_64_qwen2()
    ours, reference = HFTarget(model), HFTarget(copy.deepcopy(model))  # the copy has a config of its own
    reference.model.set_attn_implementation("sdpa")
    calls = []
    original = kernels.decode_attention
    monkeypatch.setattr(
        kernels, "decode_attention", lambda q, *a: calls.append(tuple(q.shape)) or original(q, *a)
    )
    n = MAX_GROUPED_QUERIES + 6
    ids = torch.randint(3, 128, (2, n + 1), generator=torch.Generator().manual_seed(0))

    def prefill_and_step(target):
        cache = target.new_cache(2, n + 1)
        zero, L = torch.zeros(2, dtype=torch.long), torch.full((2,), n)
        with torch.no_grad():
            target.forward(ids[:, :n], torch.arange(n).expand(2, n), causal_decode_mask(zero, n, n), cache)
            cache.lengths[:] = L
            return target.forward(
                ids[:, n:], L[:, None], causal_decode_mask(L, 1, n + 1), cache
            ).hidden.float()

    got, expected = prefill_and_step(ours), prefill_and_step(reference)
    assert calls == [(2, 4, n, 64)] * 2 + [(2, 4, 1, 64)] * 2
    assert (got - expected).abs().max() <= 5e-2 * expected.abs().max()
    calls.clear()
    ours.model(ids, labels=ids).loss.backward()  # training: transformers' sdpa
    monkeypatch.setattr(attention, "_CPP_MAX_SCORES", 2 * n * n - 1)  # g = 2 query heads per key/value head
    prefill_and_step(ours)
    assert calls == [(2, 4, 1, 64)] * 2  # the prefill no longer fits, the decode step does
