import copy
import logging

import pytest
import torch
from transformers import LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tests.rollout.test_engine import random_prompts
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.models.lean import MAX_LEAN_QUERIES, lean_applies
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
from tlt_lightning.rollout.engine import causal_decode_mask


def pair(name: str, dtype: str = "float32") -> tuple[HFTarget, HFTarget]:
    """The same model (same weights, one module) behind the transformers and the lean path."""
    model = load_model(name, dtype=dtype, seed=0).model
    return HFTarget(model), HFTarget(model, decode="lean")


def prefilled(target: HFTarget, lens: torch.Tensor, seed: int = 0):
    """A cache holding random prompts of lengths ``lens`` (prefill on transformers' path)."""
    torch.manual_seed(seed)
    n, width = lens.numel(), int(lens.max())
    ids = torch.randint(3, 128, (n, width))
    cache = target.new_cache(n, 64)
    slots = torch.arange(width)
    mask = (slots[None, None, :] <= slots[None, :, None]) & (slots[None, None, :] < lens[:, None, None])
    with torch.no_grad():
        target.forward(ids, slots.expand(n, width), mask[:, None], cache)
    cache.lengths[:n] = lens
    return cache


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("q", [1, 5])
def test_lean_forward_equals_transformers_bit_for_bit(name, dtype, q):
    """Decode (1 token) and chain verify (5 tokens) on rows of different lengths: same hidden states,
    features and cache contents, exactly, in fp32 and bf16."""
    hf, lean = pair(name, dtype)
    lens = torch.tensor([7, 3, 11])
    layers = tuple(range(hf.info.num_layers + 1))
    caches, outs = [], []
    for target in (hf, lean):
        cache = prefilled(target, lens)
        torch.manual_seed(1)
        ids = torch.randint(3, 128, (3, q))
        positions = lens[:, None] + torch.arange(q)
        mask = causal_decode_mask(lens, q, int(positions.max()) + 1)
        with torch.no_grad():
            outs.append(target.forward(ids, positions, mask, cache, feature_layers=layers))
        caches.append(cache)
    assert torch.equal(outs[0].hidden, outs[1].hidden)
    assert torch.equal(outs[0].features, outs[1].features)
    assert torch.equal(caches[0].keys, caches[1].keys) and torch.equal(caches[0].values, caches[1].values)


def test_lean_tree_verify_with_slots_equals_transformers(tiny_target):
    """A draft tree: siblings share a position, not a slot."""
    model = tiny_target.model
    hf, lean = HFTarget(model), HFTarget(model, decode="lean")
    lens = torch.tensor([6, 9])
    positions = lens[:, None] + torch.tensor([0, 1, 1, 2])  # root, two siblings, a child of the first
    slots = lens[:, None] + torch.arange(4)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    kv_len = int(slots.max()) + 1
    mask = torch.arange(kv_len)[None, None, :] < lens[:, None, None]  # [n, 1, kv]: the committed prefix
    mask = mask[:, None].expand(2, 1, 4, kv_len).clone()
    for r in range(2):
        mask[r, 0, :, lens[r] : lens[r] + 4] = tree
    outs = []
    for target in (hf, lean):
        cache = prefilled(target, lens)
        with torch.no_grad():
            outs.append(
                target.forward(torch.tensor([[5, 6, 7, 8]] * 2), positions, mask, cache, slots=slots).hidden
            )
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_rollouts_equal_on_both_paths(tiny_target, temperature):
    """Greedy: token for token; sampled with one seed: the same tokens and log-probabilities."""
    model = tiny_target.model
    config = RolloutConfig(max_new_tokens=40, temperature=temperature, feature_layers=(0, 4))
    prompts = random_prompts(12, seed=5)
    results = [
        RolloutEngine(HFTarget(model, decode=d), config).generate(
            prompts, generator=torch.Generator().manual_seed(0)
        )
        for d in ("hf", "lean")
    ]
    for a, b in zip(*(r.rollouts for r in results)):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.features, b.features)


def test_training_and_prefill_stay_on_transformers(tiny_llama):
    ids, mask = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 1, 3, 3, dtype=torch.bool)
    with torch.no_grad():
        assert lean_applies(ids, mask)
        assert not lean_applies(torch.zeros(1, MAX_LEAN_QUERIES + 1, dtype=torch.long), mask)
        assert not lean_applies(ids, mask.float())
    assert not lean_applies(ids, mask)  # autograd on: training
    lean = HFTarget(tiny_llama.model, decode="lean")
    cache = lean.new_cache(1, 8)
    out = lean.forward(ids, torch.arange(3)[None], mask.tril(), cache)
    assert out.hidden.requires_grad


def test_bad_decode_settings_are_rejected(tiny_llama, caplog):
    with pytest.raises(ValueError, match=r"decode must be one of \('hf', 'lean', 'compiled'\), got 'fast'"):
        HFTarget(tiny_llama.model, decode="fast")
    # _from_config sets the implementation on the config it is given: a copy, not the shared fixture's.
    eager = LlamaForCausalLM._from_config(copy.deepcopy(tiny_llama.hf_config), attn_implementation="eager")
    with pytest.raises(
        ValueError, match="needs the model on 'sdpa' attention, got attn_implementation='eager'"
    ):
        HFTarget(eager, decode="lean")
    small = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    with pytest.raises(TypeError, match="layer 0 is MistralDecoderLayer; use decode='hf'"):
        HFTarget(MistralForCausalLM(MistralConfig(**small)), decode="lean")
    sliding = Qwen2Config(**small, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(ValueError, match="does not implement sliding-window attention"):
        HFTarget(Qwen2ForCausalLM(sliding), decode="lean")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lean_rollouts_equal_transformers_on_smollm2(dtype):
    """SmolLM2-135M, real countdown prompts, greedy: the lean path emits the same tokens, in fp32 and bf16."""
    from tlt_lightning.rl.tasks import task_prompts

    loaded = load_model("smollm2-135m", dtype=dtype)
    prompts = task_prompts(loaded.tokenizer, "countdown", 4, seed=0)
    config = RolloutConfig(max_new_tokens=48, temperature=0.0)
    results = [
        RolloutEngine(HFTarget(loaded.model, decode=d), config).generate(prompts) for d in ("hf", "lean")
    ]
    for a, b in zip(*(r.rollouts for r in results)):
        assert a.token_ids.tolist() == b.token_ids.tolist()
