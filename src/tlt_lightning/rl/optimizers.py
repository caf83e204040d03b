"""The policy's optimizer (:attr:`OptimConfig.optimizer`) and its state in Lightning checkpoints.

``"adamw"`` is PyTorch's AdamW (fused on CPU and CUDA). A bfloat16 policy (``model.dtype: bfloat16``)
is updated with stochastic rounding instead (:class:`AdamWBF16`): rounded to nearest, an update smaller than
half a bf16 step is lost, and at RL learning rates most are (lr 2e-5 against weights ~0.05, whose bf16 step
is ~2.4e-4; weights ~N(0, 1) at lr 1e-4 moved by 3% of the intended amount in 50 steps of PyTorch's AdamW,
by all of it with stochastic rounding, in expectation). ``"adamw8bit"`` is torchao's ``AdamW8bit``,
whose moments are ``OptimState8bit`` tensor subclasses (8-bit codes, a scale per block, a lookup
table). ``torch.load`` cannot rebuild those with the ``map_location`` function Lightning passes, nor
under ``weights_only``: :func:`pack_optimizer_states` stores them in a checkpoint as their plain
tensors, and :func:`unpack_optimizer_states` rebuilds them before Lightning restores the optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tlt_lightning.kernels.adamw import adamw_bf16_
from tlt_lightning.rl.config import OptimConfig

__all__ = [
    "AdamWBF16",
    "build_optimizer",
    "pack_optimizer_states",
    "step_seed",
    "unpack_optimizer_states",
]

PACKED = "torchao.optim.OptimState8bit"
"""Marks an optimizer state stored as the plain tensors of an ``OptimState8bit``."""


_MASK64 = (1 << 64) - 1


def step_seed(seed: int, step: int, index: int) -> int:
    """The rounding seed of parameter ``index``'s step ``step`` under ``seed``: splitmix64's finalizer of
    the three, in ``[0, 2**63)``.

    Example:
        >>> step_seed(0, 1, 0) != step_seed(0, 2, 0) != step_seed(0, 1, 1)
        True
    """
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


class AdamWBF16(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, no amsgrad) whose bfloat16 parameters round stochastically.

    One fused pass per parameter (:func:`~tlt_lightning.kernels.adamw.adamw_bf16_`); the moments in the
    parameter's dtype. The state is torchao's ``_AdamW``'s (``step``, ``exp_avg``, ``exp_avg_sq``), so
    checkpoints of either resume with the other. The rounding bits of a parameter's step are a hash of
    ``seed``, the step and the parameter's index (:func:`step_seed`), not draws from torch's generator: DDP
    replicas, whose generators other work may move apart, round alike and stay identical, and a resumed
    run rounds as the uninterrupted one.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        >>> w.grad = torch.ones(4, dtype=torch.bfloat16)
        >>> AdamWBF16([w], lr=1e-2, weight_decay=0.0).step()  # 1 - 1e-2: between two bf16 below 1
        >>> bool((w < 1).all())
        True
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        seed: int = 0,
    ) -> None:
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"AdamWBF16 needs lr, eps, weight_decay >= 0 and betas in [0, 1): got lr={lr}, eps={eps}, "
                f"weight_decay={weight_decay}, betas={betas}"
            )
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.seed = seed

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [(group, param) for group in self.param_groups for param in group["params"]]
        for index, (group, param) in enumerate(params):
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
            state["step"] += 1
            step = int(state["step"])
            adamw_bf16_(
                param, param.grad, state["exp_avg"], state["exp_avg_sq"],
                lr=float(group["lr"]), betas=tuple(group["betas"]), weight_decay=group["weight_decay"],
                eps=group["eps"], step=float(step), seed=step_seed(self.seed, step, index),
            )  # fmt: skip
        return loss


def build_optimizer(
    params: Iterable[torch.nn.Parameter], config: OptimConfig, device: torch.device, seed: int = 0
) -> torch.optim.Optimizer:
    """The optimizer ``config.optimizer`` names over ``params``, with ``config``'s lr and weight decay;
    bfloat16 parameters are updated with stochastic rounding (module docstring), by ``seed``.

    Raises:
        ImportError: ``"adamw8bit"`` without torchao; the message says what to install.
    """
    params = list(params)
    lr, decay = config.lr, config.weight_decay
    bf16 = any(p.dtype == torch.bfloat16 for p in params)
    if config.optimizer == "adamw":
        if bf16:
            return AdamWBF16(params, lr=lr, weight_decay=decay, seed=seed)
        fused = device.type in ("cpu", "cuda")  # one kernel: faster, and no param-sized temporaries
        return torch.optim.AdamW(params, lr=lr, weight_decay=decay, fused=fused)
    try:
        from torchao.optim import AdamW8bit
    except ImportError as err:
        raise ImportError(
            "optim.optimizer='adamw8bit' needs torchao (8-bit moments): pip install "
            "'tlt-lightning[efficiency]' (or optim.optimizer='adamw')"
        ) from err
    return AdamW8bit(params, lr=lr, weight_decay=decay, bf16_stochastic_round=bf16)


def _is_8bit(value: Any) -> bool:
    return type(value).__name__ == "OptimState8bit" and hasattr(value, "__tensor_flatten__")


def pack_optimizer_states(checkpoint: dict[str, Any]) -> None:
    """Replace the ``OptimState8bit`` states in ``checkpoint["optimizer_states"]`` by their plain tensors.

    The optimizer's own state is left alone (its per-parameter dicts are copied, not changed).
    """
    for optimizer in checkpoint.get("optimizer_states", []):
        state = optimizer.get("state", {})
        for index, values in state.items():
            if any(_is_8bit(v) for v in values.values()):
                state[index] = {key: _pack(v) if _is_8bit(v) else v for key, v in values.items()}


def _pack(value: Any) -> dict[str, Any]:
    names, (signed,) = value.__tensor_flatten__()
    return {"kind": PACKED, "signed": bool(signed), **{name: getattr(value, name) for name in names}}


def unpack_optimizer_states(checkpoint: dict[str, Any]) -> None:
    """Rebuild the states :func:`pack_optimizer_states` stored (in place, before Lightning loads them).

    Raises:
        ImportError: the checkpoint holds 8-bit states and torchao is not installed.
    """
    packed = [
        (values, key)
        for optimizer in checkpoint.get("optimizer_states", [])
        for values in optimizer.get("state", {}).values()
        for key, value in values.items()
        if isinstance(value, dict) and value.get("kind") == PACKED
    ]
    if not packed:
        return
    try:
        from torchao.optim.subclass_8bit import OptimState8bit
    except ImportError as err:
        raise ImportError(
            "this checkpoint's optimizer is optim.optimizer='adamw8bit', which needs torchao: "
            "pip install 'tlt-lightning[efficiency]'"
        ) from err
    for values, key in packed:
        value = values[key]
        values[key] = OptimState8bit(value["codes"], value["scale"], value["qmap"], value["signed"])
