"""The client side of ``python -m benchmarks peers``: the vLLM worker process and the timing of a run.

:class:`PeerClient` starts a worker (:mod:`.peers_worker`) and drives it with JSON lines; every
engine, ours or the worker's, is an :data:`Engine`: a call on a group of prompts that returns a
:class:`RunTiming`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

__all__ = ["WORKER_MODULE", "Engine", "PeerClient", "RunTiming", "worker_env"]

WORKER_MODULE = "benchmarks.peers_worker"


@dataclass
class RunTiming:
    """One engine call: tokens per request, wall seconds, seconds to the last first token."""

    tokens: list[list[int]]
    total_s: float
    first_s: float
    accept_length: float = 0.0  # tokens per request per speculative step (0: no speculation)

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def end_to_end_tps(self) -> float:
        return self.generated / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens after each request's first, over the time after the last first token."""
        seconds = self.total_s - self.first_s
        return (self.generated - len(self.tokens)) / seconds if seconds > 0 else 0.0


Engine = Callable[[list[list[int]]], RunTiming]


class PeerClient:
    """A worker process (:mod:`.peers_worker`) and its JSON-line protocol.

    Args:
        command: the worker's command line (default: ``--vllm-python -m benchmarks.peers_worker``).
        env: extra environment variables for it.
        log: file that receives the worker's stderr (vLLM's logs).
    """

    def __init__(
        self, command: Sequence[str], env: dict[str, str] | None = None, log: str | os.PathLike | None = None
    ):
        self.log = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (closed in close())
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            list(command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.spawned_at = t0

    def request(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Send one request, return its answer; ``RuntimeError`` if the worker failed or died."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(payload) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as err:
            raise RuntimeError(f"peer worker exited (code {self.proc.poll()}); see its log") from err
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"peer worker exited (code {self.proc.wait()}) without answering {payload.get('op')!r}; "
                "see its log"
            )
        answer = json.loads(line)
        if not answer.get("ok"):
            raise RuntimeError(f"peer worker: {answer.get('error')}\n{answer.get('traceback', '')}")
        return answer

    def start(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Build the engine; adds ``process_s``: from spawning the process to the engine being ready."""
        answer = self.request({"op": "start", **spec})
        answer["process_s"] = time.perf_counter() - self.spawned_at
        return answer

    def engine(self, max_new_tokens: int, temperature: float, ignore_eos: bool) -> Engine:
        def call(prompts: list[list[int]]) -> RunTiming:
            a = self.request(
                {
                    "op": "generate",
                    "prompts": prompts,
                    "max_new_tokens": max_new_tokens,
                    "temperature": temperature,
                    "ignore_eos": ignore_eos,
                }
            )
            spec = a["spec"]
            accept = 1 + spec["accepted_tokens"] / spec["drafts"] if spec["drafts"] else 0.0
            return RunTiming(a["tokens"], a["total_s"], max(a["first_token_s"]), accept)

        return call

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request({"op": "stop"})
                self.proc.wait(timeout=60)
            except (RuntimeError, subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def worker_env(args: argparse.Namespace, threads: int) -> dict[str, str]:
    """The worker's environment: ``threads`` OpenMP threads, offline, this checkout importable."""
    # This checkout's sources, ahead of any installed copy, and its root (the worker is in benchmarks/).
    root = Path(__file__).resolve().parents[1]
    path = os.environ.get("PYTHONPATH")
    paths = os.pathsep.join([str(root / "src"), str(root), *([path] if path else [])])
    return {
        "PYTHONPATH": paths,
        "OMP_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind,
    }
