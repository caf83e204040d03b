import pytest
import torch
from safetensors.torch import save_file

from tlt_lightning.rollout import Rollout, RolloutConfig, RolloutEngine, load_rollouts, save_rollouts


def test_rollouts_round_trip_with_and_without_features(tiny_llama, tmp_path):
    engine = RolloutEngine(
        tiny_llama, RolloutConfig(max_new_tokens=7, temperature=1.0, feature_layers=(2, 4))
    )
    rollouts = engine.generate([[5, 6, 7], [9], [3, 4]], generator=torch.Generator().manual_seed(0)).rollouts
    full, _ = load_rollouts(save_rollouts(tmp_path / "full.safetensors", rollouts))
    for a, b in zip(rollouts, full):
        assert torch.equal(a.features, b.features) and torch.equal(a.token_ids, b.token_ids)
    path = save_rollouts(
        tmp_path / "r.safetensors", rollouts, {"task": "countdown", "seed": [1, 2]}, features=False
    )
    loaded, meta = load_rollouts(path)
    assert meta == {"task": "countdown", "seed": [1, 2]}
    assert len(loaded) == 3
    for a, b in zip(rollouts, loaded):
        assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.token_ids, b.token_ids)
        assert torch.equal(a.logprobs, b.logprobs) and a.finish_reason == b.finish_reason
        assert (a.first_token_time, a.finish_time) == (b.first_token_time, b.finish_time)
        assert b.features is None  # left out: 12 bytes per token instead of C x H floats
    assert path.stat().st_size < 4096
    assert load_rollouts(save_rollouts(tmp_path / "empty.safetensors", []))[0] == []
    with pytest.raises(ValueError, match=r"rollouts \[0, 1, 2\] have no features"):
        save_rollouts(tmp_path / "x.safetensors", loaded)


def test_bad_rollout_files_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="no rollout file"):
        load_rollouts(tmp_path / "missing.safetensors")
    (tmp_path / "junk").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="not a readable rollout file"):
        load_rollouts(tmp_path / "junk")
    save_file({"w": torch.zeros(2)}, tmp_path / "weights.safetensors")
    with pytest.raises(ValueError, match="is not a rollout file: format None"):
        load_rollouts(tmp_path / "weights.safetensors")
    bad = Rollout(torch.tensor([1]), torch.tensor([2]), torch.tensor([0.0]), "stop", 0.0, 0.0)
    with pytest.raises(ValueError, match=r"rollouts\[0\].finish_reason must be one of"):
        save_rollouts(tmp_path / "bad.safetensors", [bad], features=False)
