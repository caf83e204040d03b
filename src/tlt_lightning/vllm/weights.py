"""Refreshing the weights a vLLM engine serves between RL steps, never serving half of them.

vLLM updates weights in place: each worker's ``model.load_weights([(name, tensor), ...])`` copies
checkpoint-named tensors into its (fused, sharded) parameters, the way TRL, OpenRLHF and verl sync
a policy into a colocated engine. Our worker extension (:mod:`.transport`) runs that on every
worker, for the target (``model_runner.model``) or the EAGLE drafter (``model_runner.drafter.model``),
invoked by name with ``LLM.collective_rpc``.

The plan (pure, tested without vLLM):

* **names**: the target's are its transformers checkpoint names, exactly what the engine loaded from
  ``save_pretrained`` (wrapper prefixes such as ``_orig_mod.``/``module.`` are removed, a tied
  ``lm_head.weight`` alias is dropped); the drafter's are the EAGLE export names
  (:func:`~tlt_lightning.drafter.eagle_state_dict`). Both are checked against the shapes the engine
  loaded (the safetensors headers of the served directories) *before* anything is sent: a refresh
  must cover every tensor, so a policy is never served half old, half new.
* **the EAGLE-3 head** ``lm_head.weight`` is the target's LM-head rows of the draft vocabulary (vLLM
  even shares the target's head when they are equal). It is therefore always computed from the
  target weights of the same refresh and never sent on a drafter-only refresh: a drafter whose own
  reference to the target has moved on cannot overwrite the served target's head.
* **versioning**: :class:`WeightVersions` serialises rollouts and refreshes with one lock; a
  refresh that fails part-way leaves the engine marked unusable until a refresh succeeds, so no
  rollout runs on the mixed weights. Every refresh ends by resetting vLLM's prefix cache (cached
  keys/values were computed by the old weights).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tlt_lightning.validation import check
from tlt_lightning.vllm.transport import FileTransport, WeightList, WeightTransport

__all__ = [
    "DrafterSpec",
    "WeightRefresher",
    "WeightUpdate",
    "WeightVersions",
    "normalize_names",
    "plan_drafter",
    "plan_drafter_head",
    "plan_target",
    "read_schema",
]

Schema = dict[str, tuple[int, ...]]
_ANYWHERE = (
    "_orig_mod.",
    "_checkpoint_wrapped_module.",
    "_fsdp_wrapped_module.",
)  # compile / checkpoint / FSDP
_LEADING = ("module.",)  # DDP
_NOT_SENT = ("lm_head.weight", "t2d", "d2t", "embed_tokens.weight")  # see plan_drafter


def read_schema(directory: str | os.PathLike, files: Sequence[str] | None = None) -> Schema:
    """Tensor name -> shape of the safetensors files in ``directory`` (headers only, nothing loaded).

    Args:
        directory: a checkpoint directory (``save_pretrained`` output or a drafter export).
        files: file names to read (default: every ``*.safetensors``).
    """
    from safetensors import safe_open

    directory = Path(directory)
    paths = [directory / f for f in files] if files is not None else sorted(directory.glob("*.safetensors"))
    if not paths or not all(p.is_file() for p in paths):
        raise ValueError(
            f"{directory} has no safetensors weights ({[p.name for p in paths] or '*.safetensors'})"
        )
    schema: Schema = {}
    for path in paths:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not a mapping)
                schema[name] = tuple(handle.get_slice(name).get_shape())
    return schema


def normalize_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove wrapper prefixes (``torch.compile``, activation checkpointing, FSDP, DDP) from names."""
    out: dict[str, torch.Tensor] = {}
    for raw, tensor in state.items():
        name = raw
        for part in _ANYWHERE:
            name = name.replace(part, "")
        for prefix in _LEADING:
            name = name.removeprefix(prefix)
        if name in out:
            raise ValueError(
                f"two tensors map to {name!r} once wrapper prefixes are removed (one is {raw!r})"
            )
        out[name] = tensor
    return out


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.device == b.device and (a.data_ptr() == b.data_ptr() or torch.equal(a, b))


def _fit(what: str, names: set[str], expected: set[str]) -> None:
    missing, unexpected = sorted(expected - names), sorted(names - expected)
    if missing or unexpected:
        raise ValueError(
            f"{what} weights do not fit the served model: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
            "(a refresh must cover every tensor)"
        )


def _check_shapes(what: str, items: Mapping[str, torch.Tensor], schema: Schema) -> None:
    for name, tensor in items.items():
        if tuple(tensor.shape) != tuple(schema[name]):
            raise ValueError(
                f"{what} {name} has shape {list(tensor.shape)}, the served model has {list(schema[name])}"
            )


