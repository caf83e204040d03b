"""Target models: registry and offline loading, the target adapter protocol, the KV cache."""

from tlt_lightning.models.kv_cache import KVCache
from tlt_lightning.models.registry import LoadedModel, ModelNotFoundError, available_models, cache_dir, load_model
from tlt_lightning.models.target import HFTarget, TargetInfo, TargetModel, TargetOutput, default_feature_layers

__all__ = [
    "HFTarget",
    "KVCache",
    "LoadedModel",
    "ModelNotFoundError",
    "TargetInfo",
    "TargetModel",
    "TargetOutput",
    "available_models",
    "cache_dir",
    "default_feature_layers",
    "load_model",
]
