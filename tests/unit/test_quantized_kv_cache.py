"""The quantized KV cache (kv_cache_dtype int8 / fp8): the kernels against a dense reference
over the values the cache gives back, the CPU kernels' writes against the torch ones, the
quantization error, and the engine under prefix caching, chunked prefill and preemption
against transformers."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_parity import PROMPTS, assert_close_outputs, generate, hf_reference  # noqa: F401
from tests.unit.test_attention import CASES, cpu_backend, run_backend, torch_backend
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.executor.attention.kv_cache import QMAX, KVCache, bytes_per_slot, quantize_rows
from tokenmill.executor.cpu_kernels import load_cpu_kernels

KV_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
IDS = ["int8", "fp8_e4m3", "fp8_e5m2"]


@pytest.fixture
def kernels():
    k = load_cpu_kernels()
    if k is None:
        pytest.skip("CPU kernels could not be built here")
    return k


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=IDS)
@pytest.mark.parametrize("make", [torch_backend, cpu_backend], ids=["torch", "cpu"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("query_lens, seq_lens", CASES)
def test_backends_attend_to_what_the_cache_holds(make, kv_dtype, dtype, tol, query_lens, seq_lens):
    out, ref, backend = run_backend(make, dtype, query_lens, seq_lens, kv_dtype=kv_dtype)
    assert torch.allclose(out, ref, atol=tol, rtol=tol)
    if make is cpu_backend:  # every query token went to the kernel, none to a gathered copy
        assert len(backend.decodes.tokens) == sum(query_lens) and not backend.plan.chunks


@pytest.mark.parametrize("kv_dtype, tol", [(torch.int8, 0.012), (torch.float8_e4m3fn, 0.04),
                                           (torch.float8_e5m2, 0.08)], ids=IDS)
def test_quantization_error_is_small(kv_dtype, tol):
    """Against attention over the unquantized K/V, the mean error relative to the mean output:
    measured 0.7% for int8 (8 bits a value), 2.6% for e4m3 (4 significant bits), 5.5% for e5m2 (3)."""
    for query_lens, seq_lens in CASES:
        out, _, _ = run_backend(cpu_backend, torch.float32, query_lens, seq_lens, kv_dtype=kv_dtype)
        _, exact, _ = run_backend(cpu_backend, torch.float32, query_lens, seq_lens)
        err = ((out - exact).abs().mean() / exact.abs().mean()).item()
        assert err < tol, err


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_the_rows_quantize_rows_makes(kernels, kv_dtype, dtype):
    g = torch.Generator().manual_seed(0)
    tokens, kv_heads, dim, slots = 37, 2, 64, 80
    k = (torch.randn(tokens, kv_heads, dim, generator=g) * torch.rand(tokens, kv_heads, 1, generator=g) * 4).to(dtype)
    v = torch.randn(tokens, kv_heads, dim, generator=g).to(dtype)
    k[3, 1] = 0  # a row of zeros: scale 1, values 0
    k[5, 0] *= 1e-37  # max|x| / qmax below float32's normal range: the scale stays normal, never 0
    slot_mapping = torch.randperm(slots, generator=g)[:tokens]
    native, reference = (KVCache.allocate(1, slots, kv_heads, dim, kv_dtype, torch.device("cpu")) for _ in range(2))
    kc, vc, ks, vs = native.layer(0)
    kernels.write_kv(k, v, kc, vc, slot_mapping, ks, vs)
    reference.write(0, k, v, slot_mapping)
    torch.testing.assert_close(native.scales, reference.scales, rtol=1e-6, atol=0)
    a, b = native.data.float(), reference.data.float()
    # the kernel multiplies by 1 / scale where torch divides: a value on a rounding boundary
    # may land one step apart, nothing more
    assert (a != b).float().mean() < 1e-3
    assert native.scales[0, 0, slot_mapping[3], 1] == 1 and (native.data[0, 0, slot_mapping[3], 1].float() == 0).all()
    assert native.data.float().abs().max() <= QMAX[kv_dtype]
    assert native.scales[0, 0, slot_mapping[5], 0] == torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=IDS[1:])
def test_kernel_widens_every_fp8_value_exactly(kernels, kv_dtype):
    """A context of one token attends to its V row alone: out = V as the kernel reads it, for
    every finite fp8 bit pattern (normal, subnormal, zero, negative)."""
    values = torch.arange(256, dtype=torch.uint8).view(kv_dtype)
    finite = values.float().isfinite()
    values = values[finite]
    dim = 16
    rows = -(-len(values) // dim)
    padded = torch.cat([values, values[:rows * dim - len(values)]]).view(rows, 1, dim)
    k = torch.zeros(rows, 1, dim).to(kv_dtype)
    scales = torch.ones(rows, 1)
    q = torch.zeros(rows, 1, dim)
    out = torch.empty_like(q)
    block_table = torch.arange(rows, dtype=torch.int32).view(rows, 1)
    kernels.paged_decode_attention(out, q, k, padded, block_table, torch.ones(rows, dtype=torch.int32), 1, 1.0,
                                   scales, scales)
    assert torch.equal(out, padded.float())


def test_capacity_for_the_same_memory(checkpoints):
    """The test checkpoint: 2 layers, 2 kv heads, head dim 16. A row costs 16 + 4 bytes in
    8 bits with its scale, 32 in bfloat16: 1.6x the blocks (1.88x at head dim 64)."""
    budget = 64 * 1024
    blocks = {}
    for kv in ("auto", "int8", "fp8"):
        llm = LLM(str(checkpoints("llama")), dtype="bfloat16", kv_cache_memory=budget, kv_cache_dtype=kv)
        blocks[kv] = llm.engine.runner.num_blocks
        assert llm.engine.runner.kv_cache.data.dtype == {"auto": torch.bfloat16, "int8": torch.int8,
                                                         "fp8": torch.float8_e4m3fn}[kv]
    per_block_8bit = bytes_per_slot(2, 2, 16, torch.int8) * 16
    assert blocks["int8"] == blocks["fp8"] == budget // per_block_8bit
    assert blocks["auto"] == budget // (bytes_per_slot(2, 2, 16, torch.bfloat16) * 16)
    assert blocks["int8"] / blocks["auto"] == pytest.approx(1.6, rel=0.05)


@pytest.fixture(scope="module")
def quantized_run(checkpoints):
    """kv_cache_dtype -> greedy tokens of the float32 "llama" checkpoint with that cache, default settings."""
    cache = {}

    def get(kv_cache_dtype):
        if kv_cache_dtype not in cache:
            _, outs = generate(checkpoints("llama"), kv_cache_dtype=kv_cache_dtype)
            cache[kv_cache_dtype] = outs
        return cache[kv_cache_dtype]

    return get


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "fp8_e5m2"])
def test_quantized_cache_stays_close_to_transformers(kv_cache_dtype, quantized_run, hf_reference):
    """Where the greedy tokens leave transformers' (exact float32) tokens, the first divergence
    is a near-tie; with int8 most tokens agree (fp8's coarser values leave sooner on this
    random checkpoint, whose logits are flat)."""
    ours, hf = quantized_run(kv_cache_dtype), hf_reference("llama")
    assert_close_outputs(hf, ours, f"llama kv {kv_cache_dtype}")
    same = sum(a == b for o, (t, _) in zip(ours, hf) for a, b in zip(o.outputs[0].token_ids, t))
    if kv_cache_dtype == "int8":
        assert same / sum(len(t) for t, _ in hf) >= 0.8


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("engine_args", [
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=7),  # chunked prefill
    dict(block_size=4, kv_cache_memory=160 * 160),  # 160 tokens of 8-bit KV (160 B each): preemption
    dict(attention_backend="torch"),
], ids=["no-prefix-cache", "chunked-7", "preemption", "torch-backend"])
def test_engine_settings_do_not_change_quantized_outputs(kv_cache_dtype, engine_args, checkpoints, quantized_run):
    """Each row is quantized alone, as it is written: chunking, preemption (recompute) and the
    backend change nothing in what the cache holds, so the tokens are the same."""
    llm, ours = generate(checkpoints("llama"), kv_cache_dtype=kv_cache_dtype, **engine_args)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in quantized_run(kv_cache_dtype)]
    if "block_size" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.kv_cache.check_integrity()
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_prefix_hits_read_the_quantized_blocks_again(checkpoints):
    llm, first = generate(checkpoints("llama"), kv_cache_dtype="int8")
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=5)
    second = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert any(o.metrics.num_cached_tokens > 0 for o in second)
    for a, b in zip(first, second):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_bad_kv_cache_dtype_names_the_field(checkpoints):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp4")


def test_triton_backend_on_the_int8_cache_gives_the_cpu_backends_tokens(quantized_run, checkpoints, hf_reference):
    """attention_backend='triton' (under the interpreter here) writes and reads the int8 cache
    as the CPU backend does: close to transformers wherever it diverges, and the CPU backend's
    tokens (the same cache values; only the order of the sums differs)."""
    pytest.importorskip("triton")
    llm, ours = generate(checkpoints("llama"), kv_cache_dtype="int8", attention_backend="triton")
    assert llm.engine.runner.attn.name == "triton" and llm.engine.runner.kv_cache.quantized
    assert_close_outputs(hf_reference("llama"), ours, "llama kv int8, triton")
    cpu = [o.outputs[0].token_ids for o in quantized_run("int8")]
    same = sum(a == b for o, c in zip(ours, cpu) for a, b in zip(o.outputs[0].token_ids, c))
    assert same / sum(len(c) for c in cpu) >= 0.95


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_forked_sequences_copy_the_scales_with_the_blocks(kv_cache_dtype, checkpoints, quantized_run):
    """n=2 greedy forks after the prompt: the shared last block is copied on write, its scales
    with it, so both sequences give the single run's tokens."""
    llm = LLM(str(checkpoints("llama")), dtype="float32", kv_cache_memory="32MiB", kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(n=2, max_tokens=32, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for out, single in zip(outs, quantized_run(kv_cache_dtype)):
        assert [c.token_ids for c in out.outputs] == [single.outputs[0].token_ids] * 2


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=IDS)
def test_copy_slots_copies_every_bit(kv_dtype):
    cache = KVCache.allocate(2, 8, 2, 16, kv_dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    cache.data.view(torch.uint8).copy_(torch.randint(0, 256, cache.data.shape, generator=g, dtype=torch.uint8))
    cache.scales.uniform_(0.5, 2, generator=g)
    src, dst = torch.tensor([1, 6]), torch.tensor([3, 0])
    cache.copy_slots(dst, src)
    assert torch.equal(cache.data[:, :, dst].view(torch.uint8), cache.data[:, :, src].view(torch.uint8))
    assert torch.equal(cache.scales[:, :, dst], cache.scales[:, :, src])


def test_kernels_name_a_cache_dtype_that_is_neither_q_nor_8bit(kernels):
    k = torch.zeros(4, 1, 16, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, 16)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="a cache of BFloat16 with q of Float"):
        kernels.paged_decode_attention(torch.empty_like(q), q, k, k, table, lens, 4, 1.0)
    with pytest.raises(RuntimeError, match="a cache of BFloat16 for k of Float"):
        kernels.write_kv(q, q, k, k, torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 2, 64), (32, 4, 128), (16, 1, 32)])