def plan_target(
    state: Mapping[str, torch.Tensor], schema: Schema, dtype: torch.dtype | None = None
) -> WeightList:
    """The target tensors of a refresh, in the served checkpoint's names and order.

    Args:
        state: the policy's ``state_dict()`` (transformers names; wrapper prefixes allowed).
        schema: name -> shape of what the engine loaded (:func:`read_schema`).
        dtype: cast floating-point tensors to it (e.g. the engine's dtype, halving the transfer).

    Raises:
        ValueError: a tensor is missing, unexpected (tied aliases excepted) or misshapen.
    """
    state = normalize_names(state)
    extra = [n for n in state if n not in schema]
    # A tied alias (lm_head.weight of a tied-embedding model) is not in the checkpoint: drop it.
    aliases = {n for n in extra if any(_same(state[n], state[s]) for s in schema if s in state)}
    _fit("target", set(state) - aliases, set(schema))
    kept = {n: state[n] for n in schema}
    _check_shapes("target", kept, schema)
    return [(n, _cast(t, dtype)) for n, t in kept.items()]


@dataclass(frozen=True)
class DrafterSpec:
    """The drafter an engine serves: EAGLE kind, tensor shapes, and its draft vocabulary.

    Attributes:
        kind: ``"eagle1"`` or ``"eagle3"``.
        schema: name -> shape of the export's ``model.safetensors``.
        d2t: ``[V_draft]`` int64 offsets of a reduced EAGLE-3 draft vocabulary, else ``None``.
    """

    kind: str
    schema: Schema
    d2t: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check(self.kind in ("eagle1", "eagle3"), "kind", self.kind, "'eagle1' or 'eagle3'")

    @classmethod
    def from_export(cls, directory: str | os.PathLike) -> DrafterSpec:
        """Read an :func:`~tlt_lightning.drafter.export_drafter` directory (config, headers, ``d2t``)."""
        import json

        from safetensors import safe_open

        from tlt_lightning.drafter.eagle_format import EAGLE3_ARCHITECTURES
        from tlt_lightning.drafter.export import EXPORT_CONFIG, EXPORT_WEIGHTS

        directory = Path(directory)
        config = json.loads((directory / EXPORT_CONFIG).read_text())
        kind = "eagle3" if (config.get("architectures") or [None])[0] in EAGLE3_ARCHITECTURES else "eagle1"
        schema = read_schema(directory, [EXPORT_WEIGHTS])
        d2t = None
        if kind == "eagle3" and "d2t" in schema:
            with safe_open(directory / EXPORT_WEIGHTS, framework="pt") as handle:
                d2t = handle.get_tensor("d2t")
        return cls(kind, schema, d2t)


def plan_drafter(
    state: Mapping[str, torch.Tensor], spec: DrafterSpec, dtype: torch.dtype | None = None
) -> WeightList:
    """The drafter's own tensors of a refresh, in EAGLE export names.

    ``lm_head.weight``, ``d2t``/``t2d`` and embeddings in ``state`` are never sent: the draft
    vocabulary is fixed by the served export (a different ``d2t`` is an error) and the EAGLE-3 head
    comes from the target (:func:`plan_drafter_head`).

    Args:
        state: ``eagle_state_dict(drafter)`` or any mapping of EAGLE names.
        spec: what the engine serves (:meth:`DrafterSpec.from_export`).
        dtype: cast floating-point tensors to it.

    Raises:
        ValueError: missing / unexpected / misshapen tensors, or another draft vocabulary.
    """
    state = normalize_names(state)
    if spec.d2t is not None and "d2t" in state and not torch.equal(state["d2t"].cpu(), spec.d2t):
        raise ValueError(
            "the drafter's draft vocabulary (d2t) differs from the served export's: export and serve it anew"
        )
    own = {n: t for n, t in state.items() if n not in _NOT_SENT}
    expected = {n for n in spec.schema if n not in _NOT_SENT}
    _fit("drafter", set(own), expected)
    _check_shapes("drafter", own, spec.schema)
    return [(n, _cast(own[n], dtype)) for n in sorted(expected)]


def plan_drafter_head(
    spec: DrafterSpec, target_head: torch.Tensor | None, dtype: torch.dtype | None = None
) -> WeightList:
    """The EAGLE-3 ``lm_head.weight`` of a refresh: ``target_head``'s draft-vocabulary rows.

    Args:
        spec: what the engine serves.
        target_head: ``[V, H]`` the target's LM head *of the same refresh*, or ``None`` (then, and
            for EAGLE-1, nothing: the served head stays the one of the served target).
        dtype: cast to it.
    """
    if target_head is None or spec.kind != "eagle3" or "lm_head.weight" not in spec.schema:
        return []
    rows = target_head
    if spec.d2t is not None:
        ids = torch.arange(spec.d2t.numel(), device=target_head.device) + spec.d2t.to(target_head.device)
        rows = target_head[ids]
    _check_shapes("drafter", {"lm_head.weight": rows}, spec.schema)
    return [("lm_head.weight", _cast(rows, dtype))]


@dataclass
class WeightUpdate:
    """The validated tensors of one refresh, per component (empty lists are not sent)."""

    target: WeightList = field(default_factory=list)
    drafter: WeightList = field(default_factory=list)


