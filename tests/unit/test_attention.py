"""Paged attention backends against a dense reference, on mixed batches over a shuffled cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from tokenmill.executor.attention.base import AttentionMetadata, default_to_device, row_spans, token_rows
from tokenmill.executor.attention.cpu import CpuBackend
from tokenmill.executor.attention.kv_cache import KVCache, dequantize_rows, quantize_rows
from tokenmill.executor.attention.torch_ref import TorchBackend
from tokenmill.executor.cpu_kernels import load_cpu_kernels

HEADS, KV_HEADS, DIM, BS, NUM_BLOCKS = 8, 2, 32, 4, 128


def dense_reference(q, ks, vs, query_lens, seq_lens):
    """Per request: full K/V of its context, causal mask aligned to the end (float64)."""
    outs, start = [], 0
    group = q.shape[1] // ks[0].shape[1]
    for n, L, k, v in zip(query_lens, seq_lens, ks, vs):
        qi = q[start:start + n].transpose(0, 1).double()
        kr = k.repeat_interleave(group, dim=1).transpose(0, 1).double()
        vr = v.repeat_interleave(group, dim=1).transpose(0, 1).double()
        mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
        outs.append(F.scaled_dot_product_attention(qi, kr, vr, attn_mask=mask).transpose(0, 1))
        start += n
    return torch.cat(outs)


def round_trip(x, kv_dtype):
    """x as an 8-bit cache gives it back"""
    return x if kv_dtype is None else dequantize_rows(*quantize_rows(x, kv_dtype), x.dtype)


def as_kv_cache(cache, kv_dtype):
    """[1, 2, slots, kv_heads, d] -> a KVCache, 8-bit (each row quantized) where kv_dtype is given"""
    if kv_dtype is None:
        return KVCache(cache)
    q, s = quantize_rows(cache.flatten(0, 2), kv_dtype)
    return KVCache(q.view(cache.shape), s.view(cache.shape[:-1]))


def run_backend(make_backend, dtype, query_lens, seq_lens, seed=0, heads=HEADS, kv_heads=KV_HEADS, dim=DIM,
                block_size=BS, fill=0.0, device="cpu", kv_dtype=None, max_span=None):
    """make_backend(KVCache, block_size, heads) -> backend. fill: what the cache holds outside the
    requests' contexts (NaN shows any read of it; the torch path's gathers read whole blocks
    and mask, so it needs finite values there). kv_dtype: an 8-bit cache dtype (the reference
    then attends to K/V as the cache gives them back). max_span: the step laid out a row a token
    (as CUDA graphs run a verification step), its rows in runs of up to max_span (row_spans)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = max(NUM_BLOCKS, 2 * sum(-(-L // block_size) for L in seq_lens))
    cache = torch.full((1, 2, num_blocks * block_size, kv_heads, dim), fill, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered blocks
    tables, ks, vs, new_k, new_v, slots = [], [], [], [], [], []
    for n, L in zip(query_lens, seq_lens):
        blocks = [perm.pop() for _ in range(-(-L // block_size))]
        tables.append(blocks)
        k = torch.randn(L, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(L, kv_heads, dim, generator=gen).to(dtype)
        ks.append(k)
        vs.append(v)
        for pos in range(L):
            slot = blocks[pos // block_size] * block_size + pos % block_size
            if pos < L - n:  # already cached context
                cache[0, 0, slot], cache[0, 1, slot] = k[pos], v[pos]
            else:
                slots.append(slot)
        new_k.append(k[L - n:])
        new_v.append(v[L - n:])
    width = max(len(t) for t in tables)
    q = torch.randn(sum(query_lens), heads, dim, generator=gen).to(dtype)
    cache = cache.to(device)
    lens, table = np.array(query_lens, dtype=np.int32), np.array([t + [0] * (width - len(t)) for t in tables],
                                                                 dtype=np.int32)
    contexts = np.array(seq_lens, dtype=np.int32)
    if max_span is not None:  # a row a token, its context up to itself
        contexts = np.concatenate([np.arange(L - n + 1, L + 1) for n, L in zip(query_lens, seq_lens)]).astype(np.int32)
        lens, table, spans = np.ones(len(contexts), dtype=np.int32), token_rows(table, lens), row_spans(lens, max_span)
    md = AttentionMetadata.from_host(lens, contexts, table, torch.tensor(slots, dtype=torch.long, device=device),
                                     block_size, default_to_device(cache.device))
    if max_span is not None:
        md.row_spans, md.max_span = torch.from_numpy(spans).to(device), max_span
    backend = make_backend(as_kv_cache(cache, kv_dtype), block_size, heads)
    backend.begin_step(md)
    # strided views of one fused qkv row per token, as the model passes them
    tokens = len(q)
    qkv = torch.cat([q.view(tokens, -1), torch.cat(new_k).view(tokens, -1), torch.cat(new_v).view(tokens, -1)],
                    dim=1).to(device)
    qv, kv, vv = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    out = backend(qv.view(tokens, heads, dim), kv.view(tokens, kv_heads, dim), vv.view(tokens, kv_heads, dim), layer=0)
    ks, vs = [round_trip(k, kv_dtype) for k in ks], [round_trip(v, kv_dtype) for v in vs]
    return out.double().cpu(), dense_reference(q, ks, vs, query_lens, seq_lens), backend


def torch_backend(cache, block_size, heads):
    return TorchBackend(cache, block_size, heads)


def cpu_backend(cache, block_size, heads):
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("CPU kernels could not be built here")
    return CpuBackend(cache, block_size, heads, kernels=kernels)


# decodes of varied lengths (some far shorter than the longest), a fresh prompt, a chunk after a prefix hit
CASES = [
    ([1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [5, 37, 1, 16, 17, 90, 3, 64, 65, 8]),
    ([1, 9, 1, 6, 1], [40, 9, 3, 22, 100]),
    ([13], [13]),
]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("query_lens, seq_lens", CASES)
def test_torch_path_matches_dense(dtype, tol, query_lens, seq_lens):
    out, ref, _ = run_backend(torch_backend, dtype, query_lens, seq_lens)
    assert torch.allclose(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("query_lens, seq_lens", CASES)
def test_cpu_kernel_matches_dense(dtype, tol, query_lens, seq_lens):
    out, ref, _ = run_backend(cpu_backend, dtype, query_lens, seq_lens)
    assert torch.allclose(out, ref, atol=tol, rtol=tol)


# The decode kernel's paths: AVX512-BF16 (bf16 at head dim 64 or 128) and AVX512-VNNI (an int8
# cache at head dim 64 or 128) where the CPU has them, AVX2 (head dim a multiple of 16, every
# cache dtype) and the generic loop (head dim 72). GQA groups of 1, 2, 3, 4, 8 and 16 (a group's
# heads go through V in tiles of up to 8, fewer at d 128 under AVX512-BF16, in slices of the row
# under AVX512-VNNI), block sizes 16 and 5, contexts of 1 to 300 tokens (odd, even, multiples of
# 8 and 16 and not). The cache holds NaN outside the contexts: any read of it shows.
@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 4, 64), (4, 4, 128), (6, 2, 64), (16, 8, 128),
                                                  (8, 2, 64), (8, 2, 128), (16, 2, 64), (8, 1, 128),
                                                  (8, 1, 16), (16, 1, 48), (3, 1, 72), (32, 2, 32), (4, 2, 32),
                                                  (8, 1, 32)])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("dtype, kv_dtype, tol", [
    (torch.bfloat16, None, 2e-2), (torch.float32, None, 1e-5), (torch.float16, None, 5e-3),
    # int8: the query and the probabilities are rounded to int16 (1e-4 here, a hundredth of int8's own error)
    (torch.float32, torch.int8, 5e-4), (torch.bfloat16, torch.int8, 2e-2), (torch.float32, torch.float8_e4m3fn, 1e-5),
    (torch.float16, torch.float8_e5m2, 5e-3), (torch.bfloat16, torch.float8_e4m3fn, 2e-2),
    (torch.bfloat16, torch.float8_e5m2, 2e-2)],
    ids=["bf16", "fp32", "fp16", "int8", "bf16-int8", "fp8_e4m3", "fp8_e5m2", "bf16-fp8_e4m3", "bf16-fp8_e5m2"])
def test_cpu_decode_kernel_paths(heads, kv_heads, dim, block_size, dtype, kv_dtype, tol):
    seq_lens = [1, 2, 7, 8, 9, 15, 16, 17, 32, 33, 100, 300]
    out, ref, _ = run_backend(cpu_backend, dtype, [1] * len(seq_lens), seq_lens, seed=3, heads=heads,
                              kv_heads=kv_heads, dim=dim, block_size=block_size, fill=float("nan"), kv_dtype=kv_dtype)
    assert torch.allclose(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("heads, kv_heads, dim", [(16, 8, 64), (16, 8, 128), (32, 4, 128)])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn], ids=["bf16", "int8", "fp8"])
def test_cpu_bf16_decode_of_long_contexts_beside_short_ones(heads, kv_heads, dim, kv_dtype):
    """bfloat16 decodes over contexts longer than the kernels' prefetch distance and their
    chunks (decode_attention_bf16 under AVX512-BF16 for a bf16 cache, decode_attention_int8
    under AVX512-VNNI for int8, with its int32 sums taken to float every 256 tokens, else and
    for fp8 the AVX2 kernel), 15 MB or more of K and V in one step, beside contexts of 1 and
    17 tokens."""
    seq_lens = [1, 17, 300, 3500, 3500]
    out, ref, _ = run_backend(cpu_backend, torch.bfloat16, [1] * len(seq_lens), seq_lens, seed=4, heads=heads,
                              kv_heads=kv_heads, dim=dim, fill=float("nan"), kv_dtype=kv_dtype)
    assert torch.allclose(out, ref, atol=2e-2, rtol=2e-2)


# rows of one request that attend over the same blocks, each one token more (speculative
# verification: its last token and drafts), beside a decode and other verifications; (rows, context)
VERIFICATIONS = [(5, 41), (1, 300), (3, 3), (17, 120), (2, 16)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 64), (6, 2, 32), (8, 1, 32), (16, 2, 16), (4, 4, 128)])
@pytest.mark.parametrize("dtype, kv_dtype, tol", [
    (torch.float32, None, 1e-5), (torch.bfloat16, None, 2e-2), (torch.float32, torch.int8, 5e-4),
    (torch.float32, torch.float8_e4m3fn, 1e-5)], ids=["fp32", "bf16", "int8", "fp8_e4m3"])
def test_cpu_decode_kernel_attends_a_requests_rows_together_as_each_alone(threads, heads, kv_heads, dim, dtype,
                                                                           kv_dtype, tol):
    """The AVX2 kernel attends a run of rows over the same blocks as one job per kv head, K and
    V read once for all their query heads: each row's output is the one it gets alone, bit for
    bit (a verified draft's row is the decode that would have made it), and the dense
    reference's. The cache holds NaN outside the contexts."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("CPU kernels could not be built here")
    gen = torch.Generator().manual_seed(6)
    block_size, num_blocks = 16, 64
    cache = torch.full((1, 2, num_blocks * block_size, kv_heads, dim), float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, seq_lens, ks, vs = [], [], [], []
    width = -(-max(context for _, context in VERIFICATIONS) // block_size)
    for rows, context in VERIFICATIONS:
        blocks = [perm.pop() for _ in range(-(-context // block_size))]
        slots = torch.tensor([blocks[t // block_size] * block_size + t % block_size for t in range(context)])
        cache[0, :, slots] = torch.randn(2, context, kv_heads, dim, generator=gen).to(dtype)
        ks.append(round_trip(cache[0, 0, slots], kv_dtype))
        vs.append(round_trip(cache[0, 1, slots], kv_dtype))
        tables += [blocks + [0] * (width - len(blocks))] * rows
        seq_lens += range(context - rows + 1, context + 1)
    kv = as_kv_cache(cache, kv_dtype)
    k_cache, v_cache, k_scales, v_scales = kv.layer(0)
    q = torch.randn(len(seq_lens), heads, dim, generator=gen).to(dtype)
    table, lens = torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    scale = dim ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = torch.full_like(q, float("nan"))
        kernels.paged_decode_attention(together, q, k_cache, v_cache, table, lens, block_size, scale, k_scales,
                                       v_scales)
        alone = torch.full_like(q, float("nan"))
        for i in range(len(q)):
            kernels.paged_decode_attention(alone[i:i + 1], q[i:i + 1], k_cache, v_cache, table[i:i + 1],
                                           lens[i:i + 1], block_size, scale, k_scales, v_scales)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, alone)
    ref = dense_reference(q, ks, vs, [rows for rows, _ in VERIFICATIONS], [c for _, c in VERIFICATIONS])
    assert torch.allclose(together.double(), ref, atol=tol, rtol=tol)


@pytest.fixture
def prefill_kernels():
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.has_bf16_prefill_attention:
        pytest.skip("the bf16 prefill kernel needs the CPU kernels built on a CPU with AVX512-BF16")
    return kernels


# chunks of several tokens in bfloat16 go to the prefill kernel: fresh prompts, chunks after
# a prefix hit or an earlier chunk (context longer than the chunk), mixed with decodes;
# chunk and context lengths around the kernel's 16-row and 16-token tiles
PREFILL_CASES = [
    ([2, 5, 16, 17, 33], [2, 5, 16, 17, 33]),
    ([1, 7, 1, 64, 3, 1], [50, 40, 9, 200, 131, 301]),
    ([100, 1, 31], [100, 64, 31]),
]


@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 4, 64), (4, 4, 128), (6, 2, 64), (16, 2, 64),
                                                  (8, 2, 128), (32, 1, 64), (4, 2, 32)])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("query_lens, seq_lens", PREFILL_CASES)
def test_cpu_prefill_kernel_bf16(prefill_kernels, heads, kv_heads, dim, block_size, query_lens, seq_lens):
    out, ref, backend = run_backend(cpu_backend, torch.bfloat16, query_lens, seq_lens, seed=5, heads=heads,
                                    kv_heads=kv_heads, dim=dim, block_size=block_size, fill=float("nan"))
    assert backend.chunks is not None and not backend.plan.chunks  # no chunk went to SDPA
    assert torch.allclose(out, ref, atol=2e-2, rtol=2e-2)


def test_cpu_prefill_kernel_rejects_inconsistent_metadata(prefill_kernels):
    q = torch.zeros(5, 8, 64, dtype=torch.bfloat16)
    cache = torch.zeros(64, 4, 64, dtype=torch.bfloat16)
    table = torch.zeros(1, 4, dtype=torch.int32)

    def call(seq_len, query_len, start=0):
        prefill_kernels.paged_prefill_attention(torch.empty_like(q), q, cache, cache, table,
                                                torch.tensor([seq_len], dtype=torch.int32),
                                                torch.tensor([start], dtype=torch.int32),
                                                torch.tensor([query_len], dtype=torch.int32), 16, 0.125)

    call(40, 5)  # consistent: runs
    for seq_len, query_len, start in [(2, 5, 0), (40, 5, 1), (65, 5, 0), (40, 0, 0)]:
        with pytest.raises(RuntimeError, match="has query_len"):
            call(seq_len, query_len, start)
