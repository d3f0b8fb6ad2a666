"""The attention interface: canonical per-step metadata, the backend protocol, the registry.

Tokens of all scheduled requests are flattened into one sequence of T tokens.
Request i owns query tokens [query_start_loc[i], query_start_loc[i+1]); after
this step its context holds seq_lens[i] tokens, the last query_len of them new.
Token t's K/V go to cache slot slot_mapping[t] = block_id * block_size + offset
(-1: a padding token whose K/V are not kept, as in a CUDA-graph batch).

Backends (`auto | cpu | torch | triton`) are chosen once, when the engine is
built, and checked then against the device, dtype, head dim and block size.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

logger = logging.getLogger("tokenmill")

# host array -> the same values in a device tensor; the runner's goes through a pinned buffer
ToDevice = Callable[[np.ndarray], torch.Tensor]


def default_to_device(device: torch.device) -> ToDevice:
    return lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context length after this step
    block_table: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64
    # the same numbers on the host, so that backends plan without a device sync
    query_start_loc_cpu: np.ndarray  # [B + 1] int32
    query_lens_cpu: np.ndarray  # [B] int32
    seq_lens_cpu: np.ndarray  # [B] int32
    block_table_cpu: np.ndarray  # [B, max_blocks] int32
    block_size: int
    # a step laid out a row a token (`token_rows`: CUDA graphs' verification steps): for the first
    # row of each run of up to `max_span` rows of one request, the run's length, 0 for the rows
    # after it (`row_spans`). A backend may read each run's context once for all its rows,
    # each row seeing its context up to itself. None: every row attends on its own.
    row_spans: torch.Tensor | None = None  # [B] int32
    max_span: int = 1

    @classmethod
    def from_host(cls, query_lens: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
                  slot_mapping: torch.Tensor, block_size: int, to_device: ToDevice) -> "AttentionMetadata":
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        return cls(to_device(query_start_loc), to_device(seq_lens), to_device(block_table), slot_mapping,
                   query_start_loc, query_lens, seq_lens, block_table, block_size)


def token_slots(query_lens: np.ndarray, num_computed: np.ndarray, block_table: np.ndarray,
                block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions and cache slots (int64) of a step's flattened tokens: request i's
    query_lens[i] tokens sit at positions num_computed[i], num_computed[i] + 1, ..."""
    req = np.repeat(np.arange(len(query_lens)), query_lens)  # the request of each token
    first = (np.cumsum(query_lens) - query_lens)[req]  # its first token in the step
    positions = num_computed.astype(np.int64)[req] + np.arange(len(req)) - first
    slots = block_table[req, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return positions, slots


def token_rows(block_table: np.ndarray, query_lens: np.ndarray) -> np.ndarray:
    """Each of a step's flattened tokens' request's row of `block_table`: the step laid out a row
    a token, each attending to its context up to itself (the one-call forwards, the graphs'
    verification rows)."""
    return block_table[np.repeat(np.arange(len(query_lens)), query_lens)]


def row_slots(table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slots (int64) of a step laid out a row a token: row i's token at positions[i]
    over its block table row table[i] (token_slots' answer there, without its general form's
    numpy calls)."""
    return table[np.arange(len(positions)), positions // block_size].astype(np.int64) * block_size \
        + positions % block_size


def row_spans(query_lens: np.ndarray, max_span: int) -> np.ndarray:
    """The `row_spans` of a step laid out a row a token (`token_rows`): each request's rows in
    runs of at most `max_span`, each run's length on its first row, 0 on the others."""
    n = int(query_lens.sum())
    first = np.cumsum(query_lens) - query_lens  # each request's first row
    since = np.arange(n) - np.repeat(first, query_lens)  # a row's place in its request
    left = np.repeat(query_lens, query_lens) - since  # its request's rows from it on
    return np.where(since % max_span == 0, np.minimum(left, max_span), 0).astype(np.int32)


class AttentionBackend(Protocol):
    """Owns the paged KV cache of every layer. `begin_step` is called once per step
    with that step's metadata; the model then calls the backend once per layer."""

    name: str

    def begin_step(self, metadata: AttentionMetadata) -> None: ...

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """q: [T, heads, d]; k, v: [T, kv_heads, d] for the new tokens. Writes k, v into the
        cache, attends each request's queries over its whole context; returns [T, heads, d]."""
        ...


# name -> (module, class); imported on use, so that no Triton is needed to serve on the CPU
ATTENTION_BACKENDS = {
    "cpu": ("tokenmill.executor.attention.cpu", "CpuBackend"),
    "torch": ("tokenmill.executor.attention.torch_ref", "TorchBackend"),
    "triton": ("tokenmill.executor.attention.triton", "TritonBackend"),
}


def backend_class(name: str) -> type:
    module, cls = ATTENTION_BACKENDS[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:  # triton not installed
        raise ValueError(f"attention_backend={name!r} cannot be used: {e}") from e


def select_attention_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                             block_size: int, kv_cache_dtype: str = "auto") -> type:
    """The backend class for `name` (auto: triton on CUDA, cpu on the CPU, torch on a CPU
    where the native kernels could not be built), checked against what it will run."""
    if name not in ("auto", *ATTENTION_BACKENDS):
        raise ValueError(f"attention_backend must be one of auto, {', '.join(ATTENTION_BACKENDS)}; got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
        if name == "cpu":
            from tokenmill.executor.cpu_kernels import load_cpu_kernels
            if load_cpu_kernels() is None:
                name = "torch"
    cls = backend_class(name)
    cls.check(device, dtype, head_dim, block_size, kv_cache_dtype)
    return cls