def test_int8_decode_sums_long_flat_contexts_without_overflow(kernels, heads, kv_heads, dim):
    """The int8 decode kernel sums p.v in int32: int16 probabilities times int8 values. The
    worst case for those sums is a flat softmax over rows at the int8 limit, every
    probability rounding to 32767: a context of 1,500 tokens (several of the kernel's
    chunks) whose output must still be the rows' value exactly, +127 or -127 times the scale
    by head dimension, with no wrapped int32."""
    block, ctx, scale = 16, 1500, 0.01
    num_slots = -(-ctx // block) * block
    k = torch.randint(-127, 128, (num_slots, kv_heads, dim), dtype=torch.int8)
    sign = torch.where(torch.arange(dim) % 3 == 0, -1, 1).to(torch.int8)
    v = (127 * sign).expand(num_slots, kv_heads, dim).contiguous()
    scales = torch.full((num_slots, kv_heads), scale)
    table = torch.randperm(num_slots // block).to(torch.int32)[None]
    q = torch.zeros(1, heads, dim)  # every score 0: a flat softmax
    out = torch.empty_like(q)
    kernels.paged_decode_attention(out, q, k, v, table, torch.tensor([ctx], dtype=torch.int32), block, dim ** -0.5,
                                   scales, scales)
    expected = (127 * scale * sign.float()).expand(1, heads, dim)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
