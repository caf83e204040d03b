from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tlt_lightning.drafter import Drafter, load_drafter, read_drafter_config, save_drafter
from tlt_lightning.drafter.hub import CONFIG_NAME, LEGACY_CONFIG_NAME, MODEL_TYPE, WEIGHTS_NAME

from .conftest import make_drafter

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "drafters"


def perturbed(target, kind="eagle3", vocab=40):
    d = make_drafter(target, kind, vocab)
    if vocab:
        d.set_draft_vocab(torch.arange(target.info.vocab_size).flip(0).float() % 7)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # not the init: the weights really come from the file
    return d


def assert_same_state(a: Drafter, b: Drafter) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key, value in sa.items():
        assert value.dtype == sb[key].dtype and torch.equal(value, sb[key]), key


@pytest.mark.parametrize(("kind", "vocab"), [("eagle1", None), ("eagle1", 48), ("eagle3", 40)])
def test_save_pretrained_round_trips_bit_for_bit(tmp_path, target, kind, vocab):
    d = perturbed(target, kind, vocab)
    d.save_pretrained(tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["README.md", CONFIG_NAME, WEIGHTS_NAME]
    torch.manual_seed(123)  # another init: loading must overwrite everything
    loaded = Drafter.from_pretrained(tmp_path / "a", target=target)
    assert loaded.config == d.config
    assert_same_state(loaded, d)
    loaded.save_pretrained(tmp_path / "b")
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_model_card_names_the_library(tmp_path, llama):
    make_drafter(llama).save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "library_name: tlt-lightning" in card and "- speculative-decoding" in card


def test_from_pretrained_needs_the_target(tmp_path, llama):
    make_drafter(llama).save_pretrained(tmp_path)
    with pytest.raises(TypeError, match="needs target=: the drafter reads the target's embedding"):
        Drafter.from_pretrained(tmp_path)


def test_from_pretrained_is_strict(tmp_path, llama, qwen2):
    make_drafter(qwen2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type is 'qwen2', target has 'llama'"):
        Drafter.from_pretrained(tmp_path, target=llama)
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
    (tmp_path / CONFIG_NAME).write_text(json.dumps({**meta, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type must be 'tlt_lightning_drafter', got 'llama'"):
        Drafter.from_pretrained(tmp_path, target=qwen2)


def to_legacy(directory: Path) -> Path:
    """Rewrite a checkpoint in the layout before the Hugging Face one (``drafter_config.json``)."""
    meta = json.loads((directory / CONFIG_NAME).read_text())
    (directory / CONFIG_NAME).unlink()
    (directory / "README.md").unlink()
    legacy = {"format_version": meta["format_version"], "config": meta["config"]}
    (directory / LEGACY_CONFIG_NAME).write_text(json.dumps(legacy, indent=2) + "\n")
    return directory


def test_legacy_checkpoints_load_and_are_rewritten_in_the_new_layout(tmp_path, target):
    d = perturbed(target)
    legacy = to_legacy(save_drafter(d, tmp_path / "old"))
    assert_same_state(load_drafter(legacy, target), d)
    assert_same_state(Drafter.from_pretrained(legacy, target=target), d)
    save_drafter(load_drafter(legacy, target), legacy)  # a legacy checkpoint may be replaced
    assert sorted(p.name for p in legacy.iterdir()) == ["README.md", CONFIG_NAME, WEIGHTS_NAME]
    assert_same_state(load_drafter(legacy, target), d)


@pytest.mark.parametrize("name", ["smollm2-countdown", "smollm2-countdown-eagle3"])
def test_the_shipped_drafters_keep_their_legacy_layout_and_read(name):
    directory = EXAMPLES / name
    assert (directory / LEGACY_CONFIG_NAME).is_file() and not (directory / CONFIG_NAME).exists()
    assert read_drafter_config(directory).num_target_layers == 30


def test_the_shipped_arith_drafter_is_in_the_hub_layout_with_its_warmup_record():
    directory = EXAMPLES / "smollm2-arith"
    assert (directory / CONFIG_NAME).is_file() and not (directory / LEGACY_CONFIG_NAME).exists()
    config = read_drafter_config(directory)
    assert (config.num_target_layers, config.draft_vocab_size) == (30, 8192)
    record = json.loads((directory / "warmup.json").read_text())
    assert record["held_out_after"]["accept"] > record["held_out_before"]["accept"]  # on the draft vocabulary
    # What sampling accepts, as the README's round-3 table says.
    assert record["held_out_after_full_vocab"]["accept"] == pytest.approx(0.637, abs=5e-4)


def test_save_drafter_refuses_a_transformers_model_directory(tmp_path, llama):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / CONFIG_NAME).write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="exists and is not a drafter checkpoint; refusing to overwrite"):
        save_drafter(make_drafter(llama), model_dir)
    assert json.loads((model_dir / CONFIG_NAME).read_text())["model_type"] == "llama"


def test_transformers_refuses_a_checkpoint_instead_of_random_init(tmp_path, llama):
    make_drafter(llama).save_pretrained(tmp_path / "llama-drafter")  # "llama" in the name: no guess by name
    with pytest.raises(ValueError, match=MODEL_TYPE):
        AutoConfig.from_pretrained(tmp_path / "llama-drafter")
    with pytest.raises(ValueError, match=MODEL_TYPE):
        AutoModelForCausalLM.from_pretrained(tmp_path / "llama-drafter")


def test_from_a_hub_repository_and_push_to_hub(tmp_path, monkeypatch, llama):
    """The Hub paths of the mixin, with the Hub replaced by a folder: what is pushed loads back."""
    d = perturbed(llama)
    uploaded = tmp_path / "hub" / "me" / "drafter"

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            return type("Repo", (), {"repo_id": repo_id})

        def upload_folder(self, repo_id, folder_path, **kwargs):
            shutil.copytree(folder_path, tmp_path / "hub" / repo_id)
            return f"hub://{repo_id}"

    def download(repo_id, filename, **kwargs):
        path = tmp_path / "hub" / repo_id / filename
        if not path.is_file():
            raise FileNotFoundError(path)
        return str(path)

    monkeypatch.setattr("huggingface_hub.hub_mixin.HfApi", FakeApi)
    monkeypatch.setattr("huggingface_hub.hub_mixin.hf_hub_download", download)
    monkeypatch.setattr("tlt_lightning.drafter.hub.hf_hub_download", download)
    assert d.push_to_hub("me/drafter") == "hub://me/drafter"
    assert sorted(p.name for p in uploaded.iterdir()) == ["README.md", CONFIG_NAME, WEIGHTS_NAME]
    assert_same_state(Drafter.from_pretrained("me/drafter", target=llama), d)
