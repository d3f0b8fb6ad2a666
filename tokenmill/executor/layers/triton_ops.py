"""The decoder layer's elementwise work for CUDA in Triton: one launch each where torch
runs a chain of ops.

On an H200, a decode step of the Qwen3-0.6B shape at batch 1 spent 2.03 ms in kernels
against a 0.33 ms memory roofline. With torch ops a layer launches about 27 kernels (our
count, from the code and the profile's kernel names), 20 of them small elementwise ones:
the rotary embedding alone is five per tensor (neg, cat, two products, a sum), each
residual add and each strided q/k norm input one more. Here the same work is 4 launches a
layer. The layers take this module as their `kernels`, as they take the CPU kernels
(csrc/elementwise.cpp), chosen once when the model is built:
- `rms_norm` (the CPU kernel's interface): residual += x in place (optional, rounded to the
  model dtype as the reference model keeps its residual stream), then the norm of the sum
  times the weight;
- `silu_and_mul` (likewise): silu(gate) * up of [gate | up] rows;
- `qk_norm_rotary`, which the attention layer uses where its kernels have it: q's and k's
  per-head norms (Qwen3) and their rotate-half rotary embedding in one launch, reading the
  qkv projection's strided views and writing contiguous q and k (with torch ops: two
  copies, two norms and ten small ops);
- `quantize_fp8_rows`: FP8 W8A8's dynamic per-token activation quantization
  (quantization/fp8.py) in one launch instead of nine ops;
- `rms_norm_fp8` and `silu_and_mul_fp8`: rms_norm or silu_and_mul and quantize_fp8_rows
  together, where only an FP8 layer reads the output (qkv, gate/up, down: three launches a
  layer fewer).
Each computes in float32 and rounds where the unfused chain's output is rounded. Tested on
the CPU under Triton's interpreter against float64 references and the torch versions
(tests/kernels/test_triton_layers.py); the interpreter computes bfloat16 arithmetic
wrongly, and these kernels do none (every tile is widened on load), and it rounds float32
to fp8 wrongly, so there the fp8 cast is torch's.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_TILE = 4096  # elements a program holds of one tensor: rows of a norm, heads of a token


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def _normed(x_ptr, res_ptr, w_ptr, r, d, mask, stride_x, eps, DIM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Rows r of x (plus the residual's, the sum stored back first) normed and weighted, float32."""
    x = tl.load(x_ptr + r[:, None] * stride_x + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = res_ptr + r[:, None] * DIM + d[None, :]
        total = (x + tl.load(res, mask=mask, other=0.0).to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res, total, mask=mask)
        x = total.to(tl.float32)  # the norm reads the rounded sum back, as the reference does
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / DIM + eps)
    w = tl.load(w_ptr + d, mask=d < DIM, other=0.0).to(tl.float32)
    return x * inv[:, None] * w[None, :]


