"""Paged attention in plain PyTorch: gather K/V through the block table, then SDPA.

The reference backend, on any device, and the fallback of the `cpu` backend for
the chunks its kernels do not take. The cache of a layer is
[num_blocks * block_size, kv_heads, head_dim], so one block is one contiguous
row of block_size * kv_heads * head_dim values and gathers move whole blocks.

- A chunk with nothing cached before it attends over its own new K/V (no gather,
  plain causal SDPA); other chunks gather their context and use a causal mask
  aligned to its end.
- Decodes (one query token) run batched: sorted by context length and split into
  groups so that little is padded, each group gathered once into a reused buffer
  and attended by SDPA, each kv head's query group playing the role of that head's
  query length, so GQA needs no K/V copies.
- A quantized cache (kv_cache_dtype int8 / fp8) is written through quantize_rows and
  dequantized after the gather, to the query's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch.nn import functional as F

from tokenmill.executor.attention.base import AttentionMetadata, ToDevice, default_to_device
from tokenmill.executor.attention.kv_cache import KVCache, as_bytes, dequantize_rows

# one layer's cache: (k, v, k_scales, v_scales), the scales None unless it is quantized
LayerCache = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]

# a decode group is split when a shorter context would pad it by more than this fraction
_GROUP_PAD_RATIO = 0.6
_MIN_GROUP = 8


class DecodeGroup(NamedTuple):
    """Decodes attended together: their contexts padded to `length` tokens and masked."""

    tokens: torch.Tensor  # [G] int64, their rows of q
    blocks: torch.Tensor  # [G * length / block_size] int64, block ids row after row
    valid: torch.Tensor  # [G, 1, 1, length] bool, the tokens inside each context
    length: int


class Chunk(NamedTuple):
    """A request's chunk of several query tokens: rows [start, end) of q."""

    start: int
    end: int
    blocks: torch.Tensor | None  # its context's block ids; None when nothing is cached before it
    mask: torch.Tensor | None  # [n, blocks * block_size] bool, causal and aligned to the context's end


class TorchPlan(NamedTuple):
    decode_groups: list[DecodeGroup]
    chunks: list[Chunk]


