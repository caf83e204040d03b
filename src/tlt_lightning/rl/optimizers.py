"""The policy's optimizer (:attr:`OptimConfig.optimizer`) and its state in Lightning checkpoints.

``"adamw"`` is PyTorch's AdamW (fused on CPU and CUDA). A bfloat16 policy (``model.dtype: bfloat16``)
is updated with stochastic rounding instead (torchao's AdamW): rounded to nearest, an update smaller than
half a bf16 step is lost, and at RL learning rates most are (lr 2e-5 against weights ~0.05, whose bf16 step
is ~2.4e-4; weights ~N(0, 1) at lr 1e-4 moved by 3% of the intended amount in 50 steps of PyTorch's AdamW,
by all of it with stochastic rounding, in expectation). ``"adamw8bit"`` is torchao's ``AdamW8bit``,
whose moments are ``OptimState8bit`` tensor subclasses (8-bit codes, a scale per block, a lookup
table). ``torch.load`` cannot rebuild those with the ``map_location`` function Lightning passes, nor
under ``weights_only``: :func:`pack_optimizer_states` stores them in a checkpoint as their plain
tensors, and :func:`unpack_optimizer_states` rebuilds them before Lightning restores the optimizer.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from tlt_lightning.models.hardware import resolve_dtype
from tlt_lightning.rl.config import OptimConfig

__all__ = ["build_optimizer", "pack_optimizer_states", "policy_dtype", "unpack_optimizer_states"]

PACKED = "torchao.optim.OptimState8bit"
"""Marks an optimizer state stored as the plain tensors of an ``OptimState8bit``."""


def policy_dtype(name: str, device: torch.device | str = "cpu") -> str:
    """The policy's dtype for ``GRPOModule(dtype=name)``: ``"auto"`` is bfloat16 where ``device`` multiplies
    it natively and torchao (stochastic rounding) is installed, else float32, with a warning naming the
    extra; other names as given.

    Example:
        >>> policy_dtype("float32")
        'float32'
    """
    dtype = resolve_dtype(name, device)
    if name == "auto" and dtype == "bfloat16" and importlib.util.find_spec("torchao") is None:
        rank_zero_warn(
            "dtype='auto' trains the policy in float32 here: a bfloat16 policy (faster and half the memory "
            "where bf16 is native) is updated with torchao's stochastic rounding: pip install "
            "'tlt-lightning[efficiency]'"
        )
        return "float32"
    return dtype


def build_optimizer(
    params: Iterable[torch.nn.Parameter], config: OptimConfig, device: torch.device
) -> torch.optim.Optimizer:
    """The optimizer ``config.optimizer`` names over ``params``, with ``config``'s lr and weight decay;
    bfloat16 parameters are updated with stochastic rounding (module docstring).

    Raises:
        ImportError: ``"adamw8bit"``, or bfloat16 parameters, without torchao; the message says what to
            install.
    """
    params = list(params)
    lr, decay = config.lr, config.weight_decay
    bf16 = any(p.dtype == torch.bfloat16 for p in params)
    if config.optimizer == "adamw" and not bf16:
        fused = device.type in ("cpu", "cuda")  # one kernel: faster, and no param-sized temporaries
        return torch.optim.AdamW(params, lr=lr, weight_decay=decay, fused=fused)
    try:
        from torchao.optim import AdamW8bit, _AdamW
    except ImportError as err:
        need, instead = (
            ("optim.optimizer='adamw8bit'", "optim.optimizer='adamw'")
            if config.optimizer == "adamw8bit"
            else ("a bfloat16 policy", "model.dtype='float32' (rounded to nearest, bf16 loses most updates)")
        )
        raise ImportError(
            f"{need} needs torchao (stochastic rounding, 8-bit moments): pip install "
            f"'tlt-lightning[efficiency]' (or {instead})"
        ) from err
    if config.optimizer == "adamw8bit":
        return AdamW8bit(params, lr=lr, weight_decay=decay, bf16_stochastic_round=bf16)
    return _AdamW(params, lr=lr, weight_decay=decay, bf16_stochastic_round=True)


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
