"""Host memory in 2 MB transparent huge pages (THP), where Linux gives them.

With 4 KB pages every block of the paged KV cache that decode attention reads sits on a page
of its own, a TLB miss each (and on a virtual machine a two-level page walk): at 32 requests
of 1024 tokens the CPU decode kernel ran 1.2x faster with the cache in huge pages
(`benchmarks/kv_cache_attention.py`). Two ways in:
- `device_zeros`: the KV cache is mapped here and advised MADV_HUGEPAGE, in any process (THP
  in `madvise` or `always` mode: most distributions' default).
- `huge_page_env`: the processes tokenmill starts (the engine core, tensor-parallel workers,
  and the `tokenmill` command, which starts itself again with it) get glibc's
  `glibc.malloc.hugetlb=1` tunable, so that malloc advises huge pages for all it maps: weights
  (oneDNN's packed copies too, which live outside torch's storage) and activations. glibc
  reads it at start-up only: an engine in a Python program's own process (`LLM`) gets it
  when the program is started with GLIBC_TUNABLES=glibc.malloc.hugetlb=1. The 56M benchmark
  model decoded 64 requests 1.14x faster with it (KV cache in huge pages on both sides).
TOKENMILL_HUGE_PAGES=0 turns both off.
"""

from __future__ import annotations

import math
import mmap
import os
import sys

import torch

HUGE_PAGE = 2 << 20
MALLOC_TUNABLE = "glibc.malloc.hugetlb"


def enabled() -> bool:
    return os.environ.get("TOKENMILL_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def device_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros, but on the CPU in memory advised for huge pages. The pages are written
    here, so the memory is taken now, as torch.zeros takes it."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or not enabled():
        return torch.zeros(shape, dtype=dtype, device=device)
    # private: a shared anonymous map is shmem, whose huge pages a separate setting governs
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # holds buf; unmapped with the last view
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, start, nbytes - nbytes % HUGE_PAGE)
    except OSError:  # a kernel built without THP: 4 KB pages, the same memory
        pass
    return whole[start:start + nbytes].view(dtype).view(shape).zero_()


def huge_page_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a process tokenmill starts: `env` (default os.environ) with
    glibc.malloc.hugetlb=1 added to GLIBC_TUNABLES, unless it names that tunable already."""
    env = dict(os.environ if env is None else env)
    tunables = env.get("GLIBC_TUNABLES", "")
    if enabled() and MALLOC_TUNABLE not in tunables:
        env["GLIBC_TUNABLES"] = ":".join(filter(None, [tunables, f"{MALLOC_TUNABLE}=1"]))
    return env


def reexec_with_malloc_tunable() -> None:
    """Runs this process's command line again with huge_page_env() if it lacks the malloc
    tunable (glibc reads it at start-up only): for the `tokenmill` command, whose generate, bench
    and --engine-in-thread serve hold the engine in their own process. Returns if it has it."""
    env = huge_page_env()
    if env.get("GLIBC_TUNABLES") != os.environ.get("GLIBC_TUNABLES"):
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
