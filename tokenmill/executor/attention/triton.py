"""Paged attention for CUDA in Triton: K/V cache write, chunked-prefill attention, split-KV decode.

Tested in CI on the CPU with Triton's interpreter (TRITON_INTERPRET=1, set before
this module is imported). The interpreter computes bfloat16 arithmetic wrongly
(Triton issue #11584), so there, and only there, bfloat16 tiles are widened to
float32 as they are loaded (the UPCAST constexpr); float32 and float16 run the
GPU code unchanged.

Layout: a layer's cache is [num_blocks * block_size, kv_heads, head_dim]; token j
of a request lives in slot block_table[j // block_size] * block_size + j % block_size.
Head dims up to 256 are padded to the next power of two (at least 16, the
smallest `tl.dot` side) with masks; any power-of-two block size from 16 up works,
since each key tile looks up the block of every token it reads.

Work split:
- `write_kv` (triton_kv_write.py): a program per (token, kv head) copies one K row and one V row;
  slot -1 (a padding token) is skipped.
- `_chunk_attention`: a program per (query tile, kv head). A query tile is BLOCK_Q
  consecutive tokens of one request times the G query heads sharing the kv head
  (rows = token * G + head, BLOCK_M = BLOCK_Q * G rows padded to a power of two),
  so each K/V tile read serves the whole GQA group. Keys run from the start of
  the context to the tile's last query position (causal, aligned to the context's
  end), in TILE_N-token tiles with an online softmax. It also serves decodes that
  come mixed with chunks; prefix hits and later chunks of long prompts need nothing
  special: their earlier tokens are simply in the cache.
- `_decode_attention`: a program per (decode, kv head, split): the context is cut
  into NUM_SPLITS ranges (flash-decoding) so that small batches with long contexts
  still fill the GPU; `_merge_splits` combines the partial results by their
  log-sum-exp. The grid depends only on the batch, so CUDA graphs capture it.
  A step laid out a row a token (CUDA graphs' verification steps: AttentionMetadata's
  `row_spans`) has each request's rows read its context once: the first row's program
  takes the run's tokens x G heads as its tile's rows, each row masked to its context up
  to itself, and the programs of the rows after it end at once. Without it each row of a
  verification of k drafts read the whole context, k + 1 reads a request.
Bound: both attention kernels read K/V once per (request, kv head, query tile),
so decode is bound by the cache bytes over HBM bandwidth, which an 8-bit cache
(kv_cache_dtype; kv_cache.py's layout) halves: `write_kv` quantizes each row, `_attend`
reads it in place (the interpreter rounds to fp8 wrongly: CI tests int8 only).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import torch
import triton  # noqa: F401  (the import is the check that Triton is installed: backend_class)

from tokenmill.executor.attention.base import AttentionMetadata, ToDevice, default_to_device
from tokenmill.executor.attention.kv_cache import QMAX, KVCache
from tokenmill.executor.attention.triton_kernels import _chunk_attention, _decode_attention, _merge_splits
from tokenmill.executor.attention.triton_kv_write import write_kv

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_HEAD_DIM = 256
MIN_BLOCK_SIZE = 16
# the most rows a run of one request's rows gives a decode program's tile (runs x G heads):
# the chunk kernel's tile (64 rows), which fits a GPU's registers at every head dim
MAX_RUN_ROWS = 64
LOG2E = 1.4426950408889634


class ChunkWork(NamedTuple):
    """One program per (query tile, kv head): the tile's request and first token in its chunk."""

    req: torch.Tensor  # [W] int32
    q0: torch.Tensor  # [W] int32


class DecodeWork(NamedTuple):
    rows: torch.Tensor  # [D] int32, the decodes' request indices
    num_splits: int
    part_out: torch.Tensor | None  # [D, heads, splits, D_PAD] float32 when split
    part_lse: torch.Tensor | None  # [D, heads, splits] float32
    # a step laid out a row a token (AttentionMetadata.row_spans): the runs of rows one read of
    # a context serves, and the longest (1: every row on its own)
    spans: torch.Tensor | None = None  # [D] int32
    span: int = 1


class TritonPlan(NamedTuple):
    md: AttentionMetadata
    chunks: ChunkWork | None
    decodes: DecodeWork | None


