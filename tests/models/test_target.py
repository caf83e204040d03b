import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.vllm.fake_vllm import vllm_python
from tlt_lightning.models import HFTarget, KVCache
from tlt_lightning.models.target import cache_argument, default_feature_layers
from tlt_lightning.rollout.engine import causal_decode_mask


def test_info_matches_config(tiny_target):
    cfg = tiny_target.hf_config
    info = tiny_target.info
    assert (info.hidden_size, info.vocab_size, info.num_layers) == (cfg.hidden_size, cfg.vocab_size, 4)
    assert info.num_kv_heads == 2 and info.head_dim == 16 and info.eos_token_ids == (2,)


def test_prefill_then_multi_token_decode_matches_full_forward(tiny_target):
    """Rows of different lengths share one cache; several new tokens per row in one forward."""
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (3, 12))
    full = tiny_target.model(ids).logits
    lens = torch.tensor([7, 4, 5])
    cache = tiny_target.new_cache(3, 32)
    slots = torch.arange(7)
    mask = (slots[None, None, :] <= slots[None, :, None]) & (slots[None, None, :] < lens[:, None, None])
    out = tiny_target.forward(ids[:, :7], slots.expand(3, 7), mask[:, None], cache, feature_layers=(0, 2, 4))
    for r in range(3):
        got = tiny_target.lm_head(out.hidden[r, : lens[r]])
        torch.testing.assert_close(got, full[r, : lens[r]], atol=1e-5, rtol=1e-5)
    # Features: index 0 is the embedding, index L the final normalised state (the LM head's input).
    torch.testing.assert_close(out.features[:, :, 0], tiny_target.embed(ids[:, :7]))
    torch.testing.assert_close(out.features[:, :, 2], out.hidden)
    cache.lengths[:3] = lens
    new = torch.stack([ids[r, lens[r] : lens[r] + 3] for r in range(3)])
    positions = lens[:, None] + torch.arange(3)
    mask = causal_decode_mask(lens, 3, int(positions.max()) + 1)
    out = tiny_target.forward(new, positions, mask, cache)
    for r in range(3):
        torch.testing.assert_close(
            tiny_target.lm_head(out.hidden[r]), full[r, lens[r] : lens[r] + 3], atol=1e-5, rtol=1e-5
        )


def test_eager_attention_reads_our_masks_as_sdpa_does(tiny_target):
    """``eager`` adds its mask to the scores: a tree mask with a cache gap gives sdpa's outputs there too."""
    eager = copy.deepcopy(tiny_target.model)
    eager.set_attn_implementation("eager")
    targets = [tiny_target, HFTarget(eager)]
    torch.manual_seed(0)
    prompt, tree = torch.randint(3, 128, (2, 5)), torch.randint(3, 128, (2, 3))
    # Two siblings at position 5 (slots 5, 6) and a child of the second one at position 6 (slot 7).
    positions, slots = torch.tensor([[5, 5, 6]] * 2), torch.tensor([[5, 6, 7]] * 2)
    tree_mask = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 1, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(3, 5, dtype=torch.bool), tree_mask], dim=1).expand(2, 1, 3, 8)
    hidden = []
    for target in targets:
        cache = target.new_cache(2, 16)
        target.forward(
            prompt,
            torch.arange(5).expand(2, 5),
            causal_decode_mask(torch.zeros(2, dtype=torch.long), 5, 5),
            cache,
        )
        cache.lengths[:2] = 5
        hidden.append(target.forward(tree, positions, mask, cache, slots=slots).hidden)
    torch.testing.assert_close(hidden[1], hidden[0], atol=1e-5, rtol=1e-5)
    # Sibling 0 sees only the prompt, so it equals a plain decode of that token after the prompt.
    plain = tiny_target.model(
        torch.cat([prompt, tree[:, :1]], dim=1), output_hidden_states=True
    ).hidden_states[-1]
    torch.testing.assert_close(hidden[1][:, 0], plain[:, -1], atol=1e-5, rtol=1e-5)


def test_attention_without_explicit_masks_is_refused(tiny_llama):
    model = copy.deepcopy(tiny_llama.model)
    model.config._attn_implementation = "flash_attention_2"  # what loading with it sets (no flash-attn here)
    with pytest.raises(
        ValueError,
        match="attn_implementation='flash_attention_2' does not take; "
        "load the model with attn_implementation='sdpa'",
    ):
        HFTarget(model)


