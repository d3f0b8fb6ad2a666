"""The Triton paged-attention kernels against a dense float64 reference.

On a machine without a GPU they run under Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1). Every cache slot outside the requests' contexts holds
NaN and the output starts as NaN, so a stray read or a missed write shows.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_attention import run_backend
from tokenmill.executor.attention.kv_cache import KVCache

triton_attention = pytest.importorskip("tokenmill.executor.attention.triton",
                                       reason="Triton is not installed (x86-64 Linux test dependency)")
TritonBackend = triton_attention.TritonBackend
from tokenmill.executor.attention import triton_kv_write  # noqa: E402  (after the skip: it needs Triton)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}

# mixed steps: decodes of ragged lengths, a fresh prompt, chunks after a prefix hit or an earlier chunk
MIXED = ([1, 9, 1, 20, 1, 3], [40, 9, 3, 57, 100, 35])
DECODES = ([1] * 5, [1, 16, 17, 90, 250])


def triton_backend(num_splits=None):
    def make(cache, block_size, heads):
        return TritonBackend(cache, block_size, heads, num_splits=num_splits)
    return make


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Outputs start as NaN, so a row no kernel wrote shows."""
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda x, **kw: empty_like(x, **kw).fill_(float("nan")))


def check(dtype, query_lens, seq_lens, heads, kv_heads, dim, block_size, num_splits=None, seed=0, kv_dtype=None,
          max_span=None):
    out, ref, backend = run_backend(triton_backend(num_splits), dtype, query_lens, seq_lens, seed=seed, heads=heads,
                                    kv_heads=kv_heads, dim=dim, block_size=block_size, fill=float("nan"),
                                    device=DEVICE, kv_dtype=kv_dtype, max_span=max_span)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    return backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (6, 2), (8, 1)], ids=["g1", "g4", "g3", "mqa8"])
def test_mixed_batch_gqa_groups(poisoned_outputs, dtype, heads, kv_heads):
    check(dtype, *MIXED, heads=heads, kv_heads=kv_heads, dim=32, block_size=16)


@pytest.mark.parametrize("dim", [64, 80, 96, 128, 256])
def test_head_dims_padded_to_a_power_of_two(poisoned_outputs, dim):
    check(torch.float16, [1, 5, 1], [20, 5, 33], heads=4, kv_heads=2, dim=dim, block_size=16)


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_block_sizes(poisoned_outputs, block_size):
    check(torch.float32, *MIXED, heads=4, kv_heads=2, dim=16, block_size=block_size, seed=1)


@pytest.mark.parametrize("num_splits", [1, 3, 4])
def test_split_kv_decode(poisoned_outputs, num_splits):
    backend = check(torch.bfloat16, *DECODES, heads=8, kv_heads=2, dim=64, block_size=16, num_splits=num_splits)
    assert backend.plan.chunks is None and backend.plan.decodes.num_splits == num_splits


# a verification step as CUDA graphs run it: queries of 1..5 tokens (0..4 drafts), a row a token
VERIFY = ([5, 1, 3, 5, 2], [40, 17, 90, 250, 5])


@pytest.mark.parametrize("max_span, spans", [(5, [5, 0, 0, 0, 0, 1, 3, 0, 0, 5, 0, 0, 0, 0, 2, 0]),
                                             (2, [2, 0, 2, 0, 1, 1, 2, 0, 1, 2, 0, 2, 0, 1, 2, 0])])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (8, 1), (4, 4)], ids=["g4", "mqa8", "g1"])
def test_rows_of_a_request_share_a_read_of_its_context(poisoned_outputs, max_span, spans, num_splits, heads,
                                                       kv_heads):
    """A row a token (AttentionMetadata.row_spans): the first row of each run of a request's rows
    attends for the run, each row over its context up to itself; the rows after it end at once."""
    backend = check(torch.float32, *VERIFY, heads=heads, kv_heads=kv_heads, dim=32, block_size=16,
                    num_splits=num_splits, max_span=max_span, seed=6)
    d = backend.plan.decodes
    assert backend.plan.chunks is None and d.span == max_span and d.spans.tolist() == spans


def test_runs_are_capped_at_the_tile_rows(poisoned_outputs):
    """A run's rows times the GQA group fill at most MAX_RUN_ROWS tile rows (16 rows at G = 4): a
    verification of 16 drafts goes in runs of 16 and 1; a longer run is refused."""
    backend = check(torch.float32, [17, 3], [60, 90], heads=8, kv_heads=2, dim=32, block_size=16, max_span=16,
                    seed=9)
    assert backend.max_span == triton_attention.MAX_RUN_ROWS // 4 == 16
    assert backend.plan.decodes.spans.tolist() == [16] + [0] * 15 + [1, 3, 0, 0]
    with pytest.raises(ValueError, match="runs of 17 rows: this backend takes at most 16"):
        check(torch.float32, [17], [60], heads=8, kv_heads=2, dim=32, block_size=16, max_span=17)


