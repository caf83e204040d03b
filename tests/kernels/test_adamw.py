"""The fused bf16 AdamW step: AdamW's values (PyTorch's, in fp32), rounded stochastically without bias, the
same on any number of threads; its PyTorch reference the same values."""

import pytest
import torch

from tlt_lightning.kernels import available
from tlt_lightning.kernels.adamw import adamw_bf16_, adamw_bf16_reference, random_bits

HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.1, "eps": 1e-8}


def tensors(numel: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """A parameter, its gradient and moments as two earlier steps might have left them."""
    g = torch.Generator().manual_seed(seed)
    param, grad, exp_avg = (torch.randn(numel, generator=g) * s for s in (0.05, 1e-2, 1e-3))
    exp_avg_sq = torch.rand(numel, generator=g) * 1e-4
    return [t.to(dtype) for t in (param, grad, exp_avg, exp_avg_sq)]


def strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view with a stride of 2, which the kernel does not take: the reference runs."""
    view = t.new_empty(2 * t.numel())[::2]
    view.copy_(t)
    assert not view.is_contiguous()
    return view


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart the elements of two bf16 tensors of one sign are."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.skipif(not available(), reason="the C++ kernels did not build here")
@pytest.mark.parametrize("numel", [1, 37, 4096 + 13, (1 << 16) * 3 + 5])  # vector tails, several chunks
def test_the_kernel_takes_the_references_step(numel):
    fused, reference = tensors(numel), tensors(numel)
    adamw_bf16_(*fused, **HYPER, step=3.0, seed=12345)
    adamw_bf16_reference(*reference, **HYPER, step=3.0, seed=12345)
    for got, expected in zip(fused, reference, strict=True):
        apart = ulps_apart(got, expected)
        # The same rounding bits: only the order of fp32 operations (fused multiply-adds) differs.
        assert int(apart.max()) <= 1 and float((apart == 0).float().mean()) > 0.99


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_reference_is_pytorchs_adamw_in_fp32(weight_decay):
    """In fp32 (no stochastic rounding) the reference's steps are ``torch.optim.AdamW``'s."""
    param, grad, _, _ = tensors(1000, dtype=torch.float32)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    weight = torch.nn.Parameter(param.clone())
    adamw = torch.optim.AdamW([weight], lr=1e-3, weight_decay=weight_decay)
    hyper = {**HYPER, "weight_decay": weight_decay}
    for step in (1, 2, 3):
        weight.grad = grad * step
        adamw.step()
        adamw_bf16_reference(param, grad * step, exp_avg, exp_avg_sq, **hyper, step=float(step), seed=step)
    assert not torch.equal(param, tensors(1000, dtype=torch.float32)[0])
    torch.testing.assert_close(param, weight.detach(), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(exp_avg, adamw.state[weight]["exp_avg"], rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(exp_avg_sq, adamw.state[weight]["exp_avg_sq"], rtol=1e-6, atol=1e-14)


@pytest.mark.parametrize("fused", [True, False])
def test_updates_below_a_bf16_step_are_kept_in_expectation(fused):
    """1.0 less 1e-3 (a quarter of the bf16 step below 1): rounded to nearest every weight stays 1.0."""
    if fused and not available():
        pytest.skip("the C++ kernels did not build here")
    n = 100_000
    param, grad = torch.ones(n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    hyper = {**HYPER, "weight_decay": 0.0, "step": 1.0, "seed": 7}  # Adam's first step: lr * sign(grad)
    if not fused:
        param = strided(param)
    adamw_bf16_(param, grad, exp_avg, exp_avg_sq, **hyper)
    values = set(param.float().unique().tolist())
    assert values == {1.0, 1.0 - 2**-8}  # the two bf16 neighbours of 0.999
    # Per element std 2**-8 * sqrt(p(1 - p)) ~ 1.7e-3 for p = 0.256: the mean's std ~5.4e-6.
    assert float(param.float().mean()) == pytest.approx(1.0 - 1e-3, abs=3e-5)


@pytest.mark.skipif(not available(), reason="the C++ kernels did not build here")
def test_the_seed_alone_picks_the_rounding_on_any_number_of_threads():
    threads = torch.get_num_threads()
    results = []
    try:
        for n_threads, seed in ((1, 5), (2, 5), (1, 6)):
            torch.set_num_threads(n_threads)
            state = tensors((1 << 16) * 4)  # four chunks: split between the threads
            adamw_bf16_(*state, **HYPER, step=1.0, seed=seed)
            results.append(state[0])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0].view(torch.int16), results[1].view(torch.int16))
    assert not torch.equal(results[0], results[2])


@pytest.mark.parametrize("fused", [True, False])
def test_a_step_bumps_the_version_counters_as_in_place_ops_do(fused):
    """Packed weight copies and a tied head's copy are refreshed when the weight's version changes."""
    param, grad, exp_avg, exp_avg_sq = tensors(64)
    if not fused:
        param = strided(param)
    before = [t._version for t in (param, exp_avg, exp_avg_sq)]
    adamw_bf16_(param, grad, exp_avg, exp_avg_sq, **HYPER, step=1.0, seed=0)
    assert all(t._version > v for t, v in zip((param, exp_avg, exp_avg_sq), before, strict=True))


def test_random_bits_are_uniform_and_differ_by_seed():
    bits = random_bits(1 << 16, seed=3)
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**32
    top = bits >> 16  # what rounding uses: each 16-bit value about once
    assert float(top.float().mean()) == pytest.approx(2**15, rel=0.01)
    assert top.unique().numel() > 0.6 * (1 << 16)  # ~1 - 1/e of the values for uniform draws
    assert not torch.equal(bits, random_bits(1 << 16, seed=3 + (1 << 32)))  # the seed's high half counts