def test_bad_mask_shape_is_rejected(tiny_llama):
    cache = tiny_llama.new_cache(1, 8)
    with pytest.raises(ValueError, match=r"attention_mask must be \[n, 1, q, kv_len\]"):
        tiny_llama.forward(
            torch.tensor([[5, 6]]), torch.tensor([[0, 1]]), torch.ones(1, 1, 2, 5, dtype=torch.bool), cache
        )


def test_feature_layer_presets():
    assert default_feature_layers(30) == (30,)
    assert default_feature_layers(30, "eagle3") == (2, 15, 27)
    assert default_feature_layers(4, "eagle3") == (1, 2, 3)
    with pytest.raises(ValueError, match="eagle3 features need a target with >= 4 layers, got 3"):
        default_feature_layers(3, "eagle3")
    with pytest.raises(ValueError, match="kind must be"):
        default_feature_layers(30, "medusa")


def test_encoder_decoder_models_are_rejected():
    class Cfg:
        is_encoder_decoder = True

    class Fake(torch.nn.Module):
        config = Cfg()

    with pytest.raises(TypeError, match="decoder-only"):
        HFTarget(Fake())


def test_kv_cache_rows_move_and_gather():
    cache = KVCache(num_layers=2, max_batch=4, num_kv_heads=1, max_len=6, head_dim=2)
    cache.keys.copy_(torch.arange(cache.keys.numel(), dtype=torch.float32).view_as(cache.keys))
    cache.lengths[:] = torch.tensor([3, 4, 5, 2])
    before = cache.keys.clone()
    cache.move_rows(torch.tensor([3, 2]), torch.tensor([0, 1]))
    assert cache.lengths.tolist() == [2, 5, 5, 2]
    torch.testing.assert_close(cache.keys[:, 1, :, :5], before[:, 2, :, :5])
    torch.testing.assert_close(cache.keys[:, 0, :, :2], before[:, 3, :, :2])
    before = cache.keys.clone()
    cache.gather_positions(torch.tensor([2]), torch.tensor([[3, 5]]), torch.tensor([2]))
    torch.testing.assert_close(cache.keys[:, 2, :, 2], before[:, 2, :, 3])
    torch.testing.assert_close(cache.keys[:, 2, :, 3], before[:, 2, :, 5])
    with pytest.raises(ValueError, match="KV cache overflow"):
        cache.begin_step(1, torch.tensor([[6]]))
    view = cache.view(1, 3)
    view.lengths[:] = 0
    assert cache.lengths.tolist() == [2, 0, 0, 2]


class _OldDecoder(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        return input_ids


class _NewDecoder(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, **kwargs):
        return input_ids


def test_cache_argument_follows_the_decoders_signature(tiny_target):
    """transformers renamed ``past_key_values`` to ``cache``: under the wrong name the cache would vanish
    into ``**kwargs``, so the name is read from the signature."""
    assert cache_argument(_OldDecoder()) == "past_key_values"
    assert cache_argument(_NewDecoder()) == "cache"
    assert cache_argument(tiny_target.model.get_decoder()) in ("cache", "past_key_values")
    with pytest.raises(TypeError, match="neither `cache` nor `past_key_values`"):
        cache_argument(torch.nn.Linear(2, 2))


_OTHER_TRANSFORMERS = """
import json, transformers
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
out = {"transformers": transformers.__version__}
for name in ("tiny-llama", "tiny-qwen2"):
    model = load_model(name).model
    config = RolloutConfig(max_new_tokens=12, temperature=0.0)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    hf = RolloutEngine(HFTarget(model), config).generate(prompts)
    lean = RolloutEngine(HFTarget(model, decode="lean"), config).generate(prompts)
    out[name] = [a.token_ids.tolist() == b.token_ids.tolist() for a, b in zip(hf.rollouts, lean.rollouts)]
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_hf_path_decodes_under_the_transformers_that_vllm_pins():
    """vLLM pins an older transformers 5 (``past_key_values``, where ours says ``cache``): in its venv the
    transformers path decodes what the lean path (our own math, no transformers forward) decodes."""
    python = vllm_python()
    if python is None:
        pytest.skip("no vLLM venv: `make setup-vllm` builds .venv-vllm")
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [python, "-c", _OTHER_TRANSFORMERS], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["tiny-llama"] == [True, True] and out["tiny-qwen2"] == [True, True], out
