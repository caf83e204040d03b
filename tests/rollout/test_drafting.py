"""The drafter as rollout code sees it: the DraftModel protocol and the law drafts are drawn from."""

from types import SimpleNamespace

import torch

from tests.rollout.test_speculative import OracleDrafter
from tlt_lightning.drafter import Drafter, DrafterConfig
from tlt_lightning.rollout import DraftModel
from tlt_lightning.rollout.drafting import draft_probs
from tlt_lightning.speculative import SamplingParams, sampling_probs


def test_drafters_implement_the_draft_model_protocol(tiny_llama):
    """The library's drafter and the tests' oracle (the target drafting for itself) are both DraftModels."""
    drafter = Drafter(DrafterConfig.from_target(tiny_llama, draft_vocab_size=96), tiny_llama)
    assert isinstance(drafter, DraftModel)
    assert isinstance(OracleDrafter(tiny_llama), DraftModel)
    assert not isinstance(SimpleNamespace(config=None, weight_layout="out_in"), DraftModel)


def test_draft_probs_are_the_sampling_law_of_fp32_logits():
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    params = SamplingParams(temperature=0.7, top_p=0.9)
    got = draft_probs(logits, params)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, sampling_probs(logits.float(), params))