class WeightVersions:
    """The version of the weights an engine serves; keeps rollouts and refreshes apart (thread-safe).

    A rollout holds :meth:`serving` for its duration, a refresh holds :meth:`updating`: neither
    starts while the other runs. A refresh that raises leaves the engine *failed*: rollouts are
    refused until a later refresh succeeds.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.version = 0
        self.failure: str | None = None

    @contextmanager
    def serving(self) -> Iterator[int]:
        """Hold the current weights for one rollout; yields their version."""
        with self._lock:
            if self.failure is not None:
                raise RuntimeError(
                    f"the engine holds half-updated weights: refresh to version {self.version + 1} failed "
                    f"({self.failure}); call refresh_weights again before generating"
                )
            yield self.version

    @contextmanager
    def updating(self) -> Iterator[int]:
        """Hold the engine for one refresh; yields the version it will serve once the block succeeds."""
        with self._lock:
            self.failure = "refresh in progress"
            try:
                yield self.version + 1
            except BaseException as err:
                self.failure = f"{type(err).__name__}: {err}"
                raise
            self.version += 1
            self.failure = None


def _state(source: nn.Module | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    return source.state_dict() if isinstance(source, nn.Module) else source


class WeightRefresher:
    """Plans, validates and applies weight refreshes to one vLLM engine.

    Args:
        llm: the engine (``vllm.LLM`` built with our worker extension, or a fake with
            ``collective_rpc`` and ``reset_prefix_cache``).
        target_schema: name -> shape of the served target (:func:`read_schema`).
        drafter: the served drafter (:meth:`DrafterSpec.from_export`), ``None`` without speculation.
        transport: how tensors travel (default :class:`FileTransport`).
        dtype: cast floating-point tensors to the engine's dtype before sending (``None``: as they are).
        versions: the engine's version state (shared with the rollout side).
    """

    def __init__(
        self,
        llm: Any,
        target_schema: Schema,
        drafter: DrafterSpec | None = None,
        transport: WeightTransport | None = None,
        dtype: torch.dtype | None = None,
        versions: WeightVersions | None = None,
    ) -> None:
        self.llm, self.target_schema, self.drafter = llm, dict(target_schema), drafter
        self.transport = transport or FileTransport()
        self.dtype = dtype
        self.versions = versions or WeightVersions()

    def plan(
        self,
        target: nn.Module | Mapping[str, torch.Tensor] | None = None,
        drafter: nn.Module | Mapping[str, torch.Tensor] | None = None,
    ) -> WeightUpdate:
        """Validate a refresh and return what it would send (no side effects).

        Args:
            target: the policy (a transformers model) or its state dict.
            drafter: a :class:`~tlt_lightning.drafter.Drafter` or a mapping of EAGLE names.

        Raises:
            ValueError: nothing to refresh, a drafter without a served drafter, or a plan error.
        """
        if target is None and drafter is None:
            raise ValueError("refresh needs target and/or drafter weights, got neither")
        update = WeightUpdate()
        head = None
        if target is not None:
            state = normalize_names(_state(target))
            update.target = plan_target(state, self.target_schema, self.dtype)
            head_name = (
                "lm_head.weight" if "lm_head.weight" in self.target_schema else "model.embed_tokens.weight"
            )
            head = state.get(head_name)
        if self.drafter is None:
            if drafter is not None:
                raise ValueError(
                    "drafter weights were given, but the engine serves no drafter (built without one)"
                )
            return update
        if drafter is not None:
            update.drafter = plan_drafter(_drafter_state(drafter), self.drafter, self.dtype)
        # Also on a target-only refresh: the EAGLE-3 head follows the target it was cut from.
        update.drafter += plan_drafter_head(self.drafter, head, self.dtype)
        return update

    def refresh(
        self,
        target: nn.Module | Mapping[str, torch.Tensor] | None = None,
        drafter: nn.Module | Mapping[str, torch.Tensor] | None = None,
    ) -> int:
        """Validate, then load ``target`` and/or ``drafter`` into the engine; returns the new version.

        Validation happens before the engine is touched; a failure while loading leaves the engine
        refusing rollouts (see :class:`WeightVersions`) until a refresh succeeds.
        """
        update = self.plan(target, drafter)
        with self.versions.updating() as version:
            if update.target:
                self.transport.send(self.llm, "target", update.target, version)
            if update.drafter:
                self.transport.send(self.llm, "drafter", update.drafter, version)
            if self.llm.reset_prefix_cache() is False:  # cached keys/values belong to the old weights
                raise RuntimeError("vLLM did not reset its prefix cache (were requests still running?)")
        return version


def _drafter_state(drafter: nn.Module | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    if isinstance(drafter, nn.Module):
        from tlt_lightning.drafter.export import eagle_state_dict

        return eagle_state_dict(drafter)
    return drafter
