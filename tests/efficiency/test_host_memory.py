"""glibc's mmap threshold and malloc_trim: freed activations go back to the system."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tlt_lightning.efficiency import host_memory

needs_glibc = pytest.mark.skipif(host_memory.glibc() is None, reason="the C library is not glibc")

# 64 tensors of 1 MiB, each followed by one of 16 KiB that stays alive: freed in the heaps, the large ones
# leave holes the small ones pin (no trim at the top of a heap gives them back).
SCRIPT = """
import sys, torch
from tlt_lightning.efficiency import host_memory as hm
mode = sys.argv[1]
if mode == "threshold":
    assert hm.set_mmap_threshold(128 * 1024)
else:
    x = torch.ones(4 * 2**18); del x  # freeing a 4 MiB mapping raises glibc's adaptive threshold above 1 MiB
base = hm.rss_mb()
big, keep = [], []
for _ in range(64):
    big.append(torch.ones(2**18))
    keep.append(torch.ones(2**12))
grown = hm.rss_mb() - base
del big
if mode == "trim":
    hm.trim()
print(grown, hm.rss_mb() - base, (hm.malloc_mb() or {"free_held": float("nan")})["free_held"])
"""


def _kept_mb(mode: str) -> tuple[float, float, float]:
    """MiB the 64 tensors grew the process by, MiB resident once they are freed, MiB glibc says it keeps."""
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    grown, kept, held = map(float, out.stdout.split())
    return grown, kept, held


@needs_glibc
def test_freed_large_tensors_stay_resident_by_default_and_go_back_with_a_threshold_or_a_trim():
    grown, kept, _ = _kept_mb("default")
    assert grown >= 60 and kept >= 48  # the control: glibc keeps them
    for mode in ("threshold", "trim"):
        grown, kept, _ = _kept_mb(mode)
        assert grown >= 60 and kept <= 16, mode


@needs_glibc
def test_malloc_accounts_freed_blocks_its_heaps_keep_and_not_those_mapped_on_their_own():
    if host_memory.malloc_mb() is None:
        pytest.skip("glibc < 2.33: no mallinfo2")
    _, _, held = _kept_mb("default")
    assert held >= 48  # mallinfo2 (glibc >= 2.33): the freed tensors wait in the heaps
    _, _, held = _kept_mb("threshold")
    assert held <= 16  # each was its own mapping, unmapped when freed


@pytest.mark.parametrize("bad", [-1, 32 * 2**20 + 1, 1.5, True, "128k"])
def test_a_threshold_outside_glibcs_range_is_refused_with_a_usual_value(bad):
    with pytest.raises(ValueError, match=r"131072 \(128 KiB\)"):
        host_memory.check_mmap_threshold(bad)


def test_rss_is_measured_where_proc_exists():
    rss = host_memory.rss_mb()
    assert rss is None or rss > 10


PEAK = """
import torch
from tlt_lightning.efficiency import host_memory as hm
start = hm.peak_rss_mb()
x = torch.ones(32 * 2**20); del x  # 128 MiB, touched, freed
print(start, hm.peak_rss_mb(), hm.rss_mb())
"""


def test_the_peak_is_the_processs_own_and_holds_after_a_free():
    # This test run's process is far above the child's whole size: its peak must not carry over.
    assert host_memory.peak_rss_mb() is None or host_memory.peak_rss_mb() >= host_memory.rss_mb()
    out = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, check=True)
    start, peak, now = (float(v) if v != "None" else None for v in out.stdout.split()[-3:])
    if start is None:
        pytest.skip("no /proc/self/status here")
    assert start < 1024 and 120 <= peak - start <= 140 and now < peak - 100, (start, peak, now)


LIVE = """
import json, torch
from tlt_lightning.efficiency import host_memory as hm
kinds, blocks = hm.resident_kinds_mb(), hm.malloc_mb()
x = torch.ones(16 * 2**20)  # 64 MiB, touched
print(json.dumps([kinds, blocks, hm.resident_kinds_mb(), hm.malloc_mb()]))
"""


def test_a_live_tensor_is_anonymous_resident_memory_in_malloc_use():
    # A fresh process: in the test run's own, other threads allocate between the two readings.
    out = subprocess.run([sys.executable, "-c", LIVE], capture_output=True, text=True, check=True)
    kinds, blocks, kinds_after, blocks_after = json.loads(out.stdout.splitlines()[-1])
    if kinds is None or blocks is None:
        pytest.skip("no /proc/self/smaps_rollup or no glibc >= 2.33 here")
    grown = kinds_after["anonymous"] - kinds["anonymous"]
    used = blocks_after["in_use"] - blocks["in_use"]
    assert 60 <= grown <= 72 and 60 <= used <= 72 and kinds["file"] > 1, (grown, used, kinds)
