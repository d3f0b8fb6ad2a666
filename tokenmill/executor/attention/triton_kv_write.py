"""The K/V cache write for the Triton backend (triton.py): a program per (token, kv head)
copies one K row and one V row into its slot, quantizing it when the cache is 8-bit."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _quantize_row(x, QMAX: tl.constexpr, ROUND: tl.constexpr):
    """(x / s within +-QMAX, s = max|x| / QMAX) as kv_cache.quantize_rows, divisions rounded
    as torch's; ROUND: to the nearest integer, ties to even (int8; an fp8 store rounds)."""
    amax = tl.max(tl.abs(x), 0)
    s = tl.where(amax > 0, tl.maximum(tl.math.div_rn(amax, QMAX), 1.1754943508222875e-38), 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -QMAX), QMAX)
    if ROUND:
        f = tl.floor(y)
        d = y - f  # exact
        up = (d > 0.5) | ((d == 0.5) & (f - 2.0 * tl.floor(f * 0.5) != 0.0))
        y = tl.where(up, f + 1.0, f)
    return y, s


@triton.jit
def write_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr, stride_kt, stride_kh,
              stride_vt, stride_vh, stride_slot, stride_head, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
              QMAX: tl.constexpr = 0.0, ROUND: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        offs_d = tl.arange(0, D_PAD)
        mask = offs_d < HEAD_DIM
        dst = slot * stride_slot + h * stride_head + offs_d
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs_d, mask=mask, other=0.0)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_d, mask=mask, other=0.0)
        if QMAX > 0:
            k, ks = _quantize_row(k.to(tl.float32), QMAX, ROUND)
            v, vs = _quantize_row(v.to(tl.float32), QMAX, ROUND)
            heads = stride_slot // stride_head
            tl.store(k_scale_ptr + slot * heads + h, ks)
            tl.store(v_scale_ptr + slot * heads + h, vs)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