@triton.jit
def _rms_norm(out_ptr, x_ptr, res_ptr, w_ptr, rows, stride_x, eps, DIM: tl.constexpr, D_PAD: tl.constexpr,
              BLOCK_R: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    d = tl.arange(0, D_PAD)
    mask = (r < rows)[:, None] & (d < DIM)[None, :]
    y = _normed(x_ptr, res_ptr, w_ptr, r, d, mask, stride_x, eps, DIM, HAS_RESIDUAL)
    tl.store(out_ptr + r[:, None] * DIM + d[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_fp8(q_ptr, scale_ptr, x_ptr, res_ptr, w_ptr, rows, stride_x, eps, DIM: tl.constexpr,
                  D_PAD: tl.constexpr, BLOCK_R: tl.constexpr, HAS_RESIDUAL: tl.constexpr, FP8_MAX: tl.constexpr):
    """_rms_norm, then _quantize_fp8_rows of its output (rounded to x's dtype first, as stored)."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    d = tl.arange(0, D_PAD)
    mask = (r < rows)[:, None] & (d < DIM)[None, :]
    y = _normed(x_ptr, res_ptr, w_ptr, r, d, mask, stride_x, eps, DIM, HAS_RESIDUAL)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-12) * (1.0 / FP8_MAX)
    tl.store(scale_ptr + r, scale, mask=r < rows)
    q = tl.clamp(tl.div_rn(y, scale[:, None]), -FP8_MAX, FP8_MAX)  # IEEE division, as torch's
    tl.store(q_ptr + r[:, None] * DIM + d[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_heads(x_ptr, out_ptr, w_ptr, t, stride_t, cos, sin, eps, HEADS: tl.constexpr, H_PAD: tl.constexpr,
              HALF: tl.constexpr, HALF_PAD: tl.constexpr, NORM: tl.constexpr):
    """One token's heads of q or k: RMSNorm per head (rounded to the dtype, as the unfused
    norm's output is), then the rotary embedding; read strided, written contiguous."""
    h = tl.arange(0, H_PAD)
    i = tl.arange(0, HALF_PAD)
    mask = (h < HEADS)[:, None] & (i < HALF)[None, :]
    offs = h[:, None] * (2 * HALF) + i[None, :]
    x1 = tl.load(x_ptr + t * stride_t + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + t * stride_t + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
        x1 = (x1 * inv[:, None] * w1[None, :]).to(out_ptr.dtype.element_ty).to(tl.float32)
        x2 = (x2 * inv[:, None] * w2[None, :]).to(out_ptr.dtype.element_ty).to(tl.float32)
    out = out_ptr + t * HEADS * 2 * HALF + offs
    tl.store(out, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rotary(q_ptr, k_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, pos_ptr, cos_sin_ptr, stride_qt, stride_kt,
                    eps, Q_HEADS: tl.constexpr, QH_PAD: tl.constexpr, K_HEADS: tl.constexpr, KH_PAD: tl.constexpr,
                    HALF: tl.constexpr, HALF_PAD: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    i = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_sin_ptr + pos * 2 * HALF + i, mask=i < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + i, mask=i < HALF, other=0.0)
    _qk_heads(q_ptr, q_out_ptr, qw_ptr, t, stride_qt, cos, sin, eps, Q_HEADS, QH_PAD, HALF, HALF_PAD, NORM)
    _qk_heads(k_ptr, k_out_ptr, kw_ptr, t, stride_kt, cos, sin, eps, K_HEADS, KH_PAD, HALF, HALF_PAD, NORM)


@triton.jit
def _silu_mul(row, j, DIM: tl.constexpr):
    """silu(gate) * up at columns j of the [gate | up] row starting at `row`, float32."""
    gate = tl.load(row + j, mask=j < DIM, other=0.0).to(tl.float32)
    up = tl.load(row + DIM + j, mask=j < DIM, other=0.0).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _silu_and_mul(out_ptr, gate_up_ptr, DIM: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    y = _silu_mul(gate_up_ptr + r * 2 * DIM, j, DIM)
    tl.store(out_ptr + r * DIM + j, y.to(out_ptr.dtype.element_ty), mask=j < DIM)


@triton.jit
def _silu_and_mul_fp8(q_ptr, scale_ptr, gate_up_ptr, DIM: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr):
    """_silu_and_mul of a row, then _quantize_fp8_rows of it: the products (rounded to the
    dtype, as stored) give the row's largest, then are made again and quantized."""
    r = tl.program_id(0).to(tl.int64)
    row = gate_up_ptr + r * 2 * DIM
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for j0 in range(0, DIM, BLOCK):
        y = _silu_mul(row, j0 + tl.arange(0, BLOCK), DIM).to(gate_up_ptr.dtype.element_ty).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(y))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) * (1.0 / FP8_MAX)
    tl.store(scale_ptr + r, scale)
    for j0 in range(0, DIM, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        y = _silu_mul(row, j, DIM).to(gate_up_ptr.dtype.element_ty).to(tl.float32)
        q = tl.clamp(tl.div_rn(y, scale), -FP8_MAX, FP8_MAX)  # IEEE division, as torch's
        tl.store(q_ptr + r * DIM + j, q.to(q_ptr.dtype.element_ty), mask=j < DIM)


@triton.jit
def _quantize_fp8_rows(q_ptr, scale_ptr, x_ptr, stride_x, K, FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = x_ptr + r * stride_x
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs = k + tl.arange(0, BLOCK_K)
        amax = tl.maximum(amax, tl.abs(tl.load(row + offs, mask=offs < K, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) * (1.0 / FP8_MAX)
    tl.store(scale_ptr + r, scale)
    for k in range(0, K, BLOCK_K):
        offs = k + tl.arange(0, BLOCK_K)
        x = tl.load(row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX)  # IEEE division, as torch's
        tl.store(q_ptr + r * K + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token float8_e4m3fn of x [M, K] (rows contiguous) in one launch, as
    quantization/fp8.py's torch version computes it in nine: (q, float32 scale [M, 1]),
    the scale max|row| / 448 (at least 1e-12 / 448), q = row / scale, saturated."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_fp8_rows: x must be [rows, K] with contiguous rows, got strides {x.stride()}")
    rows, k = x.shape
    q, scale = _fp8_buffers(rows, k, x.device)
    if rows:
        _quantize_fp8_rows[(rows,)](q, scale, x, x.stride(0), k, FP8_MAX=448.0, BLOCK_K=min(2048, _pow2(k)))
    return _fp8_codes(q), scale


def _fp8_buffers(rows: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantizing kernel's outputs: codes [rows, k] and float32 scales [rows, 1]. The interpreter
    rounds float32 to fp8 wrongly next to a power of two (124.8 -> 64): there, and only there,
    the kernel writes the saturated float32 codes and torch casts them (_fp8_codes)."""
    q = torch.empty((rows, k), dtype=torch.float32 if INTERPRET else torch.float8_e4m3fn, device=device)
    return q, torch.empty((rows, 1), dtype=torch.float32, device=device)


def _fp8_codes(q: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float8_e4m3fn) if INTERPRET else q


def _norm_launch(name: str, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[int, int, int, int]:
    """rms_norm's and rms_norm_fp8's arguments checked: (rows, dim, the padded dim, rows a program)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name}: x must be [rows, dim] with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if residual is not None and (not residual.is_contiguous() or residual.shape != x.shape):
        raise ValueError(f"{name}: residual must be contiguous {tuple(x.shape)}, got {tuple(residual.shape)}")
    rows, dim = x.shape
    d_pad = _pow2(dim)
    return rows, dim, d_pad, max(1, min(64, MAX_TILE // d_pad))


def _gate_up_dim(name: str, gate_up: torch.Tensor) -> int:
    """silu_and_mul's and silu_and_mul_fp8's argument checked: the output's width."""
    if gate_up.dim() != 2 or not gate_up.is_contiguous() or gate_up.shape[1] % 2:
        raise ValueError(f"{name}: gate_up must be contiguous [rows, 2 * dim], got {tuple(gate_up.shape)}")
    return gate_up.shape[1] // 2


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [rows, dim] with contiguous rows; residual: contiguous [rows, dim], updated in place."""
    rows, dim, d_pad, block_r = _norm_launch("rms_norm", x, residual)
    out = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
    if rows:
        _rms_norm[(triton.cdiv(rows, block_r),)](out, x, residual if residual is not None else x, weight, rows,
                                                 x.stride(0), eps, DIM=dim, D_PAD=d_pad, BLOCK_R=block_r,
                                                 HAS_RESIDUAL=residual is not None)
    return out


def rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm` and `quantize_fp8_rows` of its output in one launch, where an FP8 layer reads
    the norm (quantization/fp8.py, Fp8Rows): its codes and scales, those of the two launches
    bit for bit; residual updated in place as rms_norm does."""
    rows, dim, d_pad, block_r = _norm_launch("rms_norm_fp8", x, residual)
    q, scale = _fp8_buffers(rows, dim, x.device)
    if rows:
        _rms_norm_fp8[(triton.cdiv(rows, block_r),)](q, scale, x, residual if residual is not None else x, weight,
                                                     rows, x.stride(0), eps, DIM=dim, D_PAD=d_pad, BLOCK_R=block_r,
                                                     HAS_RESIDUAL=residual is not None, FP8_MAX=448.0)
    return _fp8_codes(q), scale


def qk_norm_rotary(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                   eps: float, positions: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] rows (views of the fused
    qkv projection): each head's RMSNorm when the weights are given (Qwen3's q/k norm), then
    the rotary embedding, in one launch; returns new contiguous q and k."""
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    for name, x in (("q", q), ("k", k)):
        if x.stride(2) != 1 or x.stride(1) != head_dim or x.shape[2] != head_dim:
            raise ValueError(f"qk_norm_rotary: {name} must be [tokens, heads, {head_dim}] rows, got shape "
                             f"{tuple(x.shape)} strides {x.stride()}")
    if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous() or cos_sin.shape[1] != head_dim:
        raise ValueError(f"qk_norm_rotary: cos_sin must be contiguous float32 [max_position, {head_dim}]")
    q_out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, kv_heads, head_dim), dtype=k.dtype, device=k.device)
    norm = q_weight is not None
    if tokens:
        _qk_norm_rotary[(tokens,)](q, k, q_out, k_out, q_weight if norm else cos_sin, k_weight if norm else cos_sin,
                                   positions, cos_sin, q.stride(0), k.stride(0), eps, Q_HEADS=heads,
                                   QH_PAD=_pow2(heads), K_HEADS=kv_heads, KH_PAD=_pow2(kv_heads), HALF=head_dim // 2,
                                   HALF_PAD=_pow2(head_dim // 2), NORM=norm)
    return q_out, k_out


def silu_and_mul_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_and_mul` and `quantize_fp8_rows` of its output in one launch, for an FP8 down
    projection (quantization/fp8.py, Fp8Rows): the two launches' codes and scales bit for bit."""
    dim = _gate_up_dim("silu_and_mul_fp8", gate_up)
    rows = len(gate_up)
    q, scale = _fp8_buffers(rows, dim, gate_up.device)
    if rows:
        _silu_and_mul_fp8[(rows,)](q, scale, gate_up, DIM=dim, BLOCK=min(2048, _pow2(dim)), FP8_MAX=448.0)
    return _fp8_codes(q), scale


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: contiguous [rows, 2 * dim]; returns silu(gate) * up, [rows, dim]."""
    dim = _gate_up_dim("silu_and_mul", gate_up)
    rows = len(gate_up)
    out = torch.empty((rows, dim), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(dim))
    if rows:
        _silu_and_mul[(rows, triton.cdiv(dim, block))](out, gate_up, DIM=dim, BLOCK=block)
    return out
