import pytest
import torch

from tlt_lightning.drafter import target_features
from tlt_lightning.rollout import RolloutConfig, RolloutEngine


@pytest.mark.parametrize("batch_size", [1, 3])
def test_recomputed_features_match_those_recorded_while_sampling(tiny_target, batch_size):
    layers = (1, 3, tiny_target.info.num_layers)
    engine = RolloutEngine(
        tiny_target, RolloutConfig(max_new_tokens=12, temperature=1.0, feature_layers=layers)
    )
    prompts = [[5, 6, 7], [9], [3, 4, 8, 10, 11], [12, 13]]
    rollouts = engine.generate(prompts, generator=torch.Generator().manual_seed(1)).rollouts
    stripped = [r.__class__(**{**r.__dict__, "features": None}) for r in rollouts]
    again = target_features(tiny_target, stripped, layers, batch_size=batch_size)
    for r, a in zip(rollouts, again):
        assert a.features.shape == r.features.shape == (r.length, len(layers), tiny_target.info.hidden_size)
        torch.testing.assert_close(a.features, r.features.float(), rtol=1e-4, atol=1e-4)
        assert torch.equal(a.token_ids, r.token_ids) and not a.features.is_inference()
    assert all(r.features is None for r in stripped)  # the inputs are not modified


def test_feature_layers_are_required(tiny_llama):
    with pytest.raises(ValueError, match="feature_layers is empty"):
        target_features(tiny_llama, [], ())
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        target_features(tiny_llama, [], (1,), batch_size=0)
