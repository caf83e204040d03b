from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tlt_lightning.drafter import load_drafter, read_drafter_config, save_drafter
from tlt_lightning.drafter.hub import MODEL_TYPE
from tlt_lightning.drafter.io import CONFIG_NAME, FORMAT_VERSION, WEIGHTS_NAME

from .conftest import make_drafter


def logits_of(drafter, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, q, H = 2, 5, drafter.config.hidden_size
    tokens = torch.randint(0, 128, (n, q), generator=g)
    g_in = drafter.lift(torch.randn(n, q, drafter.config.num_features, H, generator=g))
    mask = torch.ones(q, q, dtype=torch.bool).tril().expand(n, 1, q, q)
    with torch.no_grad():
        return drafter.logits(drafter(tokens, g_in, torch.arange(q).expand(n, q), mask))


@pytest.mark.parametrize(("kind", "vocab"), [("eagle1", None), ("eagle3", 40)])
def test_round_trip_gives_identical_logits(tmp_path, target, kind, vocab):
    d = make_drafter(target, kind, vocab)
    if vocab:
        d.set_draft_vocab(torch.arange(128).flip(0).float() % 7)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # not the init: the weights really come from the file
    path = save_drafter(d, tmp_path / "drafter")
    assert sorted(p.name for p in path.iterdir()) == ["README.md", CONFIG_NAME, WEIGHTS_NAME]
    assert set(load_file(path / WEIGHTS_NAME)) == set(d.state_dict())
    meta = json.loads((path / CONFIG_NAME).read_text())
    assert meta["format_version"] == FORMAT_VERSION and meta["config"]["kind"] == kind
    assert meta["model_type"] == MODEL_TYPE
    torch.manual_seed(123)  # a different init: loading must overwrite everything
    loaded = load_drafter(path, target)
    assert loaded.config == d.config
    assert torch.equal(logits_of(loaded), logits_of(d))
    if vocab:
        assert loaded.draft_ids.equal(d.draft_ids)
    assert list(tmp_path.iterdir()) == [path]  # no temp directories left behind


def test_overwrite_existing_checkpoint_but_not_other_dirs(tmp_path, llama):
    path = tmp_path / "ckpt"
    save_drafter(make_drafter(llama, seed=0), path)
    d1 = make_drafter(llama, seed=1)
    save_drafter(d1, path)
    assert torch.equal(logits_of(load_drafter(path, llama)), logits_of(d1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("important")
    with pytest.raises(ValueError, match="exists and is not a drafter checkpoint; refusing to overwrite"):
        save_drafter(d1, other)
    assert (other / "keep.txt").read_text() == "important"


@pytest.fixture
def saved(tmp_path, qwen2):
    d = make_drafter(qwen2, "eagle3", 32)
    d.set_draft_vocab(torch.arange(128).float())
    return save_drafter(d, tmp_path / "d")


def test_corrupt_weights_raise(saved, qwen2):
    (saved / WEIGHTS_NAME).write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="is corrupt or not a safetensors file"):
        load_drafter(saved, qwen2)


def test_truncated_weights_raise(saved, qwen2):
    data = (saved / WEIGHTS_NAME).read_bytes()
    (saved / WEIGHTS_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="is corrupt or not a safetensors file"):
        load_drafter(saved, qwen2)


def test_missing_and_unexpected_keys_raise(saved, qwen2):
    tensors = load_file(saved / WEIGHTS_NAME)
    del tensors["norm.weight"]
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, saved / WEIGHTS_NAME)
    with pytest.raises(
        ValueError, match=r"missing keys \['norm.weight'\], unexpected keys \['extra.weight'\]"
    ):
        load_drafter(saved, qwen2)


def test_shape_mismatch_raises(saved, qwen2):
    tensors = load_file(saved / WEIGHTS_NAME)
    tensors["fc.weight"] = torch.zeros(64, 128)
    save_file(tensors, saved / WEIGHTS_NAME)
    with pytest.raises(ValueError, match=r"fc.weight has shape \[64, 128\], expected \[64, 192\]"):
        load_drafter(saved, qwen2)


def test_inconsistent_draft_vocab_raises(saved, qwen2):
    tensors = load_file(saved / WEIGHTS_NAME)
    tensors["d2t"] = torch.full_like(tensors["d2t"], 200)
    save_file(tensors, saved / WEIGHTS_NAME)
    with pytest.raises(ValueError, match="d2t and t2d do not describe the same draft vocabulary of 32 ids"):
        load_drafter(saved, qwen2)


def test_config_mismatch_and_bad_config_raise(saved, llama, qwen2):
    with pytest.raises(ValueError, match="model_type is 'qwen2', target has 'llama'"):
        load_drafter(saved, llama)
    cfg_path = saved / CONFIG_NAME
    meta = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(ValueError, match="format_version must be 1, got 99"):
        read_drafter_config(saved)
    cfg_path.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_drafter(saved, qwen2)
    cfg_path.write_text(json.dumps({**meta, "config": {**meta["config"], "hidden_size": -1}}))
    with pytest.raises(ValueError, match="hidden_size must be a positive int, got -1"):
        load_drafter(saved, qwen2)
    cfg_path.unlink()
    with pytest.raises(ValueError, match="is not a drafter checkpoint"):
        load_drafter(saved, qwen2)


def test_missing_weights_file_raises(saved, qwen2):
    (saved / WEIGHTS_NAME).unlink()
    with pytest.raises(ValueError, match="model.safetensors not found"):
        load_drafter(saved, qwen2)


def test_corrupted_data_bytes_giving_nan_weights_raise(saved, qwen2):
    # The header and sizes stay valid (safetensors parses the file): only values are damaged.
    data = bytearray((saved / WEIGHTS_NAME).read_bytes())
    size = int.from_bytes(data[:8], "little")
    entries = json.loads(data[8 : 8 + size])
    key = next(k for k, v in sorted(entries.items()) if k != "__metadata__" and v["dtype"] == "F32")
    start = 8 + size + entries[key]["data_offsets"][0]
    data[start : start + 16] = b"\xff" * 16  # 0xffffffff is a float32 NaN
    (saved / WEIGHTS_NAME).write_bytes(bytes(data))
    with pytest.raises(
        ValueError, match=r"model.safetensors: tensor '.*' has 4 non-finite value\(s\).*corrupt"
    ):
        load_drafter(saved, qwen2)
