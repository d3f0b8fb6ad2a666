"""Paged attention backends against a dense reference, on mixed batches over a shuffled cache."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tokenmill.executor.attention import AttentionMetadata, TorchNativeBackend
from tokenmill.executor.cpu_kernels import load_cpu_kernels

HEADS, KV_HEADS, DIM, BS, NUM_BLOCKS = 8, 2, 32, 4, 128


def dense_reference(q, ks, vs, query_lens, seq_lens):
    """Per request: full K/V of its context, causal mask aligned to the end."""
    outs, start = [], 0
    for n, L, k, v in zip(query_lens, seq_lens, ks, vs):
        qi = q[start:start + n].transpose(0, 1).float()
        kr = k.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1).float()
        vr = v.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1).float()
        mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
        outs.append(F.scaled_dot_product_attention(qi, kr, vr, attn_mask=mask).transpose(0, 1))
        start += n
    return torch.cat(outs)


def run_backend(backend_kernel, dtype, query_lens, seq_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.zeros((1, 2, NUM_BLOCKS * BS, KV_HEADS, DIM), dtype=dtype)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()  # scattered blocks
    tables, ks, vs, new_k, new_v, slots = [], [], [], [], [], []
    for n, L in zip(query_lens, seq_lens):
        blocks = [perm.pop() for _ in range(-(-L // BS))]
        tables.append(blocks)
        k = torch.randn(L, KV_HEADS, DIM, generator=gen).to(dtype)
        v = torch.randn(L, KV_HEADS, DIM, generator=gen).to(dtype)
        ks.append(k)
        vs.append(v)
        for pos in range(L):
            slot = blocks[pos // BS] * BS + pos % BS
            if pos < L - n:  # already cached context
                cache[0, 0, slot], cache[0, 1, slot] = k[pos], v[pos]
            else:
                slots.append(slot)
        new_k.append(k[L - n:])
        new_v.append(v[L - n:])
    width = max(len(t) for t in tables)
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=gen).to(dtype)
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens), block_size=BS)
    backend = TorchNativeBackend(cache, BS, decode_kernel=backend_kernel)
    backend.begin_step(md)
    out = backend(q, torch.cat(new_k), torch.cat(new_v), layer=0)
    return out.float(), dense_reference(q, ks, vs, query_lens, seq_lens)


# decodes of varied lengths (some far shorter than the longest), a fresh prompt, a chunk after a prefix hit
CASES = [
    ([1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [5, 37, 1, 16, 17, 90, 3, 64, 65, 8]),
    ([1, 9, 1, 6, 1], [40, 9, 3, 22, 100]),
    ([13], [13]),
]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("query_lens, seq_lens", CASES)
def test_torch_path_matches_dense(dtype, tol, query_lens, seq_lens):
    out, ref = run_backend(None, dtype, query_lens, seq_lens)
    assert torch.allclose(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("query_lens, seq_lens", CASES)
def test_cpu_kernel_matches_dense(dtype, tol, query_lens, seq_lens):
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("CPU kernels could not be built here")
    out, ref = run_backend(kernels, dtype, query_lens, seq_lens)
    assert torch.allclose(out, ref, atol=tol, rtol=tol)
