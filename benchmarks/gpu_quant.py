"""The FP8 sections of gpu_throughput.py (`--only fp8,fp8_quality,fp8_8b`; their descriptions
are there): FP8 W8A8 and the fp8 KV cache against bf16 with CUDA graphs, FP8's quality on
the built-in model, and FP8 on the Llama-3-8B shape where the weights are most of a step's
bytes. Each function takes the script's Bench."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fp8(bench) -> None:
    if not bench.cuda:
        bench.rows.append(("FP8 W8A8", "skipped: no CUDA device", ""))
        return
    base = bench.results.get("tokenmill_graphs") or bench.throughput("tokenmill_graphs", bench.shape)
    fp8 = bench.throughput("tokenmill_fp8", bench.shape, quantization="fp8")
    bench.rows.append(("FP8 W8A8 (graphs): output tok/s, vs bf16", _versus(fp8, base), ">= 1.4x (H100)"))
    kv = bench.throughput("tokenmill_kv_fp8", bench.shape, kv_cache_dtype="fp8")
    bench.rows.append(("fp8 KV cache (graphs): output tok/s, vs bf16", _versus(kv, base), ""))
    # both, as vLLM users run FP8 (--quantization fp8 --kv-cache-dtype fp8): on this workload K/V
    # are most of a step's bytes, the weights 7.5%
    both = bench.throughput("tokenmill_fp8_kv_fp8", bench.shape, quantization="fp8", kv_cache_dtype="fp8")
    bench.rows.append(("FP8 W8A8 + fp8 KV cache (graphs): output tok/s, vs bf16", _versus(both, base), ""))


def fp8_8b(bench) -> None:
    """FP8 weights where they are most of what a step reads: the Llama-3-8B shape with
    fewer requests (16 GB of bf16 weights; 64 requests' K/V are a few GB)."""
    if not bench.cuda:
        bench.rows.append(("FP8 W8A8, Llama-3-8B shape", "skipped: no CUDA device", ""))
        return
    n = bench.args.fp8_8b_requests
    base = bench.throughput("llama3_8b_bf16_fewer", bench.big_shape, num_requests=n)
    fp8 = bench.throughput("llama3_8b_fp8_fewer", bench.big_shape, num_requests=n, quantization="fp8")
    bench.rows.append((f"FP8 W8A8, Llama-3-8B shape, {n} requests: tok/s, vs bf16", _versus(fp8, base), ""))
    # the same with decode-sized steps through triton_fp8_gemm (opt-in, read when the weights are packed)
    os.environ["TOKENMILL_FP8_GEMM"] = "triton"
    try:
        small = bench.throughput("llama3_8b_fp8_triton_gemm_fewer", bench.big_shape, num_requests=n,
                                 quantization="fp8")
    finally:
        del os.environ["TOKENMILL_FP8_GEMM"]
    bench.rows.append(("  same, steps of <= 64 rows through triton_fp8_gemm: vs bf16", _versus(small, base), ""))


def fp8_quality(bench) -> None:
    if not bench.cuda:
        bench.rows.append(("FP8 quality", "skipped: no CUDA device", ""))
        return
    out = bench.out / "quant_quality.json"
    cmd = [sys.executable, "benchmarks/quant_quality.py", "--schemes", "fp8", "--output-json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    (bench.out / "quant_quality.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode == 0:
        q = json.loads(out.read_text())["fp8"]
        bench.results["fp8_quality"] = q
        bench.rows.append(("FP8 perplexity change / greedy agreement / ast vs bf16",
                           f"{q['perplexity_change']:+.2%} / {q['agreement']:.3f} / {q['ast']:.3f}", ""))
    else:
        bench.rows.append(("FP8 quality", f"failed (rc {proc.returncode}; quant_quality.log)", ""))


def _versus(run: dict, base: dict) -> str:
    """tok/s, the ratio to the base run, and the ratio of the bytes an average step reads in
    the two: what a change of bytes gains a step bound by memory (FP8's faster tensor cores
    can add to it only where a step is bound by its GEMMs)."""
    fewer = base["bytes_per_step"]["total"] / run["bytes_per_step"]["total"]
    return (f"{run['output_throughput']:,.0f}, {run['output_throughput'] / base['output_throughput']:.2f}x "
            f"(bytes a step: {base['bytes_per_step']['total'] / 1e9:.2f} -> {run['bytes_per_step']['total'] / 1e9:.2f}"
            f" GB, {fewer:.2f}x fewer)")
