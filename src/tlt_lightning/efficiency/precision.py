"""Per-layer-type precision: embeddings and head in fp32, attention and MLP in bf16 (or fp16).

Parameters stay fp32 (they are the master weights); each *compute group* (default: attention
modules and MLP modules) runs its forward under ``torch.autocast`` at ``compute_dtype`` and hands
fp32 back to the residual stream, so norms, residual adds, the embeddings and the LM head run in
fp32. ``full_precision`` modules also switch off any autocast around them (Lightning's
``"bf16-mixed"``) and get fp32 inputs.

fp16 adds one loss scaler per group. Instead of scaling the loss, each group scales the gradient
where it enters the group (its outputs: ``grad * S_g``) and unscales it where it leaves (its inputs:
``grad / S_g``), so the residual stream and every fp32 module see true gradients and each group's
fp16 backward runs at its own scale. A non-finite gradient leaving a group is recorded as that
group's overflow and zeroed, so it does not poison other groups' overflow checks. Before the
optimizer step, :meth:`PrecisionHandle.unscale_` divides each group's parameter gradients by its
scale (torch's ``GradScaler`` kernels); a step with any overflow is skipped and only the
overflowing groups back off, the others keep growing on their own schedule.

Example:
    >>> from tlt_lightning.models import load_model
    >>> model = load_model("tiny-llama").model
    >>> handle = LayerwisePrecision(PrecisionConfig()).apply(model)
    >>> sorted(handle.groups), len(handle.groups["attention"])
    (['attention', 'mlp'], 4)
    >>> handle.remove()
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from tlt_lightning.validation import check, is_int

__all__ = ["GroupLossScaler", "LayerwisePrecision", "PrecisionConfig", "PrecisionHandle"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PrecisionConfig:
    """Which modules compute in low precision, and the fp16 loss scalers.

    Args:
        compute_dtype: ``"bfloat16"`` (no scaling needed) or ``"float16"`` (per-group loss scalers).
        groups: group name -> module-name patterns (``fnmatch``, ``*`` crosses dots); each group must
            match at least one module. A module inside a matched module is not matched again.
        full_precision: patterns of modules forced to fp32 (autocast off). May match nothing (the
            drafter borrows the target's embedding and head: they are not its modules).
        init_scale: first loss scale of every fp16 group.
        growth_factor: scale multiplier after ``growth_interval`` steps without overflow (> 1).
        backoff_factor: scale multiplier after an overflow, in (0, 1).
        growth_interval: steps without overflow before the scale grows (>= 1).

    Example:
        >>> PrecisionConfig(compute_dtype="float16", init_scale=2.0**12).dtype
        torch.float16
    """

    compute_dtype: str = "bfloat16"
    groups: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: {"attention": ("*self_attn",), "mlp": ("*mlp",)}
    )
    full_precision: tuple[str, ...] = ("*embed_tokens", "*lm_head")
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 200

    def __post_init__(self) -> None:
        check(self.compute_dtype in _DTYPES, "compute_dtype", self.compute_dtype, f"one of {sorted(_DTYPES)}")
        if not isinstance(self.groups, Mapping) or not self.groups:
            raise ValueError(f"groups must be a non-empty mapping of name -> patterns, got {self.groups!r}")
        groups = {}
        for name, patterns in self.groups.items():
            patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
            if not patterns or not all(isinstance(p, str) and p for p in patterns):
                raise ValueError(f"groups[{name!r}] must be non-empty module-name patterns, got {patterns!r}")
            groups[str(name)] = patterns
        object.__setattr__(self, "groups", groups)
        full = (self.full_precision,) if isinstance(self.full_precision, str) else tuple(self.full_precision)
        object.__setattr__(self, "full_precision", full)
        if not (isinstance(self.init_scale, (int, float)) and 0 < self.init_scale < float("inf")):
            raise ValueError(f"init_scale must be a positive finite number, got {self.init_scale!r}")
        if not (isinstance(self.growth_factor, (int, float)) and self.growth_factor > 1):
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor!r}")
        if not (isinstance(self.backoff_factor, (int, float)) and 0 < self.backoff_factor < 1):
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        g = self.growth_interval
        check(is_int(g) and g >= 1, "growth_interval", g, "an int >= 1")

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.compute_dtype]

    @property
    def scaled(self) -> bool:
        """Whether groups need loss scalers (fp16: 5 exponent bits; bf16 has fp32's range)."""
        return self.dtype == torch.float16


class GroupLossScaler:
    """One group's dynamic loss scale: ``GradScaler``'s update rule, for a set of parameters.

    Attributes:
        scale: ``[1]`` fp32 current scale.
        found_inf: ``[1]`` fp32, > 0 once an overflow was seen this step.
    """

    def __init__(self, config: PrecisionConfig, device: torch.device) -> None:
        self.config = config
        self.scale = torch.full((1,), float(config.init_scale), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)

    def unscale_(self, params: list[nn.Parameter]) -> None:
        """Divide these parameters' gradients by the scale in place, recording non-finite values."""
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, self.scale.reciprocal())

    def update(self) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps; clear the flag."""
        c = self.config
        torch._amp_update_scale_(
            self.scale,
            self.growth_tracker,
            self.found_inf,
            c.growth_factor,
            c.backoff_factor,
            c.growth_interval,
        )
        self.found_inf.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"scale": float(self.scale), "growth_tracker": int(self.growth_tracker)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "scale" in state:
            self.scale.fill_(float(state["scale"]))
        if "growth_tracker" in state:
            self.growth_tracker.fill_(int(state["growth_tracker"]))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by the scale (group outputs) or divides
    by it and records overflow (group inputs)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scaler: GroupLossScaler, entering: bool) -> torch.Tensor:
        ctx.scaler, ctx.entering = scaler, entering
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        scale = ctx.scaler.scale.to(grad.dtype)
        if ctx.entering:  # into the group: its fp16 backward runs at this group's scale
            return grad * scale, None, None
        grad = grad.float() / ctx.scaler.scale
        finite = torch.isfinite(grad)
        ctx.scaler.found_inf.add_((~finite).any().float())  # no host sync: read once per step
        return torch.where(finite, grad, torch.zeros((), dtype=grad.dtype)), None, None


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _device_type(args: Any, kwargs: Any) -> str:
    return next((t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), "cpu")


class _GroupForward:
    """A compute-group module's ``forward`` under autocast, fp32 out, with optional gradient scaling."""

    def __init__(
        self, forward: Callable[..., Any], dtype: torch.dtype, scaler: GroupLossScaler | None
    ) -> None:
        self.forward, self.dtype, self.scaler = forward, dtype, scaler

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        scaler, grad = self.scaler, torch.is_grad_enabled()
        if scaler is not None and grad:
            args, kwargs = tree_map(
                lambda t: _ScaleGrad.apply(t, scaler, False) if _floating(t) and t.requires_grad else t,
                (args, kwargs),
            )
        with torch.autocast(device_type=_device_type(args, kwargs), dtype=self.dtype):
            out = self.forward(*args, **kwargs)
        out = tree_map(lambda t: t.float() if _floating(t) else t, out)
        if scaler is not None and grad:
            out = tree_map(
                lambda t: _ScaleGrad.apply(t, scaler, True) if _floating(t) and t.requires_grad else t, out
            )
        return out


class _FullPrecisionForward:
    """A ``forward`` with autocast off and floating inputs in fp32."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(lambda t: t.float() if _floating(t) else t, (args, kwargs))
        with torch.autocast(device_type=_device_type(args, kwargs), enabled=False):
            return self.forward(*args, **kwargs)


def _match(module: nn.Module, patterns: tuple[str, ...], taken: set[str]) -> list[tuple[str, nn.Module]]:
    found = []
    for name, m in module.named_modules():
        matched = name and any(fnmatch.fnmatchcase(name, p) for p in patterns)
        if matched and not any(name.startswith(t + ".") for t in taken):  # not inside a matched module
            found.append((name, m))
            taken.add(name)
    return found


class PrecisionHandle:
    """What :meth:`LayerwisePrecision.apply` changed; the per-group scalers; :meth:`remove` undoes it.

    Attributes:
        groups: group name -> its modules.
        full_precision: the modules forced to fp32.
        scalers: group name -> :class:`GroupLossScaler` (fp16 only; empty for bf16).
    """

    def __init__(
        self, groups: dict[str, list[nn.Module]], full: list[nn.Module], scalers: dict[str, GroupLossScaler]
    ):
        self.groups, self.full_precision, self.scalers = groups, full, scalers

    def parameters(self, group: str) -> list[nn.Parameter]:
        return [p for m in self.groups[group] for p in m.parameters() if p.requires_grad]

    def unscale_(self) -> bool:
        """Unscale every group's parameter gradients; ``True`` when all are finite (step may run).

        Reads one flag per group from the device: call once per optimizer step.
        """
        for name, scaler in self.scalers.items():
            scaler.unscale_(self.parameters(name))
        return not any(bool(s.found_inf.item()) for s in self.scalers.values())

    def update(self) -> dict[str, bool]:
        """Update every scaler; returns group -> whether it overflowed this step."""
        overflowed = {name: bool(s.found_inf.item()) for name, s in self.scalers.items()}
        for scaler in self.scalers.values():
            scaler.update()
        return overflowed

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``unscale_``, ``optimizer.step()`` unless something overflowed, ``update``; whether it stepped."""
        ok = self.unscale_()
        if ok:
            optimizer.step()
        self.update()
        return ok

    def scales(self) -> dict[str, float]:
        return {name: float(s.scale) for name, s in self.scalers.items()}

    def remove(self) -> None:
        for module in [m for ms in self.groups.values() for m in ms] + self.full_precision:
            if isinstance(module.__dict__.get("forward"), (_GroupForward, _FullPrecisionForward)):
                del module.forward
        self.groups, self.full_precision = {}, []


class LayerwisePrecision:
    """Applies a :class:`PrecisionConfig` to a module (an HF model, the drafter, a LightningModule).

    Example:
        >>> from tlt_lightning.models import load_model
        >>> model = load_model("tiny-llama").model.train()
        >>> handle = LayerwisePrecision(PrecisionConfig(compute_dtype="float16")).apply(model)
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> ids = torch.randint(3, 128, (2, 16))
        >>> model(ids, labels=ids, use_cache=False).loss.backward()  # no loss scaling: groups scale
        >>> stepped = handle.step(optimizer)  # unscale per group, skip on overflow, update scales
    """

    def __init__(self, config: PrecisionConfig | None = None) -> None:
        if config is not None and not isinstance(config, PrecisionConfig):
            raise TypeError(f"config must be a PrecisionConfig, got {type(config).__name__}")
        self.config = config or PrecisionConfig()

    def apply(self, module: nn.Module) -> PrecisionHandle:
        """Wrap the group and full-precision modules' ``forward`` (parameters and state_dict unchanged).

        Raises:
            ValueError: a group matches no module, or a module is already wrapped.
        """
        c = self.config
        taken: set[str] = set()
        full = [m for _, m in _match(module, c.full_precision, taken)]
        groups: dict[str, list[nn.Module]] = {}
        for name, patterns in c.groups.items():
            matched = [m for _, m in _match(module, patterns, taken)]
            if not matched:
                raise ValueError(
                    f"groups[{name!r}] patterns {list(patterns)} match no module of {type(module).__name__} "
                    f"(not already taken by an earlier group or full_precision)"
                )
            groups[name] = matched
        wrapped = [m for m in full + [m for ms in groups.values() for m in ms] if "forward" in m.__dict__]
        if wrapped:
            raise ValueError(
                f"{len(wrapped)} modules already have a patched forward: remove the previous handle first"
            )
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        scalers = {name: GroupLossScaler(c, device) for name in groups} if c.scaled else {}
        for m in full:
            m.forward = _FullPrecisionForward(m.forward)
        for name, ms in groups.items():
            for m in ms:
                m.forward = _GroupForward(m.forward, c.dtype, scalers.get(name))
        return PrecisionHandle(groups, full, scalers)