def _quant_mode(quant: bool, dtype: torch.dtype) -> int:
    """_attend's QUANT: 0 a 16-bit or float32 cache, 1 an 8-bit one read in float32, 2 one read in float16."""
    return 0 if not quant else 1 if dtype == torch.float32 else 2


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TritonBackend:
    name = "triton"
    graph_safe = True  # launches depend on the batch size only (executor/cuda_graphs.py)

    def __init__(self, kv_cache: KVCache, block_size: int, num_heads: int, to_device: ToDevice | None = None,
                 num_splits: int | None = None) -> None:
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.kv_heads, self.head_dim = kv_cache.kv_heads, kv_cache.head_dim
        self.num_heads = num_heads
        self.group = self.num_heads // self.kv_heads
        self.to_device = to_device or default_to_device(kv_cache.device)
        self.d_pad = max(16, _pow2(self.head_dim))
        self.scale_log2 = self.head_dim ** -0.5 * LOG2E
        # an 8-bit cache: x / s stored in 8 bits, s per (slot, kv head) beside it (kv_cache.py)
        self.qmax = QMAX.get(kv_cache.dtype, 0.0)
        # a decode's rows are its G heads, padded to the 16 rows a tl.dot needs at least
        self.decode_block_m = max(16, _pow2(self.group))
        # the longest run of rows one program takes (AttentionMetadata.row_spans)
        self.max_span = max(1, MAX_RUN_ROWS // self.group)
        # a chunk tile: BLOCK_Q tokens x G heads; small tiles keep the interpreter fast
        self.chunk_block_m = max(16 if INTERPRET else 64, _pow2(self.group))
        self.chunk_block_q = self.chunk_block_m // self.group
        # keys per loop pass, independent of the block size (each key looks up its block);
        # narrower at head dim 256, where the tile's registers run out
        self.tile_n = 16 if INTERPRET else (32 if self.d_pad >= 256 else 64)
        self.num_warps = 8 if self.d_pad >= 256 else 4
        self.num_stages = 2
        props = torch.cuda.get_device_properties(kv_cache.device) if kv_cache.device.type == "cuda" else None
        # decode's key tile: 128 ran a layer faster alone on an H100 (66 vs 97 us at batch 64 x
        # 512 tokens; benchmarks/triton_decode_tune.py) but not in the engine (its time per step,
        # profiled on two H100 machines: 1.62 vs 1.49 ms at batch 64, 3.52 vs 3.40 at 256)
        self.decode_tile_n = self.tile_n
        self.fixed_splits = num_splits
        self.num_sms = props.multi_processor_count if props is not None else 1
        self.plan: TritonPlan | None = None

    @classmethod
    def check(cls, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int,
              kv_cache_dtype: str = "auto") -> None:
        if kv_cache_dtype.startswith("fp8") and device.type == "cuda" \
                and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} with attention_backend='triton' needs a GPU with "
                             f"fp8 (compute capability 8.9 or later: Ada, Hopper); supported here: auto, int8")
        if device.type != "cuda" and not INTERPRET:
            raise ValueError(f"attention_backend='triton' needs a CUDA device (this engine runs on {device.type}); "
                             f"on the CPU it runs only under Triton's interpreter, TRITON_INTERPRET=1, for tests")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"attention_backend='triton' supports float32, float16 and bfloat16, not {dtype}")
        if not 1 <= head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"attention_backend='triton' supports head dims 1..{MAX_HEAD_DIM} "
                             f"(64, 80, 96, 128, 256, ...), not {head_dim}")
        if block_size < MIN_BLOCK_SIZE or block_size & (block_size - 1):
            raise ValueError(f"attention_backend='triton' supports block_size 16, 32, 64, 128 or 256, "
                             f"not {block_size}")

    # -- planning, once per step ----------------------------------------------
    def begin_step(self, md: AttentionMetadata) -> None:
        decodes = np.flatnonzero(md.query_lens_cpu == 1).astype(np.int32)
        chunks = np.flatnonzero(md.query_lens_cpu > 1)
        chunk_work = None
        if len(chunks):
            tiles = -(-md.query_lens_cpu[chunks] // self.chunk_block_q)
            req = np.repeat(chunks, tiles).astype(np.int32)
            first = np.repeat(np.cumsum(tiles) - tiles, tiles)
            q0 = ((np.arange(len(req)) - first) * self.chunk_block_q).astype(np.int32)
            chunk_work = ChunkWork(self.to_device(req), self.to_device(q0))
        decode_work = None
        if len(decodes):
            runs = md.row_spans is not None and md.max_span > 1 and chunk_work is None  # every row a decode
            if runs and md.max_span > self.max_span:
                raise ValueError(f"runs of {md.max_span} rows: this backend takes at most {self.max_span}")
            # splits planned for the programs that work: a run's first row's (a verification's
            # rows of one request are one program's), so that a step of few requests still fills the GPU
            working = -(-len(decodes) // md.max_span) if runs else len(decodes)
            splits = self.decode_splits(working, int(md.seq_lens_cpu[decodes].max()))
            decode_work = self.decode_work(self.to_device(decodes), splits)
            if runs:
                decode_work = decode_work._replace(spans=md.row_spans, span=md.max_span)
        self.plan = TritonPlan(md, chunk_work, decode_work)

    def decode_splits(self, num_decodes: int, max_seq_len: int) -> int:
        """Enough splits that decodes x kv heads x splits fill the GPU about twice, but no
        split shorter than 4 tiles; a fixed count if one was given."""
        if self.fixed_splits is not None:
            return self.fixed_splits
        want = -(-2 * self.num_sms // (num_decodes * self.kv_heads))
        most = max(1, max_seq_len // (4 * self.decode_tile_n))
        return max(1, min(want, most, 16))

    def decode_work(self, rows: torch.Tensor, num_splits: int) -> DecodeWork:
        if num_splits == 1:
            return DecodeWork(rows, 1, None, None)
        device = self.kv_cache.device
        n = len(rows)
        return DecodeWork(rows, num_splits,
                          torch.empty(n, self.num_heads, num_splits, self.d_pad, dtype=torch.float32, device=device),
                          torch.empty(n, self.num_heads, num_splits, dtype=torch.float32, device=device))

    # -- per layer -------------------------------------------------------------
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        plan = self.plan
        md = plan.md
        k_cache, v_cache, k_scales, v_scales = self.kv_cache.layer(layer)
        quant = k_scales is not None
        k_scales, v_scales = (k_scales, v_scales) if quant else (k_cache, v_cache)  # never read unless quant
        stride_slot, stride_head = k_cache.stride(0), k_cache.stride(1)
        write_kv[(len(k), self.kv_heads)](k, v, k_cache, v_cache, k_scales, v_scales, md.slot_mapping, k.stride(0),
                                          k.stride(1), v.stride(0), v.stride(1), stride_slot, stride_head,
                                          HEAD_DIM=self.head_dim, D_PAD=self.d_pad, QMAX=self.qmax,
                                          ROUND=k_cache.dtype == torch.int8)
        out = torch.empty_like(q)
        # float32 must not drop to tf32 (parity); 16-bit operands take the default
        common = dict(BLOCK_SIZE=self.block_size, TILE_N=self.tile_n, HEAD_DIM=self.head_dim, D_PAD=self.d_pad,
                      UPCAST=INTERPRET and q.dtype == torch.bfloat16, QUANT=_quant_mode(quant, q.dtype),
                      PRECISION="ieee" if q.dtype == torch.float32 else None, num_warps=self.num_warps,
                      num_stages=self.num_stages)
        if plan.chunks is not None:
            work = plan.chunks
            _chunk_attention[(len(work.req), self.kv_heads)](
                out, q, k_cache, v_cache, k_scales, v_scales, md.block_table, work.req, work.q0, md.query_start_loc,
                md.seq_lens, self.scale_log2, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                md.block_table.stride(0),
                stride_slot, stride_head, G=self.group, BLOCK_M=self.chunk_block_m, BLOCK_Q=self.chunk_block_q,
                **common)
        if plan.decodes is not None:
            d = plan.decodes
            n = len(d.rows)
            _decode_attention[(n, self.kv_heads, d.num_splits)](
                out, d.part_out, d.part_lse, q, k_cache, v_cache, k_scales, v_scales, md.block_table, d.rows,
                d.rows if d.spans is None else d.spans, md.query_start_loc, md.seq_lens, self.scale_log2,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1), md.block_table.stride(0), stride_slot,
                stride_head, G=self.group, BLOCK_M=max(self.decode_block_m, _pow2(d.span * self.group)),
                SPAN=d.span, NUM_SPLITS=d.num_splits, **{**common, "TILE_N": self.decode_tile_n})
            if d.num_splits > 1:
                _merge_splits[(n, self.num_heads)](out, d.part_out, d.part_lse, d.rows, md.query_start_loc,
                                                   out.stride(0), out.stride(1), NUM_SPLITS=d.num_splits,
                                                   SPLITS_PAD=_pow2(d.num_splits), HEAD_DIM=self.head_dim,
                                                   D_PAD=self.d_pad)
        return out
