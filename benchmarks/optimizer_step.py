"""One optimizer step over a model's parameters, by optimizer, side by side in one process.

PyTorch's fused AdamW on float32 parameters (what a float32 policy steps by), and on bf16 parameters:
:class:`~tlt_lightning.rl.optimizers.AdamWBF16` (the fused C++ step), its PyTorch reference (where the
kernels do not build), and torchao's stochastically rounding ``_AdamW`` and ``AdamW8bit`` where torchao is
installed. Each on random gradients, one untimed first step (state, compiling), then ``--steps`` timed,
in turns; seconds per step, medians.

    python -m benchmarks.optimizer_step [--model smollm2-135m] [--steps 5] [--threads 1]
        [--json runs/bench/optimizer_step.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable

import torch

from benchmarks.common import machine_info, median, write_json
from tlt_lightning.kernels import available
from tlt_lightning.kernels.adamw import adamw_bf16_reference
from tlt_lightning.models import load_model
from tlt_lightning.rl.optimizers import AdamWBF16

__all__ = ["main", "measure"]

LR = 2e-5


def _reference(params: list[torch.nn.Parameter]) -> Callable[[], None]:
    """AdamWBF16's step by its PyTorch reference."""
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    steps = [0]

    def step() -> None:
        steps[0] += 1
        for i, (p, (m, v)) in enumerate(zip(params, states, strict=True)):
            hyper = {"lr": LR, "betas": (0.9, 0.999), "weight_decay": 0.0, "eps": 1e-8}
            adamw_bf16_reference(
                p.data, p.grad, m, v, **hyper, step=float(steps[0]), seed=steps[0] * 1000 + i
            )

    return step


def _steppers(model: str) -> dict[str, Callable[[], None]]:
    """Each optimizer's ``step`` over its own copy of ``model``'s parameters, with random gradients."""
    params = {}
    for dtype in ("float32", "bfloat16"):
        params[dtype] = list(load_model(model, dtype=dtype).model.parameters())
        generator = torch.Generator().manual_seed(0)
        for p in params[dtype]:
            p.grad = (torch.randn(p.shape, generator=generator) * 1e-3).to(p.dtype)
    fp32, bf16 = params["float32"], params["bfloat16"]
    steppers = {"adamw fused, float32": torch.optim.AdamW(fp32, lr=LR, weight_decay=0.0, fused=True).step}
    if available():
        steppers["AdamWBF16 kernel, bfloat16"] = AdamWBF16(bf16, lr=LR, weight_decay=0.0).step
    steppers["AdamWBF16 reference, bfloat16"] = _reference(bf16)
    if importlib.util.find_spec("torchao") is not None:
        from torchao.optim import AdamW8bit, _AdamW

        steppers["torchao _AdamW, bfloat16"] = _AdamW(bf16, lr=LR, bf16_stochastic_round=True).step
        steppers["torchao AdamW8bit, bfloat16"] = AdamW8bit(bf16, lr=LR, bf16_stochastic_round=True).step
    return steppers


def measure(model: str, steps: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Seconds of each optimizer's first step, and of its ``steps`` later ones (in turns)."""
    steppers = _steppers(model)
    first, seconds = {}, {name: [] for name in steppers}
    for name, step in steppers.items():
        start = time.perf_counter()
        step()
        first[name] = time.perf_counter() - start
    for _ in range(steps):
        for name, step in steppers.items():
            start = time.perf_counter()
            step()
            seconds[name].append(time.perf_counter() - start)
    return first, seconds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="registry name or a local HF directory")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per optimizer")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="runs/bench/optimizer_step.json")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    torch.set_num_threads(args.threads)
    first, seconds = measure(args.model, args.steps)
    medians = {name: median(values) for name, values in seconds.items()}
    payload = {
        "benchmark": "optimizer_step",
        "command": "python -m benchmarks.optimizer_step " + " ".join(argv if argv is not None else []),
        "model": args.model,
        "machine": machine_info(),
        "first_step_s": first,
        "step_s": seconds,
        "median_step_s": medians,
    }
    write_json(args.json, payload)
    for name, value in medians.items():
        print(f"[optimizer_step] {name}: {value:.3f} s a step (first {first[name]:.2f} s)", flush=True)
    return payload


if __name__ == "__main__":
    main()
