"""Host memory in transparent huge pages: the KV cache's buffer (zeroed, aligned, advised for
huge pages, unmapped with its last view) and the environment of the processes tokenmill starts."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.executor.attention.kv_cache import KVCache
from tokenmill.executor.huge_pages import HUGE_PAGE, device_zeros, huge_page_env

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping(address: int) -> dict[str, str] | None:
    """The fields of the /proc/self/smaps entry whose range holds `address`; None if unmapped."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            if found is not None:
                return found
            found = {} if lo <= address < hi else None
        elif found is not None and ":" in head:
            found[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return found


def thp_mode() -> str:
    if not THP.exists():
        return "none"
    return THP.read_text().split("[")[1].split("]")[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn])
def test_device_zeros_gives_zeroed_aligned_memory_advised_for_huge_pages(dtype):
    x = device_zeros((3, 2, 70000, 2, 64), dtype, "cpu")
    assert x.shape == (3, 2, 70000, 2, 64) and x.dtype == dtype and x.is_contiguous()
    assert x.data_ptr() % HUGE_PAGE == 0
    assert not x.float().any()
    x[1, 1, 69999] = 1
    assert x.float().sum() == 2 * 64
    if thp_mode() in ("madvise", "always"):
        assert mapping(x.data_ptr())["THPeligible"] == "1"


def test_the_mapping_goes_with_its_last_view():
    x = device_zeros((HUGE_PAGE * 2,), torch.uint8, "cpu")
    address = x.data_ptr()
    view = x[100:200].view(torch.int8)
    del x
    gc.collect()
    assert mapping(address) is not None
    view.fill_(3)
    del view
    gc.collect()
    assert mapping(address) is None


def test_small_and_turned_off_allocations_are_plain_zeros(monkeypatch):
    small = device_zeros((1000,), torch.float32, "cpu")
    assert small.shape == (1000,) and not small.any()
    monkeypatch.setenv("TOKENMILL_HUGE_PAGES", "0")
    off = device_zeros((HUGE_PAGE,), torch.float32, "cpu")
    assert off.shape == (HUGE_PAGE,) and not off.any()
    if thp_mode() == "madvise":  # malloc's memory, not advised (in `always` mode all of it is eligible)
        assert mapping(off.data_ptr())["THPeligible"] == "0"


def test_a_quantized_cache_gets_zeroed_rows_and_unit_scales():
    cache = KVCache.allocate(2, 80000, 2, 64, torch.int8, torch.device("cpu"))
    assert cache.data.dtype == torch.int8 and not cache.data.any()
    assert cache.scales.dtype == torch.float32 and bool((cache.scales == 1).all())
    assert cache.data.data_ptr() % HUGE_PAGE == 0 and cache.scales.data_ptr() % HUGE_PAGE == 0


def test_started_processes_get_the_malloc_tunable(monkeypatch):
    assert huge_page_env({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "A": "b"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "A": "b"}
    assert huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
    monkeypatch.setenv("TOKENMILL_HUGE_PAGES", "0")
    assert "GLIBC_TUNABLES" not in huge_page_env({})


PROBE = """
import os, sys
from tokenmill.executor.huge_pages import reexec_with_malloc_tunable
reexec_with_malloc_tunable()
import torch
x = torch.ones(1 << 25)
huge = [line.split()[1] for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages")][0]
print(os.environ.get("GLIBC_TUNABLES"), sys.argv[1:], int(huge) > 0)
"""


@pytest.mark.parametrize("turned_off", [False, True])
def test_the_command_starts_itself_again_with_the_tunable(turned_off):
    """What `tokenmill` (cli.entry) does first: the same command line again, now with malloc's
    memory (a 128 MB tensor here) in huge pages; once only, and not when turned off."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "TOKENMILL_HUGE_PAGES")}
    if turned_off:
        env["TOKENMILL_HUGE_PAGES"] = "0"
    out = subprocess.run([sys.executable, "-c", PROBE, "serve", "--port", "1"], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    huge = thp_mode() in ("madvise", "always") and not turned_off or thp_mode() == "always"
    assert out == (["None"] if turned_off else ["glibc.malloc.hugetlb=1"]) + ["['serve',", "'--port',", "'1']",
                                                                              str(huge)]
