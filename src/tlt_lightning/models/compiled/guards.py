"""Compiled graphs called without dynamo's guards (``CompileConfig.skip_guards``), each under its own code.

``torch.compile`` keeps what it compiled per code object: a list of cache entries, each a guard function
and the compiled bytecode it protects. :class:`~tlt_lightning.models.compiled.BucketedGraphs` gives every
graph key a code object of its own (:func:`own_code`); once that code holds exactly one entry, its calls
run the entry's bytecode as a plain function (:func:`guard_free`): no guards, no frame hook. For dynamic
graphs the guards are thousands of symbolic checks on the cache views, run in Python at every call.

Reading the entries takes dynamo's private debug API, :data:`DEBUG_API`, here and nowhere else in the
library. Where a torch release lacks it, or it fails, or it returns something else than a list of entries
with a code object, one warning names the API, what went wrong and the torch version, and the graphs keep
their guards: the same results, slower calls.

Example:
    >>> def f(x):
    ...     return x + 1
    >>> g = own_code(f)
    >>> g(1), g.__code__ is f.__code__
    (2, False)
"""

from __future__ import annotations

import importlib
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DEBUG_API", "cache_entries", "guard_free", "own_code"]

log = logging.getLogger(__name__)

DEBUG_API = "torch._dynamo.eval_frame._debug_get_cache_entry_list"
"""The private dynamo function :func:`cache_entries` reads compiled bytecode through."""

_warned: set[str] = set()  # the kinds of trouble with DEBUG_API warned about, once per process each


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` under a code object of its own. ``torch.compile`` keeps graphs per code object, and
    :meth:`~tlt_lightning.models.compiled.BucketedGraphs.compile`'s graphs skip the guards on the model's
    modules: another model of the same shapes (another bias, norm epsilon) or another config (a static
    graph, a dynamic one) must never reach them."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _unusable(kind: str, problem: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        log.warning(
            "CompileConfig.skip_guards needs %s, which %s under torch %s; compiled graphs keep "
            "dynamo's guards (same results, slower calls)",
            DEBUG_API,
            problem,
            torch.__version__,
        )


def cache_entries(fn: Callable[..., Any]) -> list[Any] | None:
    """dynamo's cache entries for ``fn``'s code object (one per graph compiled for it), or ``None`` where
    :data:`DEBUG_API` is missing, fails or returns no list (one warning per kind of trouble)."""
    module, name = DEBUG_API.rsplit(".", 1)
    try:
        api = getattr(importlib.import_module(module), name, None)
    except ImportError:
        api = None
    if not callable(api):
        _unusable("missing", "is missing")
        return None
    try:
        entries = api(fn.__code__)
    except Exception as err:  # a private debug API: whatever a torch release makes it raise, fall back
        _unusable("failed", f"failed ({type(err).__name__}: {err})")
        return None
    if not isinstance(entries, list):
        _unusable("changed", f"returned {type(entries).__name__!r}, not a list")
        return None
    return entries


def guard_free(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """The one graph compiled for ``fn``'s code as a plain function that runs no guards, or ``None``:
    no graph or several (the guards tell them apart: keep them), or :data:`DEBUG_API` unusable (warned)."""
    entries = cache_entries(fn)
    if entries is None or len(entries) != 1:
        return None
    code = getattr(entries[0], "code", None)
    if not isinstance(code, types.CodeType):
        _unusable("changed", f"returned entries of type {type(entries[0]).__name__!r} without a code object")
        return None
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
