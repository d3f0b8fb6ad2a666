"""Paged attention on the CPU through the native kernels (executor/csrc), in place in the cache.

- K and V of the new tokens are written by one kernel call per layer.
- Decodes (one query token) go to the decode kernel, which reads each context
  through the block table (executor/csrc/attention.cpp). So do the tokens of short
  chunks (speculative decoding's 1 + k), each a row of it over the context up to it.
- Chunks of several tokens (prompts, later chunks of a long prompt, the rest of a
  prompt after a prefix hit) in bfloat16 with head dim 64 or 128 on a CPU with
  AVX512-BF16 go to the prefill kernel, one call per layer for all of them
  (executor/csrc/prefill_attention.cpp). Other chunks take the torch reference
  path (gather + SDPA), which this backend inherits.
- A quantized cache (kv_cache_dtype int8 / fp8): write_kv quantizes each row as it
  writes it, and every query token, of a decode or of a chunk, is a row of the decode
  kernel, which reads the 8-bit cache in place (a chunk's token at position p attends
  to the p + 1 tokens up to it). No dequantized copy of any context is made.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch

from tokenmill.config import MAX_SPECULATIVE_TOKENS
from tokenmill.executor.attention.base import AttentionMetadata, ToDevice
from tokenmill.executor.attention.kv_cache import KVCache
from tokenmill.executor.attention.torch_ref import TorchBackend, TorchPlan
from tokenmill.executor.cpu_kernels import load_cpu_kernels


# queries this short go to the decode kernel token by token: decodes, and speculative
# decoding's verification (the last token and its drafts)
SHORT_QUERY = 1 + MAX_SPECULATIVE_TOKENS


class KernelDecodes(NamedTuple):
    tokens: torch.Tensor  # [D] int64, the decodes' rows of q
    block_table: torch.Tensor  # [D, max_blocks] int32
    seq_lens: torch.Tensor  # [D] int32


_NO_PLAN = TorchPlan([], [])  # nothing for the torch path


class KernelChunks(NamedTuple):
    block_table: torch.Tensor  # [C, max_blocks] int32
    seq_lens: torch.Tensor  # [C] int32
    q_starts: torch.Tensor  # [C] int32, first row of each chunk in q
    q_lens: torch.Tensor  # [C] int32


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self, kv_cache: KVCache, block_size: int, num_heads: int, to_device: ToDevice | None = None,
                 kernels: ModuleType | None = None) -> None:
        super().__init__(kv_cache, block_size, num_heads, to_device)
        self.kernels = kernels or load_cpu_kernels()
        if self.kernels is None:
            raise ValueError("attention_backend='cpu' needs the native CPU kernels, which could not be built "
                             "(a C++ compiler and ninja are needed); use attention_backend='torch'")
        self.prefill_kernel = (self.kernels.has_bf16_prefill_attention and kv_cache.dtype == torch.bfloat16
                               and self.head_dim in (32, 64, 128))
        self.decodes: KernelDecodes | None = None
        self.chunks: KernelChunks | None = None
        self._rows = torch.arange(0, device=kv_cache.device)  # 0, 1, ...: a decode step's rows of q

    @classmethod
    def check(cls, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int,
              kv_cache_dtype: str = "auto") -> None:
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU only, not on {device.type}; "
                             f"use 'triton' or 'torch'")
        if load_cpu_kernels() is None:
            raise ValueError("attention_backend='cpu' needs the native CPU kernels, which could not be built "
                             "(a C++ compiler and ninja are needed); use attention_backend='torch'")

    def begin_step(self, md: AttentionMetadata) -> None:
        self.md = md
        if len(md.slot_mapping) == len(md.query_lens_cpu):  # one token each (a decode step, a draft's)
            self.decodes, self.chunks, self.plan = self._plan_decodes(md), None, _NO_PLAN
            return
        if self.kv_cache.quantized:
            self.decodes, self.chunks, self.plan = self._plan_query_rows(md), None, _NO_PLAN
            return
        decodes = np.flatnonzero(md.query_lens_cpu <= SHORT_QUERY)
        chunks = np.flatnonzero(md.query_lens_cpu > SHORT_QUERY)
        self.decodes = self._plan_query_rows(md, decodes) if len(decodes) else None
        self.chunks = None
        if len(chunks) and self.prefill_kernel:
            self.chunks = self._plan_kernel_chunks(md, chunks)
            chunks = chunks[:0]
        self.plan = TorchPlan([], self.plan_chunks(md, chunks.tolist()))
        self._reserve_workspace()

    def _plan_decodes(self, md: AttentionMetadata) -> KernelDecodes:
        """_plan_query_rows where every request has one query token: its row is the request's.
        (The general form's numpy calls took 20-30 us a step, a tenth of an EAGLE head's
        forward of the built-in model, which runs every draft after the first this way.)"""
        n = len(md.query_lens_cpu)
        if len(self._rows) < n:
            self._rows = torch.arange(max(n, 2 * len(self._rows)), device=self.kv_cache.device)
        max_blocks = -(-int(md.seq_lens_cpu.max()) // self.block_size)
        table = md.block_table_cpu if md.block_table_cpu.shape[1] == max_blocks else \
            np.ascontiguousarray(md.block_table_cpu[:, :max_blocks])
        return KernelDecodes(self._rows[:n], self.to_device(table), self.to_device(md.seq_lens_cpu))

    def _plan_query_rows(self, md: AttentionMetadata, rows: np.ndarray | None = None) -> KernelDecodes:
        """Every query token of the requests `rows` (default: all) as a decode row: its
        request's block table, the context up to and including it."""
        if rows is None:
            rows = np.arange(len(md.query_lens_cpu))
        query_lens = md.query_lens_cpu[rows]
        req = np.repeat(rows, query_lens)
        # each token's place in its request's query
        offset = np.arange(len(req)) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
        token = md.query_start_loc_cpu[req] + offset
        seq_lens = (md.seq_lens_cpu[req] - md.query_lens_cpu[req] + offset + 1).astype(np.int32)
        max_blocks = -(-int(md.seq_lens_cpu[rows].max()) // self.block_size)
        return KernelDecodes(self.to_device(token.astype(np.int64)),
                             self.to_device(np.ascontiguousarray(md.block_table_cpu[req, :max_blocks])),
                             self.to_device(seq_lens))

    def _plan_kernel_chunks(self, md: AttentionMetadata, rows: np.ndarray) -> KernelChunks:
        max_blocks = -(-int(md.seq_lens_cpu[rows].max()) // self.block_size)
        return KernelChunks(self.to_device(np.ascontiguousarray(md.block_table_cpu[rows, :max_blocks])),
                            self.to_device(md.seq_lens_cpu[rows]), self.to_device(md.query_start_loc_cpu[rows]),
                            self.to_device(md.query_lens_cpu[rows]))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        k_cache, v_cache, k_scales, v_scales = self.kv_cache.layer(layer)
        # one call for both, on k and v as they are (views of qkv)
        self.kernels.write_kv(k, v, k_cache, v_cache, self.md.slot_mapping, k_scales, v_scales)
        out = torch.empty_like(q)
        scale = self.head_dim ** -0.5
        if self.decodes is not None:
            d = self.decodes
            only_decodes = len(d.tokens) == len(q)  # most steps: write straight into out
            qd = q if only_decodes else q.index_select(0, d.tokens)  # the kernel takes strided rows
            od = out if only_decodes else torch.empty_like(qd)
            self.kernels.paged_decode_attention(od, qd, k_cache, v_cache, d.block_table, d.seq_lens,
                                                self.block_size, scale, k_scales, v_scales)
            if not only_decodes:
                out.index_copy_(0, d.tokens, od)
        if self.chunks is not None:  # writes the chunks' rows of out
            self.kernels.paged_prefill_attention(out, q, k_cache, v_cache, *self.chunks, self.block_size, scale)
        self.run_chunks(out, q, k, v, (k_cache, v_cache, k_scales, v_scales))
        return out
