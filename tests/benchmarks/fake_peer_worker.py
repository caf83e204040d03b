"""A stand-in for vLLM in the peers benchmark's tests: the worker protocol served by our own engine.

Run as a script (``python tests/benchmarks/fake_peer_worker.py``) with the package and the checkout's
``benchmarks`` importable (``PYTHONPATH=src:.``). It serves
the ``start`` request's ``model`` directory with :class:`RolloutEngine` (greedy outputs must then equal
the driver's token for token); the drafter is ignored (speculation is lossless, so greedy tokens are
the same). ``FAKE_PEER_FAIL=start`` makes ``start`` fail, to test that the driver reports it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Any

from benchmarks.peers_worker import serve


class EnginePeer:
    device = "cpu"

    def __init__(self, spec: dict[str, Any]) -> None:
        from tlt_lightning.models import HFTarget, load_model

        if os.environ.get("FAKE_PEER_FAIL") == "start":
            raise ValueError("fake start failure")
        self.target = HFTarget(load_model(spec["model"], dtype=spec.get("dtype", "float32")).model)
        self.info = self.target.info

    def generate(self, prompts: list[list[int]], config: Any, ignore_eos: bool) -> Any:
        from tlt_lightning.rollout import RolloutEngine

        self.target.info = replace(self.info, eos_token_ids=()) if ignore_eos else self.info
        return RolloutEngine(self.target, config).generate(prompts)


if __name__ == "__main__":
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.exit(serve(sys.stdin, proto, EnginePeer))
