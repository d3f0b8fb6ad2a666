"""CUDA graphs for decode-only steps: captured at start-up, one per batch-size bucket.

Buckets are 1, 2, 4, 8, then steps of 8 up to max_num_seqs (vLLM's). A step of n
decodes copies its inputs into static buffers, padded to the next bucket (padding
tokens have slot -1, so their K/V are not written, and a context of 0 tokens), and
replays that bucket's graph: the whole forward, one launch from the host, instead
of several hundred. Graphs share one memory pool; the largest is captured first,
so the smaller ones fit in its memory. Logits and sampling run outside the graph.

Only a backend whose launches depend on nothing but the batch size can be captured
(`graph_safe`): the Triton backend, whose decode grid is (decodes, kv heads, splits)
with the split count fixed per bucket.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from tokenmill.executor.attention import AttentionMetadata

if TYPE_CHECKING:
    from tokenmill.executor.model_runner import ModelRunner

logger = logging.getLogger("tokenmill")


def graph_buckets(max_batch_size: int) -> list[int]:
    buckets = [b for b in (1, 2, 4) if b < max_batch_size] + list(range(8, max_batch_size + 8, 8))
    return sorted({min(b, max_batch_size) for b in buckets})


def _padded(array: np.ndarray, pad: int, fill: int = 0) -> np.ndarray:
    """array with `pad` more rows of `fill` (np.pad's Python costs more than the copy)."""
    if pad == 0:
        return array
    out = np.empty((len(array) + pad, *array.shape[1:]), dtype=array.dtype)
    out[:len(array)] = array
    out[len(array):] = fill
    return out


class EagerReplay:
    """A stand-in for a CUDA graph where there is no CUDA: replay re-runs the forward on the
    same static buffers and plan, so the buffer, padding and bucket logic runs in the CPU
    tests (Triton under its interpreter) exactly as it feeds a captured graph."""

    def __init__(self, model, ids: torch.Tensor, positions: torch.Tensor, attn, hidden: torch.Tensor) -> None:
        self.model, self.ids, self.positions, self.attn, self.hidden = model, ids, positions, attn, hidden
        self.plan = attn.plan

    @torch.inference_mode()
    def replay(self) -> None:
        self.attn.plan = self.plan
        self.hidden.copy_(self.model(self.ids, self.positions, self.attn))


class CapturedGraph(NamedTuple):
    graph: torch.cuda.CUDAGraph | EagerReplay
    hidden: torch.Tensor  # the forward's output buffer, [bucket, hidden]
    plan: object  # the backend's plan tensors the graph reads: kept alive with it


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner, max_batch_size: int) -> None:
        self.runner = weakref.proxy(runner)  # the runner owns this; no cycle keeps a dead engine's memory
        self.buckets = graph_buckets(max_batch_size)
        b = self.buckets[-1]
        max_blocks = -(-runner.max_model_len // runner.block_size)
        with torch.device(runner.device):
            self.input_ids = torch.zeros(b, dtype=torch.int64)
            self.positions = torch.zeros(b, dtype=torch.int64)
            self.slot_mapping = torch.full((b,), -1, dtype=torch.int64)
            self.seq_lens = torch.zeros(b, dtype=torch.int32)
            self.query_start_loc = torch.arange(b + 1, dtype=torch.int32)
            self.block_table = torch.zeros(b, max_blocks, dtype=torch.int32)
        self.graphs: dict[int, CapturedGraph] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def capture(self) -> None:
        if not getattr(self.runner.attn, "graph_safe", False):
            logger.info("CUDA graphs off: attention backend %r cannot be captured", self.runner.attn.name)
            self.buckets = []
            return
        device = self.runner.device
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0] if cuda else 0
        pool = torch.cuda.graph_pool_handle() if cuda else None
        try:
            for b in reversed(self.buckets):
                self.graphs[b] = self._capture(b, pool)
        except torch.OutOfMemoryError as e:
            raise ValueError("CUDA ran out of memory while capturing CUDA graphs; lower gpu_memory_utilization "
                             "(the KV cache takes that share of the device), or pass enforce_eager") from e
        if cuda:
            torch.cuda.synchronize(device)
            self.capture_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (batch sizes %d..%d) in %.1fs, %.0f MiB", len(self.graphs),
                    self.buckets[0], self.buckets[-1], self.capture_seconds, self.capture_bytes / 2**20)

    @torch.inference_mode()
    def _capture(self, b: int, pool) -> CapturedGraph:
        runner = self.runner
        attn, model = runner.attn, runner.model
        md = AttentionMetadata(
            query_start_loc=self.query_start_loc[:b + 1], seq_lens=self.seq_lens[:b],
            block_table=self.block_table[:b], slot_mapping=self.slot_mapping[:b],
            query_start_loc_cpu=np.arange(b + 1, dtype=np.int32), query_lens_cpu=np.ones(b, dtype=np.int32),
            # the split count is planned for the longest context the bucket may see
            seq_lens_cpu=np.full(b, runner.max_model_len, dtype=np.int32),
            block_table_cpu=np.zeros((b, self.block_table.shape[1]), dtype=np.int32),
            block_size=runner.block_size)
        runner.staging.begin()
        attn.begin_step(md)  # outside the capture: the plan's tensors are made once, then only read
        runner.staging.end()
        ids, positions = self.input_ids[:b], self.positions[:b]
        hidden = model(ids, positions, attn)  # warm-up: Triton compiles, cuBLAS picks its kernels
        if runner.device.type != "cuda":
            return CapturedGraph(EagerReplay(model, ids, positions, attn, hidden), hidden, attn.plan)
        torch.cuda.synchronize(runner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = model(ids, positions, attn)
        return CapturedGraph(graph, hidden, attn.plan)

    def can_run(self, query_lens: np.ndarray) -> bool:
        return bool(self.buckets) and len(query_lens) <= self.buckets[-1] and int(query_lens.max()) == 1

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, seq_lens: np.ndarray,
            block_table: np.ndarray, fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One decode step of len(input_ids) requests; returns their hidden states. `fill`:
        (positions, token ids) on the device, put into the input ids after the copy."""
        n = len(input_ids)
        b = next(x for x in self.buckets if x >= n)
        pad = b - n
        put = self.runner.staging.to_device
        put(_padded(input_ids, pad), out=self.input_ids[:b])
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        put(_padded(positions, pad), out=self.positions[:b])
        put(_padded(slot_mapping, pad, -1), out=self.slot_mapping[:b])
        put(_padded(seq_lens, pad), out=self.seq_lens[:b])
        put(_padded(block_table, pad), out=self.block_table[:b, :block_table.shape[1]])
        captured = self.graphs[b]
        captured.graph.replay()
        return captured.hidden[:n]
