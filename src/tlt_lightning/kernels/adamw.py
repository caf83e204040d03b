"""One AdamW step of a bfloat16 parameter with stochastic rounding, fused (C++, built with the decode
attention).

A bf16 policy is updated with stochastic rounding (:class:`~tlt_lightning.rl.optimizers.AdamWBF16`): in fp32,
the moments stored in bf16, the parameter rounded away from zero with the probability of its distance from
the bf16 next to it toward zero (in bf16 steps). torchao's ``_AdamW`` computes this by a graph compiled per
parameter shape and spent 1.7-2.0 s a step on SmolLM2-135M (one Xeon core); :func:`adamw_bf16_` reads each
parameter, gradient and moment once and writes them once, with no temporaries. The random bits are a hash
of each element's index and a seed (:func:`random_bits`): the same seed gives the same parameters, on any
number of threads. :func:`adamw_bf16_reference` is the same step in PyTorch's operations (where the
kernels did not build).
"""

from __future__ import annotations

import torch

from tlt_lightning.kernels.attention import _LIBRARY, available

__all__ = ["adamw_bf16_", "adamw_bf16_reference", "random_bits"]

_LIBRARY.define(
    "adamw_bf16_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, float lr, "
    "float beta1, float beta2, float weight_decay, float eps, float step, int seed) -> ()"
)

_LOW32 = 0xFFFFFFFF


def _mix(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on uint32 values held in int64 (the products wrap; their low 32 bits are
    exact)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _LOW32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _LOW32
    return h ^ (h >> 16)


def random_bits(numel: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The kernel's 32 random bits of elements ``0 .. numel - 1`` under ``seed``: ``[numel]`` int64 in
    ``[0, 2**32)``, on ``device``."""
    low, high = seed & _LOW32, (seed >> 32) & _LOW32
    index = torch.arange(numel, dtype=torch.int64, device=device) & _LOW32
    return _mix((_mix(index ^ low) + high) & _LOW32)


def adamw_bf16_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    eps: float,
    step: float,
    seed: int,
) -> None:
    """:func:`adamw_bf16_` in PyTorch's operations, for parameters and moments of any dtype: a bf16
    parameter rounds stochastically (by :func:`random_bits`), any other as ``copy_`` rounds; in place."""
    beta1, beta2 = betas
    g = grad.float()
    m = torch.lerp(exp_avg.float(), g, 1 - beta1)
    v = torch.lerp(exp_avg_sq.float(), g * g, 1 - beta2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    denom = v.sqrt() / (1 - beta2**step) ** 0.5 + eps
    new = param.float() * (1 - lr * weight_decay) - lr / (1 - beta1**step) * m / denom
    if param.dtype == torch.bfloat16:
        random = random_bits(new.numel(), seed, new.device).view(new.shape)
        bits = new.view(torch.int32).to(torch.int64) + (random >> 16)
        new = (bits >> 16 << 16).to(torch.int32).view(torch.float32)  # the low half is zero: exact in bf16
    param.copy_(new)


def adamw_bf16_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    eps: float,
    step: float,
    seed: int,
) -> None:
    """One decoupled-weight-decay Adam step (``torch.optim.AdamW``'s, without amsgrad), in place.

    Args:
        param, grad, exp_avg, exp_avg_sq: tensors of one shape; the moments as the step left them
            (zeros before the first).
        lr, betas, weight_decay, eps: AdamW's hyper-parameters.
        step: the step's number, from 1 (bias correction).
        seed: picks the random bits of the stochastic rounding (``[0, 2**63)``).

    The fused kernel where all four are contiguous bf16 CPU tensors and the kernels built, else
    :func:`adamw_bf16_reference` (the same values up to the order of fp32 operations).
    """
    tensors = (param, grad, exp_avg, exp_avg_sq)
    fused = all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)
    if fused and available():
        beta1, beta2 = betas
        torch.ops.tlt_lightning.adamw_bf16_(*tensors, lr, beta1, beta2, weight_decay, eps, step, seed)
        # The op writes through data pointers: bump the version counters as an in-place op would, so
        # that what is keyed on them (packed weight copies, a tied head's copy) sees the new values.
        torch.autograd.graph.increment_version((param, exp_avg, exp_avg_sq))
        return
    hyper = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "eps": eps, "step": step, "seed": seed}
    adamw_bf16_reference(*tensors, **hyper)
