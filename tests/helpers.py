"""Helpers shared by tests of different packages: checkpoint comparison, processes started at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def callback_state(checkpoint: dict, name: str) -> dict:
    """The state a Lightning checkpoint holds for the one callback whose key starts with ``name``."""
    (key,) = [k for k in checkpoint["callbacks"] if k.startswith(name)]
    return checkpoint["callbacks"][key]


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """``a == b`` through nested dicts, lists and tuples, tensors compared exactly; fails naming the path."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def run_at_once(context: Any, target: Callable[..., None], args: list[tuple], timeout: float = 300) -> list:
    """Run ``target(*arg, start, results)`` in one process per ``arg``, released together by the barrier
    ``start``; each puts one item on the queue ``results``. Returns the items, sorted; kills stragglers.

    Args:
        context: a ``multiprocessing`` context (``"spawn"`` or ``"fork"``).
    """
    start, results = context.Barrier(len(args)), context.Queue()
    procs = [context.Process(target=target, args=(*arg, start, results)) for arg in args]
    for proc in procs:
        proc.start()
    try:
        return sorted(results.get(timeout=timeout) for _ in procs)
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
