"""The C++ decode attention kernel equals grouped attention in fp32, in place on cache views, and
fails clearly."""

import os
import time
import warnings
from pathlib import Path

import pytest
import torch

from tlt_lightning.kernels import attention as module
from tlt_lightning.kernels import available, decode_attention
from tlt_lightning.models.attention import grouped_sdpa

pytestmark = pytest.mark.skipif(not available(), reason="the C++ kernel did not build here")


def case(
    n: int, heads: int, kv_heads: int, q: int, kv: int, dim: int, dtype: torch.dtype, slots: int | None = None
):
    """Queries, keys and values as views of a larger cache (``slots`` per row), and a mask with holes."""
    g = torch.Generator().manual_seed(n * 1000 + q * 100 + dim)
    query = torch.randn(n, heads, q, dim, generator=g).to(dtype)
    cache = torch.randn(2, n, kv_heads, slots or kv + 5, dim, generator=g).to(dtype)
    mask = torch.rand(n, 1, q, kv, generator=g) > 0.3
    mask[..., 0] = True
    return query, cache[0, :, :, :kv], cache[1, :, :, :kv], mask


@pytest.mark.parametrize(
    ("n", "heads", "kv_heads", "q", "kv", "dim", "dtype"),
    [
        (4, 9, 3, 1, 50, 64, torch.bfloat16),  # SmolLM2's heads, a decode step: the vectorised bf16 path
        (3, 9, 3, 4, 37, 64, torch.bfloat16),  # a verify forward of 4 tokens (12 queries per key/value head)
        (2, 4, 2, 3, 33, 128, torch.bfloat16),  # head dim 128 (Qwen2, Llama)
        (2, 4, 4, 2, 21, 64, torch.bfloat16),  # no grouping
        (2, 4, 2, 3, 20, 16, torch.bfloat16),  # a head dim of the plain loop
        (2, 6, 2, 3, 20, 64, torch.float32),  # fp32: the plain loop
    ],
)
def test_equals_grouped_attention_in_fp32(n, heads, kv_heads, q, kv, dim, dtype):
    query, key, value, mask = case(n, heads, kv_heads, q, kv, dim, dtype)
    assert not key.is_contiguous()  # a view of the cache, read in place
    expected = grouped_sdpa(query.float(), key.float(), value.float(), mask, scale=dim**-0.5)
    got = decode_attention(query, key, value, mask, dim**-0.5)
    assert got.shape == query.shape and got.dtype == dtype and got.is_contiguous()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(("q", "dim"), [(1, 64), (4, 64), (3, 128)])
def test_avx512_code_without_bf16_dots_equals_grouped_attention(without_bf16_dots, q, dim):
    query, key, value, mask = case(3, 6, 2, q, 45, dim, torch.bfloat16)
    expected = grouped_sdpa(query.float(), key.float(), value.float(), mask, scale=dim**-0.5)
    got = without_bf16_dots(query, key, value, mask, dim**-0.5)
    torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=1e-2)


def test_long_rows_and_masked_tails():
    """Keys past a row's length masked (what the graphs pass), lengths not multiples of 16; a permuted
    query."""
    query, key, value, mask = case(3, 9, 3, 1, 300, 64, torch.bfloat16)
    mask[:] = True
    mask[1, ..., 17:] = False
    mask[2, ..., 251:] = False
    query = (
        query.transpose(1, 2).contiguous().transpose(1, 2)
    )  # [n, q, H, D] storage, as the rotary output is
    expected = grouped_sdpa(query.float(), key.float(), value.float(), mask)
    torch.testing.assert_close(
        decode_attention(query, key, value, mask, 0.125).float(), expected, atol=1e-2, rtol=1e-2
    )


def test_a_query_that_may_attend_no_key_gets_zeros():
    query, key, value, mask = case(2, 4, 2, 2, 20, 64, torch.bfloat16)
    mask[1, :, 0] = False
    got = decode_attention(query, key, value, mask, 0.125)
    assert torch.equal(got[1, :, 0], torch.zeros_like(got[1, :, 0]))
    assert got[1, :, 1].abs().sum() > 0 and torch.isfinite(got).all()


def test_rows_run_on_several_threads_as_on_one():
    query, key, value, mask = case(8, 9, 3, 2, 70, 64, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_attention(query, key, value, mask, 0.125)
        torch.set_num_threads(2)
        assert torch.equal(decode_attention(query, key, value, mask, 0.125), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("heads", "multiple of key/value heads"),
        ("mask", "mask must be bool"),
        ("dtype", "share a dtype"),
        ("value", "key and value must be"),
    ],
)
def test_bad_inputs_raise_with_the_expected_shapes(change, message):
    query, key, value, mask = case(2, 6, 2, 1, 10, 64, torch.bfloat16)
    if change == "heads":
        query = query[:, :5]
    elif change == "mask":
        mask = mask.float()
    elif change == "dtype":
        key = key.float()
    else:
        value = value[:, :, :9]
    with pytest.raises(RuntimeError, match=message):
        decode_attention(query, key, value, mask, 0.125)


def test_a_failing_build_warns_once_and_reports_unavailable(monkeypatch):
    """No compiler (or ninja): available() is False with one warning naming the fallback, never an
    exception."""
    from torch.utils import cpp_extension

    def fail(**kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", fail)
    module.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="PyTorch's kernels instead"):
            assert not module.available()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not module.available()  # cached: no second build, no second warning
    finally:
        module.available.cache_clear()
    monkeypatch.undo()
    assert module.available()


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(monkeypatch, tmp_path):
    """torch's builder waits without a limit for its build lock: one left by a process killed mid-build
    would hang every later build (it hung CI), so build() removes a lock older than STALE_LOCK_SECONDS."""
    from torch.utils import cpp_extension

    loads = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: loads.append(kwargs))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    module.build("stale")
    lock = Path(loads[0]["build_directory"]) / "lock"
    assert lock.parent.is_relative_to(tmp_path) and lock.parent.name.startswith("stale_")

    lock.touch()  # a build running now: kept
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module.build("stale")
    assert lock.exists()

    old = time.time() - module.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="did not finish"):
        module.build("stale")
    assert not lock.exists() and len(loads) == 3