class TorchBackend:
    name = "torch"
    graph_safe = False  # its launches follow the contexts' lengths

    def __init__(self, kv_cache: KVCache, block_size: int, num_heads: int,
                 to_device: ToDevice | None = None) -> None:
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.num_heads = num_heads
        self.kv_heads, self.head_dim = kv_cache.kv_heads, kv_cache.head_dim
        self.block_numel = block_size * self.kv_heads * self.head_dim
        self.to_device = to_device or default_to_device(kv_cache.device)
        self._workspace = as_bytes(torch.empty(0, dtype=kv_cache.dtype, device=kv_cache.device))
        self.md: AttentionMetadata | None = None
        self.plan = TorchPlan([], [])

    @classmethod
    def check(cls, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int,
              kv_cache_dtype: str = "auto") -> None:
        """Every device, dtype, head dim, block size and kv_cache_dtype: nothing to refuse."""

    def begin_step(self, md: AttentionMetadata) -> None:
        self.md = md
        decodes = np.flatnonzero(md.query_lens_cpu == 1).tolist()
        chunks = np.flatnonzero(md.query_lens_cpu > 1).tolist()
        self.plan = TorchPlan(self.plan_decode_groups(md, decodes), self.plan_chunks(md, chunks))
        self._reserve_workspace()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        self.kv_cache.write(layer, k, v, self.md.slot_mapping)
        cache = self.kv_cache.layer(layer)
        out = torch.empty_like(q)
        self.run_decode_groups(out, q, cache)
        self.run_chunks(out, q, k, v, cache)
        return out

    # -- planning, once per step ----------------------------------------------
    def plan_decode_groups(self, md: AttentionMetadata, rows: list[int]) -> list[DecodeGroup]:
        bs = self.block_size
        starts = md.query_start_loc_cpu
        rows = sorted(rows, key=lambda i: -md.seq_lens_cpu[i])
        groups = []
        for group in _split_groups(rows, md.seq_lens_cpu):
            num_blocks = -(-int(md.seq_lens_cpu[group[0]]) // bs)
            blocks = md.block_table_cpu[group, :num_blocks].astype(np.int64).reshape(-1)
            valid = np.arange(num_blocks * bs)[None, :] < md.seq_lens_cpu[group, None]
            groups.append(DecodeGroup(self.to_device(starts[group].astype(np.int64)), self.to_device(blocks),
                                      self.to_device(valid)[:, None, None, :], num_blocks * bs))
        return groups

    def plan_chunks(self, md: AttentionMetadata, rows: list[int]) -> list[Chunk]:
        bs = self.block_size
        chunks = []
        for i in rows:
            start, n, seq_len = (int(x[i]) for x in (md.query_start_loc_cpu, md.query_lens_cpu, md.seq_lens_cpu))
            blocks = mask = None
            # queries sit at the end of the context: bottom-right causal mask; a quantized cache
            # is read even by a fresh prompt, so that every backend attends to the same values
            if seq_len > n or self.kv_cache.quantized:
                num_blocks = -(-seq_len // bs)
                blocks = self.to_device(md.block_table_cpu[i, :num_blocks].astype(np.int64))
                q_pos = np.arange(seq_len - n, seq_len)
                mask = self.to_device(np.arange(num_blocks * bs)[None, :] <= q_pos[:, None])
            chunks.append(Chunk(start, start + n, blocks, mask))
        return chunks

    def _reserve_workspace(self) -> None:
        need = max([len(g.blocks) for g in self.plan.decode_groups]
                   + [len(c.blocks) for c in self.plan.chunks if c.blocks is not None] + [0])
        if 2 * need * self.block_numel > self._workspace.numel():
            # reused across steps and layers: fresh multi-MB buffers would cost page faults each call
            self._workspace = as_bytes(torch.empty(2 * need * self.block_numel, dtype=self.kv_cache.dtype,
                                                   device=self.kv_cache.device))

    # -- per layer -------------------------------------------------------------
    def run_decode_groups(self, out: torch.Tensor, q: torch.Tensor, cache: LayerCache) -> None:
        num_heads = self.num_heads
        for group in self.plan.decode_groups:
            kd, vd = self._gather(cache, group.blocks, group.length, q.dtype)
            b = len(group.tokens)
            qd = q.index_select(0, group.tokens).view(b, self.kv_heads, num_heads // self.kv_heads, self.head_dim)
            od = F.scaled_dot_product_attention(qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=group.valid)
            out.index_copy_(0, group.tokens, od.reshape(b, num_heads, self.head_dim))  # CUDA SDPA may return it strided

    def run_chunks(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cache: LayerCache) -> None:
        num_heads = self.num_heads
        for chunk in self.plan.chunks:
            # [1, heads, tokens, d]: with a batch dimension SDPA takes its flash kernel on the
            # CPU (GQA included), 2x faster than its math path at 200 tokens, 4x at 1024
            start, end = chunk.start, chunk.end
            qp = q[start:end].transpose(0, 1)[None]
            if chunk.blocks is None:
                kp, vp = k[start:end].transpose(0, 1)[None], v[start:end].transpose(0, 1)[None]
            else:
                kp, vp = self._gather(cache, chunk.blocks, len(chunk.blocks) * self.block_size, q.dtype)
                kp, vp = kp.transpose(1, 2), vp.transpose(1, 2)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                                enable_gqa=num_heads != self.kv_heads)
            out[start:end] = op[0].transpose(0, 1)

    def _gather(self, cache: LayerCache, blocks: torch.Tensor, length: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks as [B, length, kv_heads, d] in `dtype`, B = blocks /
        (length / block_size)."""
        n = blocks.numel() * self.block_numel
        out = []
        for i in range(2):
            raw = torch.index_select(as_bytes(cache[i]).view(-1, self.block_numel), 0, blocks,
                                     out=self._workspace[i * n:(i + 1) * n].view(-1, self.block_numel))
            raw = raw.view(cache[i].dtype).view(-1, length, self.kv_heads, self.head_dim)
            scales = cache[2 + i]
            if scales is not None:
                s = scales.view(-1, self.block_size * self.kv_heads).index_select(0, blocks)
                raw = dequantize_rows(raw, s.view(-1, length, self.kv_heads), dtype)
            out.append(raw)
        return out[0], out[1]


def _split_groups(rows: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Rows sorted by descending length -> groups whose padding stays small."""
    groups: list[list[int]] = []
    for r in rows:
        if groups and (len(groups[-1]) < _MIN_GROUP or seq_lens[r] >= _GROUP_PAD_RATIO * seq_lens[groups[-1][0]]):
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups
