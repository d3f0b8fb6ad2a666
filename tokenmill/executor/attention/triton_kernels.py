"""The Triton kernels of the paged attention backend (attention/triton.py, whose docstring
gives the cache layout and the work split): `_attend`, the online softmax over a range of one
context's keys that both attention kernels run; `_chunk_attention`; `_decode_attention` and
`_merge_splits`, which combines its split-KV partials."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _attend(acc, m_i, l_i, q, q_pos, row_valid, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_row_ptr,
            kv_head, lo, hi, scale_log2, stride_slot, stride_head, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
            HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            QUANT: tl.constexpr):
    """Online softmax of the rows q over keys [lo, hi) of one context; a row sees key j
    when j <= its position. m_i and the scores are in log2 units. QUANT (an 8-bit cache,
    read in place): 1 (float32 q) keys widen exactly to float32 and their scales multiply
    the scores, values are scaled in float32; 2 (16-bit q) K and V widen exactly to float16
    (int8, e4m3 and e5m2 all fit), one packed conversion an element where the float32 route
    took four (on an H200 those conversions, not the bytes, set the fp8 cache's pace):
    q enters the dot divided by its row's max |q| (so no float16 overflow) and the value
    scales go into p divided by the tile's largest (so p stays in [0, 1])."""
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    if QUANT == 2:
        q_amax = tl.max(tl.abs(q.to(tl.float32)), 1)
        q_amax = tl.where(q_amax > 0, q_amax, 1.0)
        q = (q.to(tl.float32) / q_amax[:, None]).to(tl.float16)
    for start in range(lo, hi, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)
        n_mask = offs_n < hi
        block = tl.load(table_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
        offs = slot[:, None] * stride_slot + kv_head * stride_head + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
        if QUANT:
            heads = stride_slot // stride_head
            k_scale = tl.load(k_scale_ptr + slot * heads + kv_head, mask=n_mask, other=0.0)
            v_scale = tl.load(v_scale_ptr + slot * heads + kv_head, mask=n_mask, other=0.0)
            if QUANT == 2:
                k = k.to(tl.float16)
                v = v.to(tl.float16)
            else:
                k = k.to(q.dtype)
                v = v.to(tl.float32) * v_scale[:, None]
        elif UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if QUANT == 2:
            s = s * (q_amax[:, None] * k_scale[None, :])
        elif QUANT:
            s = s * k_scale[None, :]
        s = s * scale_log2
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :] & row_valid[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT == 2:
            v_max = tl.max(v_scale, 0)
            v_max = tl.where(v_max > 0, v_max, 1.0)
            pv = tl.dot((p * (v_scale / v_max)[None, :]).to(tl.float16), v) * v_max
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _chunk_attention(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr,
                     work_req_ptr, work_q0_ptr, query_start_loc_ptr, seq_lens_ptr, scale_log2, stride_qt,
                     stride_qh, stride_ot, stride_oh, stride_bt, stride_slot, stride_head, G: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                     HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                     QUANT: tl.constexpr):
    work = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(work_req_ptr + work)
    q0 = tl.load(work_q0_ptr + work)  # the tile's first token, counted within the chunk
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    context_len = tl.load(seq_lens_ptr + req) - query_len  # tokens cached before this chunk

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    tok = q0 + offs_m // G
    head = kv_head * G + offs_m % G
    row_valid = (offs_m < BLOCK_Q * G) & (tok < query_len)
    q_rows = (q_start + tok).to(tl.int64)
    io_mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=io_mask,
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    hi = context_len + tl.minimum(q0 + BLOCK_Q, query_len)  # the tile's last query sees up to here
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, context_len + tok, row_valid, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                            v_scale_ptr, block_table_ptr + req.to(tl.int64) * stride_bt, kv_head, 0, hi, scale_log2,
                            stride_slot, stride_head, BLOCK_SIZE, TILE_N, HEAD_DIM, D_PAD, UPCAST, PRECISION, QUANT)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _decode_attention(out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                      v_scale_ptr, block_table_ptr, rows_ptr, spans_ptr, query_start_loc_ptr, seq_lens_ptr, scale_log2,
                      stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_slot, stride_head, G: tl.constexpr,
                      BLOCK_M: tl.constexpr, SPAN: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, UPCAST: tl.constexpr,
                      PRECISION: tl.constexpr, QUANT: tl.constexpr):
    """A program per (decode row, kv head, split). SPAN > 1 (a step laid out a row a token): the
    row leads spans[i] rows of one request (0: another row leads it, and the program ends), their
    G heads each the tile's rows (row = token * G + head), so that one read of the context serves
    them all, each seeing it up to itself."""
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    span = 1
    if SPAN > 1:
        span = tl.load(spans_ptr + i)
        if span == 0:
            return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    tok = offs_m // G
    head = kv_head * G + offs_m % G
    row_valid = (offs_m < SPAN * G) & (tok < span)
    req = tl.load(rows_ptr + i + tok, mask=row_valid, other=0)
    token = tl.load(query_start_loc_ptr + req, mask=row_valid, other=0).to(tl.int64)
    row_len = tl.load(seq_lens_ptr + req, mask=row_valid, other=0)
    seq_len = tl.max(row_len, 0)  # the span's longest context: its last row's
    io_mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=io_mask,
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, TILE_N), NUM_SPLITS)
    lo = split * tiles_per_split * TILE_N
    hi = tl.minimum(seq_len, lo + tiles_per_split * TILE_N)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    q_pos = row_len - 1  # a row sees its context up to itself
    req0 = tl.load(rows_ptr + i)  # the span's request: its rows share a block table
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, q_pos, row_valid, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                            block_table_ptr + req0.to(tl.int64) * stride_bt, kv_head, lo, hi, scale_log2,
                            stride_slot, stride_head, BLOCK_SIZE, TILE_N, HEAD_DIM, D_PAD, UPCAST, PRECISION, QUANT)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # partials: [decodes, heads, NUM_SPLITS, D_PAD] and [decodes, heads, NUM_SPLITS]; an empty
        # split (or a padding row, seq_len 0) leaves lse = -inf and weighs nothing
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        num_heads = tl.num_programs(1) * G
        base = ((i + tok).to(tl.int64) * num_heads + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + base[:, None] * D_PAD + offs_d[None, :], out, mask=row_valid[:, None])
        tl.store(part_lse_ptr + base, lse, mask=row_valid)


@triton.jit
def _merge_splits(out_ptr, part_out_ptr, part_lse_ptr, rows_ptr, query_start_loc_ptr, stride_ot, stride_oh,
                  NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  D_PAD: tl.constexpr):
    i = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    token = tl.load(query_start_loc_ptr + tl.load(rows_ptr + i)).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    base = (i.to(tl.int64) * num_heads + head) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + base, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top)))
    parts = tl.load(part_out_ptr + base[:, None] * D_PAD + offs_d[None, :], mask=(offs_s < NUM_SPLITS)[:, None],
                    other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
