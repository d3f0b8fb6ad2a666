"""CUDA graphs for decode-shaped steps: captured at start-up, one per bucket of rows.

Buckets are 1, 2, 4, 8, then steps of 8 up to 256 and of 16 above (vLLM's), up to
max_num_seqs rows. A step of n decodes copies its inputs into static buffers, padded
to the next bucket (padding tokens have slot -1, so their K/V are not written, and a
context of 0 tokens), and replays that bucket's graph: the whole forward, one launch
from the host, instead of several hundred. Graphs share one memory pool; the largest is
captured first, so the smaller ones fit in its memory. Logits and sampling run outside
the graph.

With speculative decoding a step verifies up to k drafts a request: a query of up to
k + 1 tokens (`max_query`). Such a step replays the same graphs with each token a row
of its own, its request's block table row and a context up to itself (as the decode
rows of a short query are in the CPU backend): each layer writes every row's K/V before
its attention reads them, so a row sees the rows before it. A static `row_spans` buffer
marks each request's run of rows, so that the attention reads its context once for the
run (attention/triton.py), not once a row. The buckets then go up to
max_num_seqs x max_query rows (at most SPEC_ROWS and the step's token budget, never fewer
than max_num_seqs); a longer step runs eagerly. Prompt chunks no longer than max_query go
the same way.

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

from tokenmill.executor.attention import AttentionMetadata, row_spans, token_rows

if TYPE_CHECKING:
    from tokenmill.executor.model_runner import ModelRunner
    from tokenmill.executor.spec.draft import DraftModel

logger = logging.getLogger("tokenmill")


# the most rows a graph takes for verification steps (vLLM captures up to 512 tokens by default)
SPEC_ROWS = 512


def graph_buckets(max_batch_size: int) -> list[int]:
    buckets = [b for b in (1, 2, 4) if b < max_batch_size] + list(range(8, min(max_batch_size, 256) + 8, 8)) + \
        list(range(272, max_batch_size + 16, 16))
    return sorted({min(b, max_batch_size) for b in buckets})


def graph_rows(max_num_seqs: int, max_query: int, max_tokens: int = SPEC_ROWS) -> int:
    """The rows of the largest bucket: a decode a request, or with queries of up to
    `max_query` tokens (verification), a row a token, within SPEC_ROWS and `max_tokens` (the
    most tokens a step computes)."""
    if max_query == 1:
        return max_num_seqs
    return max(max_num_seqs, min(max_num_seqs * max_query, SPEC_ROWS, max_tokens))


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

    def __init__(self, model, ids: torch.Tensor, positions: torch.Tensor, attn, hidden: torch.Tensor,
                 extra: tuple[torch.Tensor, ...] = ()) -> None:
        self.model, self.ids, self.positions, self.attn, self.hidden = model, ids, positions, attn, hidden
        self.extra = extra
        self.plan = attn.plan

    @torch.inference_mode()
    def replay(self) -> None:
        self.attn.plan = self.plan
        self.hidden.copy_(self.model(self.ids, self.positions, self.attn, *self.extra))


def target_graphs(runner: ModelRunner, max_tokens: int) -> CudaGraphRunner:
    """The target's graphs, captured: decode steps, and with speculation verification steps of
    up to k + 1 tokens a request, a row a token (`max_tokens`: the step's token budget)."""
    spec = runner.config.speculative_config
    graphs = CudaGraphRunner(runner, runner.config.max_num_seqs, 1 + spec.num_speculative_tokens if spec else 1,
                             max_tokens=max_tokens)
    graphs.capture()
    return graphs


def drafter_graphs(drafter: DraftModel) -> CudaGraphRunner:
    """A drafter's graphs (spec/draft.py), captured: its forwards of one token a request, and
    its first forward's few tokens a request (its last token, the accepted drafts and the
    target's next: k + 2 at most) a row a token; an EAGLE head's read the target's hidden
    states from a buffer of theirs."""
    features = drafter.model_config.hidden_size if drafter.reads_features else 0
    graphs = CudaGraphRunner(drafter, drafter.scratch_rows, drafter.config.num_speculative_tokens + 2,
                             drafter.scratch_per_row, drafter.max_rows, features)
    graphs.capture()
    return graphs


class CapturedGraph(NamedTuple):
    graph: torch.cuda.CUDAGraph | EagerReplay
    hidden: torch.Tensor  # the forward's output buffer, [bucket, hidden]
    plan: object  # the backend's plan tensors the graph reads: kept alive with it


class CudaGraphRunner:
    """`runner`: the target's ModelRunner, or a draft model (spec/draft.py); what it needs of
    either is the model, its attention backend, staging, device, block size and max_model_len.
    `max_query`: the longest query a step replays a graph for (each token a row); `extra_blocks`:
    block table columns beyond max_model_len's (a draft's scratch blocks); `max_tokens`: the most
    tokens a step computes (its token budget); `features`: the width of a second input a row,
    given to the model after the positions and the backend (an EAGLE head's target hidden
    states), in the model's dtype."""

    def __init__(self, runner: ModelRunner, max_batch_size: int, max_query: int = 1, extra_blocks: int = 0,
                 max_tokens: int = SPEC_ROWS, features: int = 0) -> None:
        self.runner = weakref.proxy(runner)  # the runner owns this; no cycle keeps a dead engine's memory
        self.max_query = max_query
        # a request's rows in runs of at most this many, each read of its context serving a run
        self.max_span = min(max_query, getattr(runner.attn, "max_span", max_query))
        self.buckets = graph_buckets(graph_rows(max_batch_size, max_query, max_tokens))
        b = self.buckets[-1]
        max_blocks = -(-runner.max_model_len // runner.block_size) + extra_blocks
        with torch.device(runner.device):
            self.input_ids = torch.zeros(b, dtype=torch.int64)
            self.positions = torch.zeros(b, dtype=torch.int64)
            self.slot_mapping = torch.full((b,), -1, dtype=torch.int64)
            self.seq_lens = torch.zeros(b, dtype=torch.int32)
            self.query_start_loc = torch.arange(b + 1, dtype=torch.int32)
            self.block_table = torch.zeros(b, max_blocks, dtype=torch.int32)
            self.row_spans = torch.ones(b, dtype=torch.int32)  # a row a decode: each its own
            self.features = torch.zeros(b, features, dtype=next(runner.model.parameters()).dtype) if features else None
        self.spans = False  # whether row_spans holds a row-a-token step's runs
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
            block_size=runner.block_size, row_spans=self.row_spans[:b], max_span=self.max_span)
        runner.staging.begin()
        attn.begin_step(md)  # outside the capture: the plan's tensors are made once, then only read
        runner.staging.end()
        ids, positions = self.input_ids[:b], self.positions[:b]
        extra = () if self.features is None else (self.features[:b],)
        hidden = model(ids, positions, attn, *extra)  # warm-up: Triton compiles, cuBLAS picks its kernels
        if runner.device.type != "cuda":
            return CapturedGraph(EagerReplay(model, ids, positions, attn, hidden, extra), hidden, attn.plan)
        torch.cuda.synchronize(runner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = model(ids, positions, attn, *extra)
        return CapturedGraph(graph, hidden, attn.plan)

    def can_run(self, query_lens: np.ndarray, num_tokens: int) -> bool:
        return bool(self.buckets) and num_tokens <= self.buckets[-1] and int(query_lens.max()) <= self.max_query

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, seq_lens: np.ndarray,
            block_table: np.ndarray, query_lens: np.ndarray,
            fill: tuple[torch.Tensor | slice, torch.Tensor] | None = None,
            features: torch.Tensor | None = None) -> torch.Tensor:
        """One step of len(input_ids) tokens, len(query_lens) requests (`can_run`); returns the
        tokens' hidden states. `fill`: (positions, a device tensor or a slice; token ids on the
        device), put into the input ids after the copy. `features`: the second input's rows
        (none: what the buffer holds, as in timing)."""
        n = len(input_ids)
        b = next(x for x in self.buckets if x >= n)
        pad = b - n
        put = self.runner.staging.to_device
        spans = n != len(query_lens)
        if spans:  # a row a token: its request's blocks, its context up to itself
            block_table = token_rows(block_table, query_lens)
            seq_lens = (positions + 1).astype(np.int32)
            put(_padded(row_spans(query_lens, self.max_span), pad, 1), out=self.row_spans[:b])
        elif self.spans:  # the runs of the last step undone (a decode step finds the buffer all ones)
            self.row_spans.fill_(1)
        self.spans = spans
        put(_padded(input_ids, pad), out=self.input_ids[:b])
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        put(_padded(positions, pad), out=self.positions[:b])
        put(_padded(slot_mapping, pad, -1), out=self.slot_mapping[:b])
        put(_padded(seq_lens, pad), out=self.seq_lens[:b])
        put(_padded(block_table, pad), out=self.block_table[:b, :block_table.shape[1]])
        if features is not None:
            self.features[:n].copy_(features)
        captured = self.graphs[b]
        captured.graph.replay()
        return captured.hidden[:n]
