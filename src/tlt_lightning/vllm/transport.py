"""Both ends of a weight refresh: the driver's transports and the worker extension vLLM runs them with.

The engine is built with ``worker_extension_cls=WORKER_EXTENSION``: vLLM mixes
:class:`TLTWorkerExtension` into every worker (whatever its executor: in-process, multiprocess,
Ray), and ``LLM.collective_rpc(name, args=...)`` calls its methods by name on all of them, the way
vLLM's own RLHF examples sync a trainer's weights. Only names and plain values cross that RPC
(a file path, or CPU tensors), so it needs no insecure serialization of functions.

This module imports no vLLM: the worker side reads the model through the worker's own attributes
(``model_runner`` and its ``drafter`` / ``speculator``), which exist only inside a vLLM worker.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from tlt_lightning.validation import check

__all__ = [
    "LOAD_FILE",
    "LOAD_TENSORS",
    "WEIGHT_SUMS",
    "WORKER_EXTENSION",
    "FileTransport",
    "RpcTransport",
    "TLTWorkerExtension",
    "WeightTransport",
]

WeightList = list[tuple[str, torch.Tensor]]
COMPONENTS = ("target", "drafter")
WORKER_EXTENSION = "tlt_lightning.vllm.transport.TLTWorkerExtension"
LOAD_FILE = "tlt_load_weights_file"
LOAD_TENSORS = "tlt_load_weights"
WEIGHT_SUMS = "tlt_weight_sums"


class WeightTransport(Protocol):
    """How tensors reach the engine's workers; ``send`` returns once every worker has loaded them."""

    def send(self, llm: Any, component: str, weights: WeightList, version: int) -> None: ...


def _check_loaded(results: Any, component: str, count: int) -> None:
    """Every worker must report that it loaded all ``count`` tensors."""
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    if not results or any(r != count for r in results):
        raise RuntimeError(
            f"vLLM workers loaded {results} {component} tensors, expected {count} on every worker"
        )


class FileTransport:
    """Stage the tensors in a safetensors file that every worker reads (any executor or tensor
    parallelism, workers on this machine).

    Args:
        directory: where to stage (default: ``/dev/shm`` when writable, else the temp directory).
            The file is removed once the workers have loaded it.
    """

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        if directory is None:
            shm = Path("/dev/shm")
            directory = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
        self.directory = Path(directory)

    def send(self, llm: Any, component: str, weights: WeightList, version: int) -> None:
        from safetensors.torch import save_file

        stage = Path(tempfile.mkdtemp(prefix="tlt-weights-", dir=self.directory))
        try:
            path = stage / f"{component}-v{version}.safetensors"
            save_file({n: t.detach().to("cpu").contiguous() for n, t in weights}, str(path))
            stage.chmod(0o755)  # workers may run as another user
            path.chmod(0o644)
            _check_loaded(llm.collective_rpc(LOAD_FILE, args=(component, str(path))), component, len(weights))
        finally:
            shutil.rmtree(stage, ignore_errors=True)


class RpcTransport:
    """Pass the tensors as RPC arguments: no staging file; with an in-process engine
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) they are handed over by reference."""

    def send(self, llm: Any, component: str, weights: WeightList, version: int) -> None:
        _check_loaded(
            llm.collective_rpc(LOAD_TENSORS, args=(component, list(weights))), component, len(weights)
        )


# ------------------------------------------------------------------------------------ worker side
def _unwrap(model: Any) -> nn.Module:
    """The plain module under vLLM's CUDA-graph / micro-batch wrappers (they expose ``unwrap()``)."""
    unwrap = getattr(model, "unwrap", None)
    while callable(unwrap):
        model = unwrap()
        unwrap = getattr(model, "unwrap", None)
    return model


def component_model(runner: Any, component: str) -> nn.Module:
    """The module of ``component`` in a vLLM model runner: the target, or the EAGLE drafter.

    The drafter sits at ``runner.drafter`` (``GPUModelRunner``'s ``EagleProposer``) or
    ``runner.speculator`` (the second-generation runner); both keep the model at ``.model``. These
    are vLLM internals that have moved between releases, hence the two spellings in one place.
    """
    check(component in COMPONENTS, "component", component, f"one of {COMPONENTS}")
    if component == "target":
        get = getattr(runner, "get_model", None)
        return _unwrap(get() if callable(get) else runner.model)
    proposer = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
    model = getattr(proposer, "model", None)
    if model is None:
        raise RuntimeError(
            "this vLLM worker has no EAGLE drafter model (runner.drafter.model / runner.speculator.model): "
            "was the engine built with a speculative_config?"
        )
    return _unwrap(model)


def _rebuild_tied_head(model: nn.Module) -> None:
    """Rebuild a tied LM head's kernel from the reloaded embedding.

    vLLM never loads ``lm_head.*`` of a checkpoint with tied embeddings (the head *is* the
    embedding), so a reload leaves the head's layer as it was; but its kernel may hold its own
    packed copy of the old embedding (the CPU backend builds a oneDNN handle from it), which would
    keep scoring tokens with the old weights. On a GPU this rebuild does nothing.
    """
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied and method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


class TLTWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``): in-place weight refresh.

    ``self`` is the vLLM worker, so ``self.model_runner``, ``self.device`` and ``self.vllm_config``
    are vLLM's. Methods return plain values (counts, floats) to the driver.
    """

    def tlt_load_weights(self, component: str, weights: WeightList) -> int:
        """Load ``(name, tensor)`` pairs (checkpoint / EAGLE names) into ``component``; returns their
        count."""
        model = component_model(self.model_runner, component)
        config = self.vllm_config
        target = component == "target"
        model_config = config.model_config if target else config.speculative_config.draft_model_config
        try:  # vLLM >= 0.32: its own in-place reload (what ``reload_weights`` runs)
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )
        except ImportError:
            model.load_weights(weights)
            self._tlt_after_loading(model, model_config)
        else:
            # Layers may have repacked their weights after the first load (the CPU backend's oneDNN
            # linears leave an empty parameter behind): restore checkpoint-format parameters, load,
            # process again, and copy the result into the kernels' own storage (compiled graphs
            # keep their pointers). Layers that received nothing keep their tensors as they were.
            initialize_layerwise_reload(model)
            model.load_weights(weights)
            finalize_layerwise_reload(model, model_config)
        if target:
            _rebuild_tied_head(model)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return len(weights)

    def tlt_load_weights_file(self, component: str, path: str) -> int:
        """Load a staged safetensors file into ``component`` (see :class:`FileTransport`)."""
        from safetensors.torch import load_file

        device = getattr(self, "device", None)
        weights = load_file(path, device=str(device) if device is not None else "cpu")
        return self.tlt_load_weights(component, list(weights.items()))

    def tlt_weight_sums(self, component: str) -> dict[str, float]:
        """``name -> sum(|p|)`` of ``component``'s parameters (a cheap fingerprint for checks)."""
        model = component_model(self.model_runner, component)
        return {n: float(p.detach().double().abs().sum()) for n, p in model.named_parameters()}

    def _tlt_after_loading(self, model: nn.Module, model_config: Any) -> None:
        # vLLM before the layerwise reload: layers may repack weights after loading (vLLM's own RLHF
        # example calls this after every load); for unquantized weights it leaves them as loaded.
        try:
            from vllm.model_executor.model_loader.utils import process_weights_after_loading
        except ImportError:  # older layouts: nothing to post-process for unquantized weights
            return
        process_weights_after_loading(model, model_config, self.device)
