"""The Triton kernels build for a GPU on a machine without one: every launch configuration the
attention backend and the layer kernels make (scripts/compile_triton_kernels.py --quick: each
code path once) compiled to a Hopper cubin by Triton's compiler and ptxas. The interpreter, which
the other kernel tests run under, accepts what the compiler refuses (a `return` inside a loop,
`tl.dot` shapes under 16, some types); a kernel that passed here and only there would fail in
a device session, whose minutes are few."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (x86-64 Linux test dependency)")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernel tests run the kernels themselves "
                                                      "(and a device session's seconds are few)")
def test_every_kernel_configuration_compiles_for_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiled kernels, not the interpreted
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # built here, not found in a cache
    proc = subprocess.run([sys.executable, "scripts/compile_triton_kernels.py", "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compiled for sm_90" in proc.stdout and "; 0 failed" in proc.stdout
    for kernel in ("_decode_attention", "_chunk_attention", "_merge_splits", "write_kv", "_rms_norm",
                   "_qk_norm_rotary", "_silu_and_mul", "_quantize_fp8_rows", "_rms_norm_fp8", "_silu_and_mul_fp8",
                   "_fp8_gemm_splits"):
        assert kernel in proc.stdout
