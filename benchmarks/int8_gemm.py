"""INT8 GEMM candidates for W8A8 linear layers on this CPU, on the engine's shapes: the
measurement behind executor/layers/quantization/int8.py.

    python benchmarks/int8_gemm.py [--rows 1,4,16,64,256] [--output-json FILE]

y = x W^T with x [rows, K] in the engine's dtype and W [N, K] int8 per output channel
(symmetric); x is quantized per token (symmetric int8) inside every timed call, as the
engine does, and y comes back in x's dtype:

    dense       the engine's float layer (layers/linear.py: oneDNN's packed layout, and small_linear's
                copy for small steps; on a CPU without AVX-512 small_linear's copy alone) in the engine's
                dtype (bf16 where the CPU has it, else fp32): the baseline
    amx         the engine's W8A8 layer on CPUs with AMX, for inputs a multiple of 64: csrc/amx_linear.cpp's
                amx_int8_linear (rows quantized, the int8 tile dot products, the rescale, in one op) up to
                256 rows (fbgemm above here; the engine takes oneDNN there)
    direct      the engine's W8A8 layer with its native kernel (csrc/int8_linear.cpp) on fbgemm: fbgemm's
                packed GEMM called directly, one column part per thread, per-token quantization
                and rescale in the same op
    fbgemm_op   the same layer through torch's quantized op (the engine without native kernels):
                rows scaled to the int8 range, then quantized::linear_with_input_q_dq_qweight_dq_output_fp32
    onednn      the engine's W8A8 layer through oneDNN (the path it takes past `onednn_rows` on CPUs
                with AMX): rows quantized by the native kernels, torch.ops.onednn.qlinear_pointwise
                on a prepacked weight with scale 1, the float32 output rescaled per row
    int_mm      torch._int_mm (int8 x int8 -> int32), then the two rescales
    fbgemm      quantized::linear_dynamic: fbgemm with its own per-TENSOR activation scale
                (for reference: coarser than per-token)
    w8a16       torch._weight_int8pack_mm: int8 weights, activations left in 16/32-bit
                (the weight-only scheme)

Shapes (K -> N): the 56M benchmark model (hidden 512) and the wide model of the
quantization issue (hidden 2048, intermediate 5632), plus 4096 -> 4096.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from tokenmill.executor.cpu_kernels import load_cpu_kernels
from tokenmill.executor.layers.linear import Linear
from tokenmill.executor.layers.quantization.int8 import Int8LinearMethod
from tokenmill.executor.loader import choose_dtype

SHAPES = {
    "56m qkv": (512, 1024), "56m o": (512, 512), "56m gate_up": (512, 2816), "56m down": (1408, 512),
    "wide qkv": (2048, 4096), "wide o": (2048, 2048), "wide gate_up": (2048, 11264), "wide down": (5632, 2048),
    "4096": (4096, 4096),
}


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (q, scale) with x ~ q * scale."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-8) / 127.0
    q = torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def candidates(w: torch.Tensor, dtype: torch.dtype) -> dict:
    """name -> f(x) for one weight [N, K] (float32 master copy)."""
    qw, sw = quantize_rows(w)  # per output channel
    sw = sw.squeeze(1)
    def layer(method: Int8LinearMethod | None) -> Linear:
        lin = Linear(w.shape[1], w.shape[0], quant_method=method)
        lin.weight.data = w.to(dtype)
        lin.pack()
        if method is not None and method.onednn and not method.amx:
            lin.onednn_rows = 1  # every step through oneDNN
        return lin

    out = {"dense": layer(None)}
    kernels = load_cpu_kernels()
    if kernels is not None and hasattr(kernels, "int8_linear"):
        if Int8LinearMethod(kernels, onednn=False, amx=True).amx and w.shape[1] % 64 == 0:
            out["amx"] = layer(Int8LinearMethod(kernels, onednn=False, amx=True))
        out["direct"] = layer(Int8LinearMethod(kernels, onednn=False, amx=False))
        if Int8LinearMethod(kernels, onednn=True, amx=False).onednn:
            out["onednn"] = layer(Int8LinearMethod(kernels, onednn=True, amx=False))
    if "fbgemm" in torch.backends.quantized.supported_engines:
        out["fbgemm_op"] = layer(Int8LinearMethod(None))

    qw_t = qw.t().contiguous()

    def int_mm(x):
        q, s = quantize_rows(x)
        return (torch._int_mm(q, qw_t).float() * s * sw).to(x.dtype)

    out["int_mm"] = int_mm
    if "fbgemm" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "fbgemm"
        qweight = torch.quantize_per_channel(w, sw.double(), torch.zeros(len(sw), dtype=torch.int64), 0, torch.qint8)
        fb = torch.ops.quantized.linear_prepack(qweight, None)
        out["fbgemm"] = lambda x: torch.ops.quantized.linear_dynamic(x.float(), fb).to(x.dtype)
    sw_dtype = sw.to(dtype)
    out["w8a16"] = lambda x: torch._weight_int8pack_mm(x, qw, sw_dtype)
    return out


def time_call(fn, x, min_time: float = 0.2) -> float:
    for _ in range(3):
        fn(x)
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_time or len(times) < 5:
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16, 64, 256])
    parser.add_argument("--shapes", type=lambda s: s.split(","), default=list(SHAPES))
    parser.add_argument("--output-json", default="bench_results/int8_gemm.json")
    args = parser.parse_args()
    dtype = choose_dtype("auto", torch.device("cpu"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, engine dtype {dtype}; "
          "times in microseconds, speed-up over dense in brackets")
    results = []
    gen = torch.Generator().manual_seed(0)
    for name in args.shapes:
        k, n = SHAPES[name]
        w = torch.randn(n, k, generator=gen) * 0.02
        fns = candidates(w, dtype)
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen).to(dtype)
            ref = F.linear(x.float(), w)
            row = {"shape": name, "K": k, "N": n, "rows": rows}
            for cand, fn in fns.items():
                err = ((fn(x).float() - ref).norm() / ref.norm()).item()
                row[cand] = {"us": time_call(fn, x) * 1e6, "rel_error": err}
            results.append(row)
            dense = row["dense"]["us"]
            print(f"{name:13s} {k:5d}->{n:5d} rows {rows:4d}: " + "  ".join(
                f"{c} {row[c]['us']:8.1f} ({dense / row[c]['us']:4.2f}x, err {row[c]['rel_error']:.1e})"
                for c in fns), flush=True)
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
