"""What the kernel tests share: the AVX-512 code of a CPU without BF16 dot products, built apart."""

from pathlib import Path

import pytest
import torch

from tlt_lightning.kernels import attention as module

CPUINFO = Path("/proc/cpuinfo")
AVX512_BF16 = CPUINFO.exists() and "avx512_bf16" in CPUINFO.read_text()


@pytest.fixture(scope="session")
def without_bf16_dots():
    """The AVX-512 code a CPU without BF16 dot products runs (Skylake-X, Ice Lake), built into a namespace of
    its own; where the CPU has none, the default build is that code already."""
    if not AVX512_BF16:
        yield torch.ops.tlt_lightning.decode_attention
        return
    library = torch.library.Library("tlt_lightning_test_nobf16", "DEF")
    library.define(
        "decode_attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor"
    )
    library.define("few_rows_linear(Tensor input, Tensor weight, Tensor? bias) -> Tensor")  # built with it
    library.define(
        "adamw_bf16_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, float lr, "
        "float beta1, float beta2, float weight_decay, float eps, float step, int seed) -> ()"
    )
    module.build(
        "tlt_decode_attention_test", ("-mno-avx512bf16", "-DTLT_NAMESPACE=tlt_lightning_test_nobf16")
    )
    yield torch.ops.tlt_lightning_test_nobf16.decode_attention
    del library
