"""Native CPU kernels (paged decode and prefill attention, RMSNorm, rotary, SiLU-and-mul,
greedy argmax, W8A8 INT8 linear layers through fbgemm, float32 linear layers of a few
rows (8 a pass) and bfloat16 ones of up to 16), compiled on first use with torch's C++ extension builder.

Building needs a C++ compiler and ninja; it takes about a minute once per machine
(the result is cached under ~/.cache/tokenmill, in a folder keyed by everything the
build depends on: the sources, torch's version and C++ ABI, the Python, the compiler
flags and the CPU's instruction set). The sources are copied into that folder and
built there, so checkouts with the same sources share one build instead of
rebuilding each other's. Without a compiler the torch-native code paths run
instead, and the engine says so once at start-up.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("tokenmill")

_SRC = Path(__file__).parent / "csrc"
_SOURCES = ("bindings.cpp", "attention.cpp", "decode_attention_avx2.cpp", "decode_attention_int8.cpp",
            "decode_attention_fp8.cpp", "prefill_attention.cpp", "elementwise.cpp", "sampling.cpp", "int8_linear.cpp",
            "small_linear.cpp", "small_linear_bf16.cpp", "amx_linear.cpp", "small_decode.cpp")
_HEADERS = tuple(sorted(p.name for p in _SRC.glob("*.h")))
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


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
        build_dir = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill")) / (
            f"cpu_kernels-{platform.machine()}-{_build_digest(ldflags)}")
        build_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        # an OS lock, released if this process dies (torch's own lock file, left behind by a
        # process killed mid-build, would make every later start wait forever)
        with open(build_dir / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            if not (build_dir / "tokenmill_cpu_kernels.so").exists():
                logger.info("compiling the CPU kernels (first start only, one to two minutes) in %s", build_dir)
            sources = []
            for f in _SOURCES + _HEADERS:
                dst = build_dir / "src" / f
                if not dst.exists():  # the folder is keyed by the sources: a copy there is this one
                    dst.parent.mkdir(exist_ok=True)
                    shutil.copyfile(_SRC / f, dst.with_suffix(".tmp"))
                    os.replace(dst.with_suffix(".tmp"), dst)
                if f in _SOURCES:
                    sources.append(str(dst))
            module = load(name="tokenmill_cpu_kernels", sources=sources, build_directory=str(build_dir),
                          extra_cflags=_CFLAGS, extra_ldflags=ldflags, verbose=False)
        logger.info("CPU kernels ready in %.1fs (%s)", time.perf_counter() - start, build_dir)
        return module
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, ...: fall back, loudly
        logger.warning("CPU kernels unavailable, using the torch-native path (%s: %s)",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


def _build_digest(ldflags: list[str]) -> str:
    """Everything the build depends on; -march=native code also depends on the CPU's flags."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu_flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        cpu_flags = ""
    h = hashlib.sha256()
    for part in (cpu_flags, torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI), sys.version, *_CFLAGS,
                 *ldflags):
        h.update(part.encode() + b"\0")
    for f in _SOURCES + _HEADERS:
        h.update((_SRC / f).read_bytes())
    return h.hexdigest()[:16]


if __name__ == "__main__":  # `python -m tokenmill.executor.cpu_kernels`: build now (make install does)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load_cpu_kernels()  # without a compiler it says so; the engine then runs the torch path
