"""The C++ few-rows product equals F.linear summed in fp32 and rounded once, on every path."""

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.conftest import AVX512_BF16
from tlt_lightning.kernels import FEW_ROWS, available, few_rows_linear

pytestmark = pytest.mark.skipif(not available(), reason="the C++ kernels did not build here")


def case(shape: tuple[int, ...], out: int, bias: bool, dtype: torch.dtype):
    g = torch.Generator().manual_seed(sum(shape) * 7 + out)
    x = torch.randn(*shape, generator=g).to(dtype)
    w = (torch.randn(out, shape[-1], generator=g) * 0.05).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize(
    ("shape", "out", "bias", "dtype"),
    [
        ((1, 576), 576, False, torch.bfloat16),  # one token: the vectorised bf16 path
        ((1, 3, 576), 1536, True, torch.bfloat16),  # a chain-2 verify of one row, [n, q, K]
        ((5, 1536), 578, False, torch.bfloat16),  # N not a multiple of the tile: the rest by the loop
        ((FEW_ROWS, 64), 192, True, torch.bfloat16),  # the most rows the graphs give it
        ((2, 96), 40, False, torch.bfloat16),  # K an odd number of 32-element blocks
        ((3, 40), 7, True, torch.bfloat16),  # K not a multiple of 32: the plain loop
        ((4, 96), 33, True, torch.float32),  # fp32: the plain loop
    ],
)
def test_equals_linear_in_fp32_rounded_once(shape, out, bias, dtype):
    x, w, b = case(shape, out, bias, dtype)
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = few_rows_linear(x, w, b)
    assert got.shape == (*shape[:-1], out) and got.dtype == dtype
    # The one rounding of the output is all that differs (sums in fp32, in another order).
    torch.testing.assert_close(
        got.float(), expected, atol=1e-5, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5
    )
    if dtype == torch.bfloat16:  # no further from the exact sums than oneDNN's bf16 product
        onednn = (F.linear(x, w, b).float() - expected).abs().max()
        assert (got.float() - expected).abs().max() <= onednn * 1.01


@pytest.mark.skipif(
    not AVX512_BF16, reason="without AVX-512 BF16 the default build is the plain loop already"
)
def test_the_plain_loop_of_a_cpu_without_bf16_dots_agrees(without_bf16_dots):  # noqa: ARG001 - builds the variant
    x, w, b = case((3, 576), 256, True, torch.bfloat16)
    loop = torch.ops.tlt_lightning_test_nobf16.few_rows_linear(x, w, b)
    torch.testing.assert_close(loop.float(), few_rows_linear(x, w, b).float(), atol=1e-5, rtol=1e-2)


def test_refuses_mismatched_shapes_and_dtypes():
    with pytest.raises(RuntimeError, match="weight \\[N, K\\]"):
        few_rows_linear(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="one dtype"):
        few_rows_linear(torch.randn(2, 8), torch.randn(4, 8).bfloat16())
