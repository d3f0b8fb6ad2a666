"""Native CPU kernels, compiled on first use with torch's C++ extension builder.

Building needs a C++ compiler and ninja; it takes about a minute once per machine
(the result is cached under ~/.cache/tokenmill). Without them the torch-native
code paths run instead, and the engine says so once at start-up.
"""

from __future__ import annotations

import logging
import os
import time
from functools import cache
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("tokenmill")

_SRC = Path(__file__).parent / "csrc" / "cpu_decode_attention.cpp"


@cache
def load_cpu_kernels() -> ModuleType | None:
    if os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        # OpenMP from the same runtime torch uses (a second one would fight it for the cores)
        import torch

        gomp = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
        ldflags = [str(gomp[0])] if gomp else ["-fopenmp"]
        build_dir = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill")) / "cpu_kernels"
        build_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        module = load(name="tokenmill_cpu_kernels", sources=[str(_SRC)], build_directory=str(build_dir),
                      extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], extra_ldflags=ldflags,
                      verbose=False)
        logger.info("CPU attention kernels ready in %.1fs (%s)", time.perf_counter() - start, build_dir)
        return module
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, ...: fall back, loudly
        logger.warning("CPU attention kernels unavailable, using the torch-native path (%s: %s)",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
