"""FP8 W8A8 GEMM in Triton for decode-sized steps (up to SMALL_M rows), split along N and K.

Why: on an H200 (2026-11-28) `torch._scaled_mm` with row-wise scales ran every FP8 layer
through one cuBLASLt kernel with 128x128 tiles at batch 1, 64 and 256 alike, so a decode
step's layer of N outputs got N/128 blocks (32 for Llama-3-8B's attention output, on 132
multiprocessors): the Llama-3-8B shape ran FP8 at 1.00x bf16 with 1.56x fewer bytes a step.
Here a step of M <= SMALL_M rows gets BLOCK_N-wide column blocks, and the K range is split
until there are about two programs per multiprocessor; each split's float32 sums go to a
buffer and a second launch adds them, scales them by the rows' and the columns' scales,
adds the bias and rounds to the output dtype.

The operands are the same fp8 codes `torch._scaled_mm` multiplies (x quantized per token by
`quantize_fp8_rows`, the weight per channel): they widen exactly to float16 for the dot
(float32 sums), so the products are the same and only the order of the sums differs.

Opt-in until a device session has timed it against `_scaled_mm`: `TOKENMILL_FP8_GEMM=triton`
(read when the layer's weights are packed). Tested on the CPU under Triton's interpreter
(tests/kernels/test_triton_layers.py), where the dot runs in float32.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SMALL_M = 64  # rows up to which the layer takes this GEMM
BLOCK_N = 64
BLOCK_K = 128
PROGRAMS_PER_SM = 2


def enabled() -> bool:
    return os.environ.get("TOKENMILL_FP8_GEMM", "cublas") == "triton"


@triton.jit
def _finish(out_ptr, acc, xs_ptr, ws_ptr, bias_ptr, rm, rn, M, N, HAS_BIAS: tl.constexpr):
    """acc times each row's and each column's scale (plus the bias), rounded to out's dtype."""
    xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=rn < N, other=0.0)
    y = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_gemm_splits(part_ptr, out_ptr, x_ptr, w_ptr, xs_ptr, ws_ptr, bias_ptr, M, N, K, stride_xm, stride_wn,
                     K_PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, WIDE: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.minimum(K, (split + 1) * K_PER_SPLIT)
    for k in range(split * K_PER_SPLIT, k_end, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        k_mask = rk < k_end
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0)
        acc += tl.dot(x.to(WIDE), tl.trans(w.to(WIDE)))
    mn_mask = m_mask[:, None] & n_mask[None, :]
    if SPLITS == 1:
        _finish(out_ptr, acc, xs_ptr, ws_ptr, bias_ptr, rm, rn, M, N, HAS_BIAS)
    else:
        tl.store(part_ptr + (split * M + rm[:, None]).to(tl.int64) * N + rn[None, :], acc, mask=mn_mask)


@triton.jit
def _fp8_gemm_sum(out_ptr, part_ptr, xs_ptr, ws_ptr, bias_ptr, M, N, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(part_ptr + (s * M + rm[:, None]).to(tl.int64) * N + rn[None, :], mask=mask, other=0.0)
    _finish(out_ptr, acc, xs_ptr, ws_ptr, bias_ptr, rm, rn, M, N, HAS_BIAS)


def plan(m: int, n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_M, K splits, K per split): splits so that programs reach about PROGRAMS_PER_SM per
    multiprocessor, at least two BLOCK_K tiles a split."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    k_tiles = triton.cdiv(k, BLOCK_K)
    want = triton.cdiv(PROGRAMS_PER_SM * sms, triton.cdiv(m, block_m) * triton.cdiv(n, BLOCK_N))
    k_per_split = triton.cdiv(k_tiles, max(1, min(want, k_tiles // 2))) * BLOCK_K
    return block_m, triton.cdiv(k, k_per_split), k_per_split


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """Read once per device, not in every layer of every step."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def fp8_gemm(q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale_row: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(q [M, K] fp8 @ weight [N, K] fp8 ^T) * x_scale [M, 1] * w_scale_row [1, N] (+ bias [N]),
    in out_dtype: what `torch._scaled_mm(q, weight.t(), x_scale, w_scale_row, bias)` returns."""
    m, k = q.shape
    n = weight.shape[0]
    if q.stride(1) != 1 or weight.stride(1) != 1 or weight.shape[1] != k:
        raise ValueError(f"fp8_gemm: q [M, {k}] and weight [N, {k}] need contiguous rows, got {tuple(q.shape)} "
                         f"strides {q.stride()} and {tuple(weight.shape)} strides {weight.stride()}")
    out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m == 0:
        return out
    block_m, splits, k_per_split = plan(m, n, k, _multiprocessors(q.device))
    m_blocks, n_blocks = triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=q.device) if splits > 1 else out
    xs, ws = x_scale.reshape(-1), w_scale_row.reshape(-1)
    has_bias = bias is not None
    _fp8_gemm_splits[(n_blocks, splits, m_blocks)](
        part, out, q, weight, xs, ws, bias if has_bias else ws, m, n, k, q.stride(0), weight.stride(0), k_per_split,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLITS=splits, HAS_BIAS=has_bias,
        WIDE=tl.float32 if INTERPRET else tl.float16)
    if splits > 1:
        _fp8_gemm_sum[(n_blocks, m_blocks)](out, part, xs, ws, bias if has_bias else ws, m, n, SPLITS=splits,
                                            BLOCK_M=block_m, BLOCK_N=BLOCK_N, HAS_BIAS=has_bias)
    return out
