"""Paged attention in plain PyTorch: gather K/V through the block table, then attend.

The reference backend, and the CPU one. The cache of a layer is
[num_blocks * block_size, kv_heads, head_dim], so one block is one contiguous
row of block_size * kv_heads * head_dim values and gathers move whole blocks.

- Multi-token chunks (prompts, later chunks of a long prompt, the rest of a
  prompt after a prefix hit) in bfloat16 on a CPU with AVX512-BF16 go to a native
  kernel that reads their whole context in place, one call per layer for all of
  them (executor/csrc/prefill_attention.cpp).
- Otherwise a chunk with nothing cached before it attends over its own new K/V
  (no gather, plain causal SDPA), and other chunks gather their context and use
  a causal mask aligned to its end.
- Decodes (one query token) on the CPU go to a native kernel that reads K/V
  in place through the block table (executor/cpu_kernels.py) when it could be built.
  Otherwise they run batched in torch: sorted by context length and split into
  groups so that little is padded, each group gathered once into a reused
  buffer and attended by SDPA, each kv head's query group playing the role of
  that head's query length, so GQA needs no K/V copies.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from tokenmill.executor.attention.base import AttentionMetadata

# a decode group is split when a shorter context would pad it by more than this fraction
_GROUP_PAD_RATIO = 0.6
_MIN_GROUP = 8


class TorchNativeBackend:
    def __init__(self, kv_cache: torch.Tensor, block_size: int, kernels: Any = None) -> None:
        # kv_cache: [num_layers, 2, num_blocks * block_size, kv_heads, head_dim]
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.kv_heads, self.head_dim = kv_cache.shape[-2:]
        self.block_numel = block_size * self.kv_heads * self.head_dim
        self._workspace = torch.empty(0, dtype=kv_cache.dtype, device=kv_cache.device)
        self.kernels = kernels  # the native CPU kernels (write_kv, paged_*_attention) or None
        self.prefill_kernel = (kernels is not None and kernels.has_bf16_prefill_attention
                               and kv_cache.dtype == torch.bfloat16 and self.head_dim in (64, 128))
        self.md: AttentionMetadata | None = None

    def begin_step(self, md: AttentionMetadata) -> None:
        self.md = md
        device = md.slot_mapping.device
        bs = self.block_size
        starts = _cumsum(md.query_lens_cpu)
        decode = [i for i, n in enumerate(md.query_lens_cpu) if n == 1]
        self.decode_groups = []
        self.kernel_decodes = None
        if decode and self.kernels is not None:
            rows = torch.tensor(decode, dtype=torch.long, device=device)
            max_blocks = -(-max(md.seq_lens_cpu[i] for i in decode) // bs)
            self.kernel_decodes = (torch.tensor([starts[i] for i in decode], dtype=torch.long, device=device),
                                   md.block_table[rows, :max_blocks].contiguous(), md.seq_lens[rows].contiguous())
            decode = []
        decode.sort(key=lambda i: -md.seq_lens_cpu[i])
        for group in _split_groups(decode, md.seq_lens_cpu):
            rows = torch.tensor(group, dtype=torch.long, device=device)
            max_len = md.seq_lens_cpu[group[0]]
            num_blocks = -(-max_len // bs)
            blocks = md.block_table[rows, :num_blocks].reshape(-1).long()
            valid = torch.arange(num_blocks * bs, device=device)[None, :] < md.seq_lens[rows, None]
            tokens = torch.tensor([starts[i] for i in group], dtype=torch.long, device=device)
            self.decode_groups.append((tokens, blocks, valid[:, None, None, :], num_blocks * bs))
        self.prefills = []
        self.kernel_prefills = None
        chunks = [i for i, n in enumerate(md.query_lens_cpu) if n > 1]
        if chunks and self.prefill_kernel:
            rows = torch.tensor(chunks, dtype=torch.long, device=device)
            max_blocks = -(-max(md.seq_lens_cpu[i] for i in chunks) // bs)
            self.kernel_prefills = (md.block_table[rows, :max_blocks].contiguous(), md.seq_lens[rows].contiguous(),
                                    torch.tensor([starts[i] for i in chunks], dtype=torch.int32),
                                    torch.tensor([md.query_lens_cpu[i] for i in chunks], dtype=torch.int32))
            chunks = []
        for i in chunks:
            n, seq_len = md.query_lens_cpu[i], md.seq_lens_cpu[i]
            blocks = mask = None
            if seq_len > n:  # queries sit at the end of the context: bottom-right causal mask
                num_blocks = -(-seq_len // bs)
                blocks = md.block_table[i, :num_blocks].long()
                q_pos = torch.arange(seq_len - n, seq_len, device=device)
                mask = torch.arange(num_blocks * bs, device=device)[None, :] <= q_pos[:, None]
            self.prefills.append((starts[i], starts[i] + n, blocks, mask))
        need = max([len(g[1]) for g in self.decode_groups] + [len(p[2]) for p in self.prefills if p[2] is not None]
                   + [0])
        if 2 * need * self.block_numel > self._workspace.numel():
            # reused across steps and layers: fresh multi-MB buffers would cost page faults each call
            self._workspace = torch.empty(2 * need * self.block_numel, dtype=self.kv_cache.dtype, device=device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        md = self.md
        k_cache, v_cache = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        if self.kernels is not None:  # one call for both, on k and v as they are (views of qkv)
            self.kernels.write_kv(k, v, k_cache, v_cache, md.slot_mapping)
        else:
            k_cache.index_copy_(0, md.slot_mapping, k)
            v_cache.index_copy_(0, md.slot_mapping, v)
        num_heads = q.shape[1]
        out = torch.empty_like(q)
        if self.kernel_decodes is not None:
            tokens, block_table, seq_lens = self.kernel_decodes
            only_decodes = len(tokens) == len(q)  # most steps: write straight into out
            qd = q if only_decodes else q.index_select(0, tokens)  # the kernel takes strided rows
            od = out if only_decodes else torch.empty_like(qd)
            self.kernels.paged_decode_attention(od, qd, k_cache, v_cache, block_table, seq_lens,
                                                      self.block_size, self.head_dim ** -0.5)
            if not only_decodes:
                out.index_copy_(0, tokens, od)
        if self.kernel_prefills is not None:  # writes the chunks' rows of out
            self.kernels.paged_prefill_attention(out, q, k_cache, v_cache, *self.kernel_prefills, self.block_size,
                                                 self.head_dim ** -0.5)
        for tokens, blocks, mask, length in self.decode_groups:
            kd, vd = self._gather(k_cache, v_cache, blocks, length)
            b = len(tokens)
            qd = q.index_select(0, tokens).view(b, self.kv_heads, num_heads // self.kv_heads, self.head_dim)
            od = F.scaled_dot_product_attention(qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=mask)
            out.index_copy_(0, tokens, od.view(b, num_heads, self.head_dim))
        for start, end, blocks, mask in self.prefills:
            # [1, heads, tokens, d]: with a batch dimension SDPA takes its flash kernel on the
            # CPU (GQA included), 2x faster than its math path at 200 tokens, 4x at 1024
            qp = q[start:end].transpose(0, 1)[None]
            if blocks is None:
                kp, vp = k[start:end].transpose(0, 1)[None], v[start:end].transpose(0, 1)[None]
            else:
                kp, vp = self._gather(k_cache, v_cache, blocks, len(blocks) * self.block_size)
                kp, vp = kp.transpose(1, 2), vp.transpose(1, 2)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None,
                                                enable_gqa=num_heads != self.kv_heads)
            out[start:end] = op[0].transpose(0, 1)
        return out

    def _gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, length: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks as [B, length, kv_heads, d], B = blocks / (length / block_size)."""
        n = blocks.numel() * self.block_numel
        out = []
        for i, cache in enumerate((k_cache, v_cache)):
            raw = torch.index_select(cache.view(-1, self.block_numel), 0, blocks,
                                     out=self._workspace[i * n:(i + 1) * n].view(-1, self.block_numel))
            out.append(raw.view(-1, length, self.kv_heads, self.head_dim))
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


def _cumsum(lens: list[int]) -> list[int]:
    out, total = [], 0
    for n in lens:
        out.append(total)
        total += n
    return out
