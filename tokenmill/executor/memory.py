"""How many KV blocks the cache gets.

CPU: `kv_cache_memory` bytes, by default no more than every running sequence at
full length could use, capped at 2 GiB.

CUDA (vLLM's method): one profiling forward at the largest step the budget allows
(max_num_batched_tokens tokens over up to max_num_seqs requests, then logits and
sampling for max_num_seqs rows) measures the peak activation memory. The cache
then takes `gpu_memory_utilization` of the device minus the weights, that peak and
what other processes and the CUDA context hold. A drafter is built after the cache, so
what it will hold besides its share of the blocks is counted before (`drafter_bytes`):
its weights from its checkpoint, its rotary table, its LM head cut to a token map, its
scratch blocks.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.executor.attention import AttentionMetadata, token_slots
from tokenmill.executor.loader import safetensors_files
from tokenmill.executor.sampler import SamplingBatch
from tokenmill.executor.spec.checkpoint import skipped_tensors
from tokenmill.executor.spec.vocab import load_token_map, token_map_file

if TYPE_CHECKING:
    from tokenmill.config import ModelConfig, SpeculativeConfig
    from tokenmill.executor.model_runner import ModelRunner

logger = logging.getLogger("tokenmill")

DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 1024**3


def num_kv_blocks(runner: ModelRunner, max_num_batched_tokens: int) -> int:
    config = runner.config
    per_token = runner.model_config.kv_bytes_per_token(runner.kv_cache_dtype) + runner.draft_kv_bytes_per_token
    per_block = per_token * runner.block_size
    if runner.device.type == "cuda":
        if config.num_gpu_blocks_override is not None:
            return config.num_gpu_blocks_override
        budget = _cuda_kv_budget(runner, max_num_batched_tokens)
        if budget < per_block:
            raise ValueError(f"gpu_memory_utilization={config.gpu_memory_utilization} leaves no room for the KV "
                             f"cache once weights and activations are in place; raise gpu_memory_utilization")
    else:
        usable = config.max_num_seqs * (-(-runner.max_model_len // runner.block_size)) * per_block
        budget = config.kv_cache_memory or min(DEFAULT_CPU_KV_CACHE_MEMORY, usable)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory={budget} bytes is less than one KV block ({per_block} bytes)")
    return int(num_blocks)


def checkpoint_bytes(path: Path, dtype: torch.dtype, skipped: tuple[str, ...] = ()) -> int:
    """What a checkpoint's tensors take once loaded in `dtype`, from its safetensors headers
    (no tensor is read), less those the model skips (`skipped`: names without "model.")."""
    from safetensors import safe_open

    numel = 0
    for f in safetensors_files(Path(path)):
        with safe_open(str(f), framework="pt") as st:
            numel += sum(math.prod(st.get_slice(name).get_shape()) for name in st.keys()
                         if name.removeprefix("model.") not in skipped)
    return numel * dtype.itemsize


def scratch_blocks_per_row(num_speculative_tokens: int, block_size: int) -> int:
    """A drafter's scratch blocks for each drafting request, past its last block: room for the
    K/V of its k + 1 draft positions wherever in a block they start."""
    return (num_speculative_tokens + 1) // block_size + 2


def drafter_bytes(spec: SpeculativeConfig, path: Path, draft: ModelConfig, dtype: torch.dtype,
                  kv_cache_dtype: torch.dtype, block_size: int, max_num_seqs: int, max_model_len: int) -> int:
    """What a drafter (spec/draft.py) holds besides its K/V in the shared blocks: the weights it
    loads, counted from its checkpoint's headers; its rotary table (float32, a row a position);
    its LM head cut to a token map, if any; and its scratch blocks, a row of them for each of up
    to max_num_seqs drafting requests."""
    weights = checkpoint_bytes(path, dtype, skipped_tensors(spec, draft))
    weights += max(max_model_len, draft.max_position_embeddings) * draft.head_dim * 4
    head = 0
    if (token_map := token_map_file(spec, path)) is not None:
        head = len(load_token_map(token_map, draft.vocab_size)) * draft.hidden_size * dtype.itemsize
    scratch = max_num_seqs * scratch_blocks_per_row(spec.num_speculative_tokens, block_size) * block_size
    return weights + head + scratch * draft.kv_bytes_per_token(kv_cache_dtype)


def _cuda_kv_budget(runner: ModelRunner, max_tokens: int) -> int:
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device) - runner.memory_baseline
    torch.cuda.reset_peak_memory_stats(device)
    try:
        profile_forward(runner, max_tokens)
    except torch.OutOfMemoryError as e:
        raise ValueError(f"CUDA ran out of memory in the profiling forward of {max_tokens} tokens; lower "
                         f"max_num_batched_tokens or max_num_seqs, or raise gpu_memory_utilization") from e
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights - runner.memory_baseline
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # memory in use that torch's allocator does not hold: the CUDA context, other processes
    non_torch = total - free - torch.cuda.memory_reserved(device)
    # this engine's share, as in vLLM (another engine in the process has its own), and never
    # more than is free once the activations have room; a drafter (speculative decoding) is
    # built after the cache, so its room is kept here
    weights += runner.draft_bytes
    budget = min(int(total * runner.config.gpu_memory_utilization) - weights - peak - non_torch,
                 free - peak - runner.draft_bytes)
    runner.profile = {"weights_bytes": weights, "peak_activation_bytes": peak, "non_torch_bytes": non_torch,
                      "kv_budget_bytes": budget}
    logger.info("memory profile: weights %.2f GiB, peak activations %.2f GiB at %d tokens, other %.2f GiB; "
                "KV cache gets %.2f GiB of %.1f GiB x %.2f", weights / 2**30, peak / 2**30, max_tokens,
                non_torch / 2**30, budget / 2**30, total / 2**30, runner.config.gpu_memory_utilization)
    return budget


@torch.inference_mode()
def profile_forward(runner: ModelRunner, max_tokens: int) -> None:
    """The largest step: max_tokens prompt tokens over up to max_num_seqs requests, over a
    throwaway cache just large enough, then logits and top-p sampling for max_num_seqs rows."""
    bs = runner.block_size
    num_seqs = max(1, min(runner.config.max_num_seqs, max_tokens))
    query_lens = np.full(num_seqs, max_tokens // num_seqs, dtype=np.int32)
    query_lens[: max_tokens % num_seqs] += 1
    width = -(-int(query_lens.max()) // bs)
    block_table = np.arange(num_seqs * width, dtype=np.int32).reshape(num_seqs, width)
    positions, slots = token_slots(query_lens, np.zeros(num_seqs, dtype=np.int64), block_table, bs)
    backend = runner.make_backend(runner.allocate_kv_cache(num_seqs * width))
    put = runner.staging.to_device
    runner.staging.begin()
    backend.begin_step(AttentionMetadata.from_host(query_lens, query_lens.copy(), block_table, put(slots), bs, put))
    hidden = runner.model(put(np.zeros(len(positions), dtype=np.int64)), put(positions), backend)
    rows = min(runner.config.max_num_seqs, len(hidden))
    logits = runner.model.compute_logits(hidden[:rows])
    n = len(logits)
    batch = SamplingBatch(temperature=torch.ones(n, device=runner.device), top_k=None,
                          top_p=torch.full((n,), 0.9, device=runner.device), min_p=None, all_greedy=False,
                          seeds=[], unseeded_rows=torch.arange(n, device=runner.device), banned=None,
                          num_logprobs=[None] * n, max_logprobs=-1)
    runner.sampler(logits, batch)
    runner.staging.end()
