"""Native CPU kernels (paged decode and prefill attention, RMSNorm, rotary, SiLU-and-mul,
greedy argmax), compiled on first use with torch's C++ extension builder.

Building needs a C++ compiler and ninja; it takes about a minute once per machine
(the result is cached under ~/.cache/tokenmill). Without them the torch-native
code paths run instead, and the engine says so once at start-up.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("tokenmill")

_SRC = Path(__file__).parent / "csrc"


def kernels_for(x: torch.Tensor) -> ModuleType | None:
    """The kernels if x lives on the CPU and they are built, else None (use torch ops)."""
    return load_cpu_kernels() if x.is_cpu else None


@cache
def load_cpu_kernels() -> ModuleType | None:
    if os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        # OpenMP from the same runtime torch uses (a second one would fight it for the cores)
        gomp = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
        ldflags = [str(gomp[0])] if gomp else ["-fopenmp"]
        # -march=native code: one build folder per instruction set, in case the cache is shared
        build_dir = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill")) / (
            f"cpu_kernels-{platform.machine()}-{_cpu_flags_digest()}")
        build_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        sources = [str(_SRC / f) for f in ("bindings.cpp", "attention.cpp", "prefill_attention.cpp", "elementwise.cpp",
                                           "sampling.cpp")]
        module = load(name="tokenmill_cpu_kernels", sources=sources, build_directory=str(build_dir),
                      extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], extra_ldflags=ldflags,
                      verbose=False)
        logger.info("CPU kernels ready in %.1fs (%s)", time.perf_counter() - start, build_dir)
        return module
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, ...: fall back, loudly
        logger.warning("CPU kernels unavailable, using the torch-native path (%s: %s)",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


def _cpu_flags_digest() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:10]
