"""Prompt sources: the synthetic, config-friendly source and its named rewards."""

from __future__ import annotations

import pickle

import pytest
import torch

from tlt_lightning.rl import PromptSource, SyntheticPromptSource
from tlt_lightning.rl.sources import SYNTHETIC_REWARDS, copy_reward, even_reward


def test_synthetic_source_is_a_seeded_prompt_source():
    source = SyntheticPromptSource("copy", num_prompts=5, prompt_length=3, vocab_size=16, seed=1)
    assert isinstance(source, PromptSource)
    assert len(source) == 5 and source.name == "synthetic:copy"
    ids = [source.prompt_ids(i) for i in range(5)]
    assert all(len(p) == 3 and all(3 <= t < 16 for t in p) for p in ids)  # never pad / bos / eos
    assert ids == SyntheticPromptSource("copy", num_prompts=5, prompt_length=3, vocab_size=16, seed=1).prompts
    assert ids != SyntheticPromptSource("copy", num_prompts=5, prompt_length=3, vocab_size=16, seed=2).prompts
    # Picklable (DDP with spawned processes sends the module, source included).
    assert pickle.loads(pickle.dumps(source)).prompts == ids


def test_synthetic_rewards_by_hand():
    prompt = torch.tensor([4, 5, 6])
    assert even_reward(prompt, torch.tensor([2, 3, 4, 7])) == 0.5
    assert even_reward(prompt, torch.tensor([], dtype=torch.long)) == 0.0
    # Positions 0, 1 and 3 repeat the prompt.
    assert copy_reward(prompt, torch.tensor([4, 5, 9, 4, 0])) == pytest.approx(0.6)
    assert copy_reward(prompt, torch.tensor([], dtype=torch.long)) == 0.0
    assert SYNTHETIC_REWARDS == {"copy": copy_reward, "even": even_reward}
    source = SyntheticPromptSource("even", num_prompts=2)
    reward = source.score(0, torch.tensor(source.prompt_ids(0)), torch.tensor([2, 4, 5, 7]))
    assert reward.total == reward.correctness == 0.5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reward": "odd"}, r"reward must be one of \['copy', 'even'\], got 'odd'"),
        ({"num_prompts": 0}, "num_prompts must be an int >= 1, got 0"),
        ({"prompt_length": 2.5}, "prompt_length must be an int >= 1, got 2.5"),
        ({"vocab_size": 3}, "vocab_size must be an int >= 4, got 3"),
        ({"seed": -1}, "seed must be an int >= 0, got -1"),
    ],
)
def test_synthetic_source_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyntheticPromptSource(**kwargs)