def test_rows_in_runs_in_16_bits_and_an_8_bit_cache(poisoned_outputs):
    check(torch.bfloat16, *VERIFY, heads=8, kv_heads=2, dim=64, block_size=16, num_splits=3, max_span=5, seed=7)
    check(torch.float16, *VERIFY, heads=8, kv_heads=2, dim=32, block_size=32, max_span=5, seed=8,
          kv_dtype=torch.int8)


def test_long_chunk_after_prefix_hit(poisoned_outputs):
    """A 70-token chunk over 130 cached tokens: several query tiles, keys in scattered blocks."""
    check(torch.float32, [70, 1], [200, 31], heads=2, kv_heads=1, dim=16, block_size=16, seed=2)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantized_cache(poisoned_outputs, dtype, kv_dtype):
    """An 8-bit cache (kv_cache_dtype): the write kernel quantizes each new row as
    kv_cache.quantize_rows does, and both attention kernels read the cache in place; the
    reference attends to K/V as the cache gives them back. Mixed steps, GQA and split decodes.
    The interpreter rounds float32 to fp8 wrongly (next to a power of two), so fp8 runs on a GPU only."""
    if kv_dtype != torch.int8 and DEVICE != "cuda":
        pytest.skip("fp8 stores need a GPU (the interpreter's fp8 rounding is wrong)")
    backend = check(dtype, *MIXED, heads=8, kv_heads=2, dim=32, block_size=16, seed=3, kv_dtype=kv_dtype)
    assert backend.kv_cache.quantized and backend.plan.chunks is not None
    check(dtype, *DECODES, heads=8, kv_heads=2, dim=64, block_size=16, num_splits=3, seed=4, kv_dtype=kv_dtype)


def test_quantized_write_matches_quantize_rows():
    """The write kernel's int8 rows and scales equal kv_cache.quantize_rows' (ties to even, a
    row of zeros with scale 1), and slot -1 is skipped."""
    from tokenmill.executor.attention.kv_cache import quantize_rows

    gen = torch.Generator().manual_seed(5)
    k = torch.randn(4, 2, 16, generator=gen) * 3
    k[1, 0] = 0.0
    k[2, 1, :2] = torch.tensor([127.0, 0.5])  # x / s = 0.5 exactly: rounds to 0
    cache = KVCache.allocate(1, 32, 2, 16, torch.int8, torch.device(DEVICE))
    k_cache, v_cache, k_scales, v_scales = cache.layer(0)
    k = k.to(DEVICE)
    slots = torch.tensor([3, 9, 20, -1], device=DEVICE)
    triton_kv_write.write_kv[(4, 2)](k, -k, k_cache, v_cache, k_scales, v_scales, slots, k.stride(0), k.stride(1),
                                       k.stride(0), k.stride(1), k_cache.stride(0), k_cache.stride(1),
                                       HEAD_DIM=16, D_PAD=16, QMAX=127.0, ROUND=True)
    want, want_scale = quantize_rows(k[:3].cpu(), torch.int8)
    assert torch.equal(k_cache[[3, 9, 20]].cpu(), want) and torch.equal(v_cache[[3, 9, 20]].cpu(), -want)
    torch.testing.assert_close(k_scales[[3, 9, 20]].cpu(), want_scale, rtol=0, atol=0)
    assert want[2, 1, 1] == 0 and want_scale[1, 0] == 1.0
    assert k_cache.view(32, -1).abs().sum(1).nonzero().flatten().tolist() == [3, 9, 20]


def test_padding_tokens_are_not_written():
    """slot -1 (a CUDA-graph padding row) leaves the cache as it was."""
    cache = torch.zeros(1, 2, 64, 2, 16, device=DEVICE)
    backend = TritonBackend(KVCache(cache), 16, 2)
    k = torch.ones(3, 2, 16, device=DEVICE)
    slots = torch.tensor([5, -1, 7], device=DEVICE)
    triton_kv_write.write_kv[(3, 2)](k, k * 2, cache[0, 0], cache[0, 1], cache[0, 0], cache[0, 1], slots,
                                       k.stride(0), k.stride(1),
                                       k.stride(0), k.stride(1), cache[0, 0].stride(0), cache[0, 0].stride(1),
                                       HEAD_DIM=16, D_PAD=16)
    written = cache[0, 0].abs().sum(dim=(1, 2)).nonzero().flatten().tolist()
    assert written == [5, 7] and (cache[0, 1, 7] == 2).all()
    assert backend.d_pad == 16
