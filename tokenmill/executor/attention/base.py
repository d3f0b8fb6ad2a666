"""The attention interface: canonical per-step metadata and the backend protocol.

Tokens of all scheduled requests are flattened into one sequence of T tokens.
Request i owns query tokens [query_start_loc[i], query_start_loc[i+1]); after
this step its context holds seq_lens[i] tokens, the last query_len of them new.
Token t's K/V go to cache slot slot_mapping[t] = block_id * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context length after this step
    block_table: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64
    # the same numbers on the host, so that backends can plan without a device sync
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int


class AttentionBackend(Protocol):
    """Owns the paged KV cache of every layer. `begin_step` is called once per step
    with that step's metadata; the model then calls the backend once per layer."""

    def begin_step(self, metadata: AttentionMetadata) -> None: ...

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """q: [T, heads, d]; k, v: [T, kv_heads, d] for the new tokens. Writes k, v into the
        cache, attends each request's queries over its whole context; returns [T, heads, d]."""
        ...
