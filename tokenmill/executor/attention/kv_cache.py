"""The paged KV cache on the device: in the model's dtype, or quantized (`kv_cache_dtype`).

`data` is [num_layers, 2 (K, V), num_slots, kv_heads, head_dim], slot = block_id *
block_size + offset. A quantized cache (int8, fp8 e4m3, fp8 e5m2) stores each token's row
of each kv head as x / s in 8 bits, s = max|x| / qmax computed when the row is written, and
keeps s in `scales` [num_layers, 2, num_slots, kv_heads] float32. Per token and head, as
LMDeploy's int8 cache; vLLM's fp8 cache has one scale per tensor, from the checkpoint or 1.0.
A row costs head_dim + 4 bytes instead of 2 * head_dim in bfloat16: 1.88x the tokens at head
dim 64, 1.94x at 128.
"""

from __future__ import annotations

import torch

from tokenmill.executor.huge_pages import device_zeros

# kv_cache_dtype -> the storage dtype (None: the model's); vLLM's names
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
# the largest stored magnitude: a row's absmax lands there
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALE_BYTES = 4  # float32, per row


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache stores for `kv_cache_dtype` (already validated by EngineConfig)."""
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def bytes_per_slot(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """What one token's K and V cost in every layer, scales included."""
    row = head_dim * dtype.itemsize + (SCALE_BYTES if dtype in QMAX else 0)
    return 2 * num_layers * kv_heads * row


class KVCache:
    def __init__(self, data: torch.Tensor, scales: torch.Tensor | None = None) -> None:
        self.data = data
        self.scales = scales
        self.quantized = scales is not None
        self.dtype = data.dtype
        self.device = data.device
        self.num_slots = data.shape[2]
        self.kv_heads, self.head_dim = data.shape[-2:]
        # each layer's views made once: four tensor indexings cost about 16 us, a layer's
        # attention call on the CPU at one request about 40 us (the built-in model)
        self._layers = [(data[i, 0], data[i, 1], *((None, None) if scales is None else (scales[i, 0], scales[i, 1])))
                        for i in range(data.shape[0])]

    @classmethod
    def allocate(cls, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> KVCache:
        """dtype: the model's, or an 8-bit one of QMAX (then with scales)."""
        data = device_zeros((num_layers, 2, num_slots, kv_heads, head_dim), dtype, device)
        scales = (device_zeros((num_layers, 2, num_slots, kv_heads), torch.float32, device).fill_(1.0)
                  if dtype in QMAX else None)
        return cls(data, scales)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(k, v, k_scales, v_scales) of layer i: [slots, kv_heads, d] and [slots, kv_heads]."""
        return self._layers[i]

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [tokens, kv_heads, d] into layer i's slots (the torch path; the CPU kernels'
        write_kv does the same in one call)."""
        k_cache, v_cache, k_scales, v_scales = self.layer(i)
        if not self.quantized:
            k_cache.index_copy_(0, slots, k)
            v_cache.index_copy_(0, slots, v)
            return
        for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
            q, s = quantize_rows(x, self.dtype)
            as_bytes(cache).index_copy_(0, slots, as_bytes(q))
            scales.index_copy_(0, slots, s)

    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Every layer's K/V (and scales) of slots `src` into slots `dst` (copy on write)."""
        data = as_bytes(self.data)
        data[:, :, dst] = data[:, :, src]
        if self.scales is not None:
            self.scales[:, :, dst] = self.scales[:, :, src]


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """An 8-bit tensor as uint8, for the copies and gathers torch has no fp8 kernels for."""
    return x.view(torch.uint8) if x.dtype in QMAX else x


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, kv_heads, d] -> (x / s in dtype, s [tokens, kv_heads] float32), s = max|x| / qmax
    per row (1 for a row of zeros); rounded to nearest even, as the CPU kernel does."""
    qmax = QMAX[dtype]
    x = x.float()
    amax = x.abs().amax(dim=-1)
    # at least the smallest normal float, as the CPU kernel keeps it (a subnormal may flush to 0)
    # amax / a tensor of qmax: CUDA divides by a Python number as a product with its reciprocal,
    # one ulp off at times, which moves a tie of fp16/bf16 rows to the other code (the CPU
    # kernel and the Triton write divide exactly)
    s = amax / torch.full_like(amax, qmax)
    s = torch.where(amax > 0, s.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
    scaled = (x / s.unsqueeze(-1)).clamp_(-qmax, qmax)
    return (scaled.round_() if dtype == torch.int8 else scaled).to(dtype), s


def dequantize_rows(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., kv_heads, d] 8-bit and s [..., kv_heads] -> the values in `dtype`."""
    return (q.float() * s.unsqueeze(-1)).to(dtype)


class CacheOwner:
    """A model with its own paged KV cache (the model runner, a draft model): builds caches
    and attention backends from its model_config, block_size, kv_cache_dtype, device,
    backend_cls and staging."""

    def allocate_kv_cache(self, num_blocks: int) -> KVCache:
        mc = self.model_config
        return KVCache.allocate(mc.num_layers, num_blocks * self.block_size, mc.num_kv_heads, mc.head_dim,
                                self.kv_cache_dtype, self.device)

    def make_backend(self, kv_cache: KVCache):
        return self.backend_cls(kv_cache, self.block_size, self.model_config.num_heads, self.staging.to_device)
