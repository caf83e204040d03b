"""tlt-lightning: lossless speculative decoding of RL rollouts with a spot-trained drafter.

Subpackages, bottom floor first (imports only go downward, docs/architecture.md): ``speculative``
(pure math), ``models``, ``rollout``, ``drafter`` and ``scheduling``, ``vllm`` and ``tracking``, ``rl``,
``efficiency`` and ``callbacks``; the ``tlt-lightning`` CLI and ``recipes`` sit on top (the benchmarks
run from a checkout, ``python -m benchmarks``, and are not in the package).
The headline classes are importable from here, loaded on first use, so ``import tlt_lightning``
itself imports nothing heavy:

    >>> from tlt_lightning import GRPOModule, SpotDrafterCallback  # doctest: +SKIP
    >>> trainer = Trainer(callbacks=[SpotDrafterCallback()])  # doctest: +SKIP
"""

from importlib import import_module, metadata
from typing import Any

try:
    __version__ = metadata.version("tlt-lightning")  # pyproject.toml's, as installed
except metadata.PackageNotFoundError:  # run from a checkout's src/ without installing (the GPU check scripts)
    __version__ = "0+unknown"

# Public name -> the subpackage that defines it.
_LAZY = {
    "BEGMABStrategy": "tlt_lightning.scheduling",
    "GRPOModule": "tlt_lightning.rl",
    "SpeculativeRolloutLoop": "tlt_lightning.rollout",
    "SpotDrafterCallback": "tlt_lightning.callbacks",
}
__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
