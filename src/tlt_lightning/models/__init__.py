"""Target models: registry and offline loading, the target adapter protocol, the KV cache.

``TorchtuneTarget`` and ``torchtune_from_hf`` (:mod:`tlt_lightning.models.torchtune_target`) need the
optional ``torchtune`` extra: they are imported on first access, so importing this package never
needs torchtune, and accessing them without it raises an ``ImportError`` naming the extra.
"""

from typing import Any

from tlt_lightning.models.compiled import CompileConfig
from tlt_lightning.models.hardware import resolve_decode, resolve_dtype, training_precision
from tlt_lightning.models.kv_cache import KVCache
from tlt_lightning.models.layout import WEIGHT_LAYOUTS, set_weight_layout
from tlt_lightning.models.registry import (
    LoadedModel,
    ModelNotFoundError,
    available_models,
    load_model,
    load_tokenizer,
    model_dir,
    models_with_signature,
)
from tlt_lightning.models.target import DECODE_PATHS, HFTarget, TargetInfo, TargetModel, TargetOutput

__all__ = [
    "DECODE_PATHS",
    "WEIGHT_LAYOUTS",
    "CompileConfig",
    "HFTarget",
    "KVCache",
    "LoadedModel",
    "ModelNotFoundError",
    "TargetInfo",
    "TargetModel",
    "TargetOutput",
    "available_models",
    "load_model",
    "load_tokenizer",
    "model_dir",
    "models_with_signature",
    "resolve_decode",
    "resolve_dtype",
    "set_weight_layout",
    "training_precision",
]

_TORCHTUNE = ("TorchtuneTarget", "torchtune_from_hf")


def __getattr__(name: str) -> Any:
    if name in _TORCHTUNE:  # optional extra: imported on first use only
        from tlt_lightning.models import torchtune_target

        return getattr(torchtune_target, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
