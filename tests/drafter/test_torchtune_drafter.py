"""A drafter on a torchtune target: same function as on the HF target, lossless speculative rollouts."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.rollout.test_engine import random_prompts
from tlt_lightning.drafter import Drafter, DrafterConfig
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.models.registry import _TINY
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.speculative import DraftSpec

pytest.importorskip("torchtune")
from tlt_lightning.models import torchtune_target as tt


def tied_qwen2() -> Qwen2ForCausalLM:
    """Qwen2 with tied embeddings: torchtune builds its head as a ``TiedLinear`` (not an ``nn.Module``)."""
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**_TINY, tie_word_embeddings=True)).eval()


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2", "tied-qwen2"])
def pair(request):
    """``(HFTarget, TorchtuneTarget)`` over the same weights (tiny-llama: tied by a shared parameter,
    tiny-qwen2: untied, tied-qwen2: a ``TiedLinear`` head)."""
    model = tied_qwen2() if request.param == "tied-qwen2" else load_model(request.param, seed=0).model
    return HFTarget(model), tt.TorchtuneTarget.from_hf(model)


def twin_drafters(hf, tune, kind: str, draft_vocab_size: int | None = None) -> tuple[Drafter, Drafter]:
    """The same drafter weights on the HF target and on the torchtune target."""
    config = DrafterConfig.from_target(hf, kind, draft_vocab_size)
    torch.manual_seed(0)
    counts = torch.rand(hf.info.vocab_size) if draft_vocab_size else None
    on_hf = Drafter(config, hf, token_counts=counts)
    on_tune = Drafter(config, tune)
    on_tune.load_state_dict(on_hf.state_dict())
    return on_hf, on_tune


def test_torchtune_head_and_embedding_are_borrowed_by_reference(pair):
    _, tune = pair
    drafter = Drafter(DrafterConfig.from_target(tune), tune)
    refs, decoder = drafter._refs, tune.decoder
    assert refs.embedding is decoder.tok_embeddings
    assert refs.head.weight.shape == (tune.info.vocab_size, tune.info.hidden_size)
    if isinstance(decoder.output, nn.Linear):
        assert refs.head is decoder.output
    else:  # TiedLinear: the wrapper reads the embedding's own parameter
        assert type(decoder.output).__name__ == "TiedLinear"
        assert refs.head.weight is decoder.tok_embeddings.weight and refs.head.bias is None
    # Borrowed, not owned: neither in the drafter's parameters nor in its state_dict.
    owned = {id(p) for p in drafter.parameters()}
    assert id(decoder.tok_embeddings.weight) not in owned and id(refs.head.weight) not in owned
    assert not any(k.startswith(("embed", "lm_head", "output", "tok_")) for k in drafter.state_dict())


@pytest.mark.parametrize(("kind", "draft_vocab_size"), [("eagle1", None), ("eagle3", 48)])
def test_same_logits_as_the_drafter_on_the_hf_target(pair, kind, draft_vocab_size):
    hf, tune = pair
    on_hf, on_tune = twin_drafters(hf, tune, kind, draft_vocab_size)
    n, q, H, C = 2, 7, hf.info.hidden_size, on_hf.config.num_features
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, hf.info.vocab_size, (n, q), generator=g)
    features = torch.randn(n, q, C, H, generator=g)
    positions = torch.arange(q).expand(n, q) + 2
    mask = torch.ones(q, q, dtype=torch.bool).tril().expand(n, 1, q, q)
    outs = []
    for d in (on_hf, on_tune):
        with torch.no_grad():
            hidden = d(tokens, d.lift(features), positions, mask)
            outs.append((d.embed(tokens), hidden, d.logits(hidden), d.target_logits(features[..., -1, :])))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert outs[0][2].shape == (n, q, draft_vocab_size or hf.info.vocab_size)
    assert float(outs[0][2].std()) > 0.1  # real logits, not a constant


def test_tied_head_follows_in_place_updates_of_the_embedding():
    tune = tt.TorchtuneTarget.from_hf(tied_qwen2())
    drafter = Drafter(DrafterConfig.from_target(tune, "eagle1", 32), tune, token_counts=torch.rand(128))
    h = torch.randn(3, tune.info.hidden_size)
    before = drafter.logits(h)
    weight = tune.decoder.tok_embeddings.weight
    with torch.no_grad():
        weight.mul_(2.0)  # an optimizer step updates the tied parameter in place
    torch.testing.assert_close(drafter.logits(h), 2 * before)
    torch.testing.assert_close(drafter.logits(h), tune.lm_head(h)[..., drafter.draft_ids])
    assert copy.deepcopy(drafter)._refs.head.weight is weight  # a copy still reads the live target


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("arm", [DraftSpec(3), DraftSpec(3, 3, 6)], ids=str)
def test_speculative_greedy_on_the_torchtune_target_equals_plain_greedy(pair, kind, arm):
    """Lossless: a (random, mostly wrong) drafter on the torchtune target changes no greedy token."""
    _, tune = pair
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(tune, kind, 96), tune)
    prompts = random_prompts(16, seed=5)
    config = RolloutConfig(max_new_tokens=48, temperature=0.0)
    plain = RolloutEngine(tune, config).generate(prompts)
    spec = SpeculativeRolloutLoop(tune, drafter, config, arm, threshold=1000).generate(prompts)
    assert [r.token_ids.tolist() for r in spec.rollouts] == [r.token_ids.tolist() for r in plain.rollouts]
    assert sum(r.length for r in plain.rollouts) > 16 * 8  # real responses, not an immediate EOS
    assert all(spec.stats.step_speculative) and spec.stats.accept_lengths.numel() > 0


def test_unsupported_torchtune_head_is_refused():
    tune = tt.TorchtuneTarget.from_hf(load_model("tiny-llama", seed=0).model)
    tune.decoder.output = nn.Identity()
    with pytest.raises(TypeError, match="output to be an nn.Linear or a TiedLinear .*, got Identity"):
        Drafter(DrafterConfig.from_target(tune), tune)
