"""Tensor parallelism (Megatron-LM's split, as vLLM and SGLang do it): which part of the model
each rank holds, and the collectives that join the parts.

    qkv_proj, gate_up_proj   column parallel: rank r holds its heads' / its slice's output rows
    o_proj, down_proj        row parallel: rank r holds the matching input columns; the
                             partial sums are all-reduced (one after attention, one after the MLP)
    embed_tokens, lm_head    vocabulary parallel: rank r holds ceil(V / N) rows of the vocabulary;
                             the embedding all-reduces, the head's logits are all-gathered

KV heads are split like the query heads; when there are fewer KV heads than ranks, each rank
keeps a copy of the one its query heads read (rank r: KV head r * num_kv_heads // N).
Everything else (norms, rotary, the residual stream) is computed on every rank in full.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from tokenmill.config import ModelConfig


@dataclass
class TensorParallel:
    """This process's place in the tensor-parallel group (the default torch.distributed group)."""

    rank: int
    size: int
    device: torch.device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dimension."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values (the KV blocks every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[start, start + rows) of the vocabulary this rank holds (the last rank's padded)."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows

    def kv_head_start(self, num_kv_heads: int) -> int:
        return self.rank * num_kv_heads // self.size


def check_tensor_parallel(mc: ModelConfig, size: int, device: torch.device) -> None:
    """Start-up errors for a size the model or the CUDA devices cannot split, naming the flag
    (the CPU cores are checked where they are split: split_cpus)."""
    flag = "tensor_parallel_size"
    if mc.num_heads % size:
        raise ValueError(f"{flag}={size} does not divide the model's {mc.num_heads} attention heads")
    if mc.num_kv_heads % size and size % mc.num_kv_heads:
        raise ValueError(f"{flag}={size} and the model's {mc.num_kv_heads} KV heads: one must divide the other")
    if mc.intermediate_size % size:
        raise ValueError(f"{flag}={size} does not divide the model's intermediate size {mc.intermediate_size}")
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"{flag}={size} exceeds the {torch.cuda.device_count()} CUDA devices torch sees")


def shard_model_config(mc: ModelConfig, size: int) -> ModelConfig:
    """The shapes one rank computes: its heads, its KV heads, its slice of the MLP."""
    if size == 1:
        return mc
    return dataclasses.replace(mc, num_heads=mc.num_heads // size, num_kv_heads=max(1, mc.num_kv_heads // size),
                               intermediate_size=mc.intermediate_size // size)


def split_cpus(size: int, num_threads: int | None, flag: str) -> list[list[int]]:
    """Each process's cores: the allowed ones (or the first `num_threads` of them) in equal
    slices, one at least each; raises ValueError naming `flag` when there are too few."""
    allowed = sorted(os.sched_getaffinity(0))
    total = num_threads or len(allowed)
    if total > len(allowed):
        raise ValueError(f"--num-threads {total} exceeds the {len(allowed)} cores this process may use")
    if size > total:
        raise ValueError(f"{flag} {size} exceeds the {total} cores to split (each process needs one at least)")
    per = total // size
    return [allowed[i * per:(i + 1) * per] for i in range(size)]


class ColumnShard:
    """A column-parallel layer's rows on this rank: for each fused shard (q, k, v / gate, up;
    "" for a plain layer), (start, size) in the checkpoint tensor. Rows past the checkpoint's
    end (the padded end of a split vocabulary) are zeros."""

    def __init__(self, rows: dict[str, tuple[int, int]]) -> None:
        self.rows = rows

    def narrow(self, param_name: str, shard: str, tensor: torch.Tensor) -> torch.Tensor:
        start, size = self.rows[shard]
        if tensor.dim() == 0:  # a per-tensor scale: the same on every rank
            return tensor
        part = tensor[start:start + size]
        if len(part) < size:
            part = torch.cat([part, part.new_zeros((size - len(part), *part.shape[1:]))])
        return part


class RowShard:
    """A row-parallel layer's input columns [start, start + size) on this rank. Its bias is
    added once, by rank 0, so that the all-reduce sums it once."""

    def __init__(self, rank: int, start: int, size: int) -> None:
        self.rank, self.start, self.size = rank, start, size

    def narrow(self, param_name: str, shard: str, tensor: torch.Tensor) -> torch.Tensor:
        if param_name == "bias":
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if tensor.dim() == 2:
            return tensor[:, self.start:self.start + self.size]
        return tensor


def attention_shards(tp: TensorParallel, full: ModelConfig) -> tuple[ColumnShard, RowShard]:
    """qkv_proj's rows and o_proj's columns on this rank."""
    d = full.head_dim
    q = full.num_heads // tp.size * d
    kv = max(1, full.num_kv_heads // tp.size) * d
    kv_start = tp.kv_head_start(full.num_kv_heads) * d
    return (ColumnShard({"q": (tp.rank * q, q), "k": (kv_start, kv), "v": (kv_start, kv)}),
            RowShard(tp.rank, tp.rank * q, q))


def mlp_shards(tp: TensorParallel, full: ModelConfig) -> tuple[ColumnShard, RowShard]:
    """gate_up_proj's rows and down_proj's columns on this rank."""
    n = full.intermediate_size // tp.size
    return ColumnShard({"gate": (tp.rank * n, n), "up": (tp.rank * n, n)}), RowShard(tp.rank, tp.rank * n, n)


class VocabParallelEmbedding(nn.Module):
    """The embedding rows [start, start + rows) of the vocabulary; a token another rank holds
    looks up zeros here, and the all-reduce gives every rank every token's row."""

    def __init__(self, tp: TensorParallel, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.rows = tp.vocab_range(vocab_size)
        self.shard = ColumnShard({"": (self.start, self.rows)})
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        x = F.embedding(local.clamp(0, self.rows - 1), self.weight)
        return self.tp.all_reduce(x.masked_fill_(~mine.unsqueeze(-1), 0.0))
