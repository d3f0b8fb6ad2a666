"""The model runner: executes one SchedulerOutput. It never decides who runs.

Per step: every input is built once on the host with numpy (token ids, positions,
the slot mapping, the block table), each becomes one device tensor through the
staging buffer (pinned, non-blocking on CUDA), attention metadata is built once,
one forward runs over all scheduled tokens flattened (no padding between
requests), logits are computed only for rows that sample (with speculative drafts:
a request's last 1 + k positions, verified in the sampler), and the sampled ids
(with their logprobs) come back in the step's single device-to-host sync.
Decode steps on CUDA, and verification steps of speculative decoding, replay a captured graph
(executor/cuda_graphs.py).
"""

from __future__ import annotations

import gc
import logging
import time
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.request import TokenLogprobs
from tokenmill.engine.scheduler import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.attention import AttentionMetadata, select_attention_backend, token_rows, token_slots
from tokenmill.executor.attention.cpu import SHORT_QUERY
from tokenmill.executor.attention.kv_cache import CacheOwner, cache_dtype
from tokenmill.executor.cpu_kernels import load_cpu_kernels
from tokenmill.executor.cuda_graphs import CudaGraphRunner, target_graphs
from tokenmill.executor.distributed.parallel import TensorParallel, check_tensor_parallel, shard_model_config
from tokenmill.executor.distributed.workers import TensorParallelWorkers, WorkerGroupError
from tokenmill.executor.fused_decoder import fused_decoder
from tokenmill.executor.layers.quantization import resolve_quantization
from tokenmill.executor.loader import load_model
from tokenmill.executor.memory import drafter_bytes, num_kv_blocks
from tokenmill.executor.penalties import PenaltyState
from tokenmill.executor.prompt_logprobs import compute_prompt_logprobs, prompt_logprob_rows
from tokenmill.executor.sampler import SampledTokens, Sampler
from tokenmill.executor.sampling_batch import build_sampling_batch
from tokenmill.executor.spec.adaptive import StepCost
from tokenmill.executor.spec.checkpoint import resolve_draft
from tokenmill.executor.spec.draft import DraftModel
from tokenmill.executor.spec.eagle import EagleProposer
from tokenmill.executor.spec.rejection import accepted_prefix
from tokenmill.executor.spec.timing import measure_step_cost
from tokenmill.executor.staging import Staging
from tokenmill.executor.step_input import StepInput

logger = logging.getLogger("tokenmill")


DRAFTERS = {"draft_model": DraftModel, "eagle": EagleProposer}  # the methods that draft inside the step


class LaunchedStep(NamedTuple):
    """A step whose forward and sampling are queued (ModelRunner.launch): its tokens are either
    on the host already (`sampled`: with speculation, whose drafts need them at once) or on
    their way there (`pending`)."""

    sampled: list[list[tuple[int, TokenLogprobs | None]]] | None
    pending: SampledTokens | None
    prompt_logprobs: dict[str, list[TokenLogprobs]]


def select_layer_kernels(attention_backend: str, cpu_kernels: ModuleType | None) -> ModuleType | None:
    """The layers' norms, rotary embedding and activation: Triton's beside Triton attention
    (one launch each where torch runs a chain of ops), else the native CPU kernels where
    they are loaded, else None (torch ops)."""
    if attention_backend == "triton":
        from tokenmill.executor.layers import triton_ops
        return triton_ops
    return cpu_kernels


class ModelRunner(CacheOwner):
    """`tp`: given to the runner of a tensor-parallel worker rank (executor/distributed); the
    driver's runner (rank 0) starts those workers itself when tensor_parallel_size > 1.
    `model_config` is the whole model's; `self.model_config` holds this rank's shapes."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, max_num_batched_tokens: int,
                 tp: TensorParallel | None = None) -> None:
        self.config = config
        self.workers: TensorParallelWorkers | None = None
        if tp is None and config.tensor_parallel_size > 1:
            check_tensor_parallel(model_config, config.tensor_parallel_size, device)
            self.workers = TensorParallelWorkers(
                config.tensor_parallel_size, device, config.num_threads,
                dict(config=config, model_config=model_config, model_path=model_path, device=device, dtype=dtype,
                     max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens))
            tp = self.workers.tp
            if self.workers.driver_cpus:
                torch.set_num_threads(len(self.workers.driver_cpus))
        self.tp = tp
        try:
            self._build(config, model_config, model_path, device, dtype, max_model_len, max_num_batched_tokens)
        except BaseException as e:
            if self.workers is not None:
                # bad input (a ValueError) stays itself; a failed collective says which worker died
                error = self.workers.fail(e) if isinstance(e, RuntimeError) else e
                self.workers.kill()
                if error is not e:
                    raise error from e
            raise

    def _build(self, config: EngineConfig, model_config: ModelConfig, model_path, device: torch.device,
               dtype: torch.dtype, max_model_len: int, max_num_batched_tokens: int) -> None:
        tp = self.tp
        self.model_config = shard_model_config(model_config, tp.size) if tp else model_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        # device choices, made once: the attention backend and the layers' implementations
        self.backend_cls = select_attention_backend(config.attention_backend, device, dtype, model_config.head_dim,
                                                    config.block_size, config.kv_cache_dtype)
        self.kv_cache_dtype = cache_dtype(config.kv_cache_dtype, dtype)
        kernels = load_cpu_kernels() if device.type == "cpu" else None
        layer_kernels = select_layer_kernels(self.backend_cls.name, kernels)
        # what torch holds already in this process (another engine, a reference model): not ours; an
        # unreachable engine still in a reference cycle is collected first, or the baseline would count it
        if device.type == "cuda":
            gc.collect()
        self.memory_baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t0 = time.perf_counter()
        self.quant = resolve_quantization(config.quantization, model_config.quantization_config, device, kernels)
        if tp is not None and self.quant is not None:
            raise ValueError("tensor_parallel_size > 1 does not run quantized checkpoints yet (quantization "
                             f"{self.quant.name})")
        self.model = load_model(model_path, model_config, config.load_format, dtype, device,
                                max_position=max(max_model_len, model_config.max_position_embeddings),
                                seed=config.seed, kernels=layer_kernels, quant=self.quant, tp=tp)
        self.load_time = time.perf_counter() - t0
        self.staging = Staging(device)
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(config.seed), device, kernels)
        self.penalties = PenaltyState(model_config.vocab_size, device, self.staging.to_device)
        spec = config.speculative_config
        # a draft model's KV cache shares the blocks, so each block costs its bytes too
        draft = resolve_draft(spec, model_path, model_config) if spec and spec.method in DRAFTERS else None
        self.draft_kv_bytes_per_token = draft[1].kv_bytes_per_token(self.kv_cache_dtype) if draft else 0
        self.draft_bytes = drafter_bytes(spec, *draft, dtype, self.kv_cache_dtype, self.block_size,
                                         config.max_num_seqs, max_model_len) if draft and device.type == "cuda" else 0
        self.num_blocks = num_kv_blocks(self, max_num_batched_tokens)
        if tp is not None:  # every rank holds the same blocks: as many as the tightest can
            self.num_blocks = tp.min_int(self.num_blocks)
        self.kv_cache = self.allocate_kv_cache(self.num_blocks)
        self.attn = self.make_backend(self.kv_cache)
        # a small plain Llama's steps of one row a token, in one native call (executor/fused_decoder.py)
        self.kernels = kernels
        fused = None if config.enforce_eager else fused_decoder(self.model, self.kv_cache, self.attn, kernels)
        self.fused, self.fused_rows, _ = fused or (None, 0, False)
        if self.fused is not None:
            logger.info("steps of up to %d tokens, each a row of its own, run in one native call", self.fused_rows)
        # captured before the step-cost timing below, which times the steps as they run
        self.graphs: CudaGraphRunner | None = None
        if device.type == "cuda" and not config.enforce_eager and tp is None:
            self.graphs = target_graphs(self, max_num_batched_tokens)
        self.step_cost: StepCost | None = None
        if spec is not None and spec.adaptive:  # what a step costs by its tokens, for choosing drafts
            self.step_cost = measure_step_cost(self, min(max_num_batched_tokens, 1024),
                                               verify=1 + spec.num_speculative_tokens)
            logger.info("adaptive speculation: step time by tokens %s", self.step_cost)
        self.drafter = DRAFTERS[spec.method](self, spec, *draft, self.num_blocks, max_num_batched_tokens,
                                             layer_kernels) \
            if draft else None
        # async scheduling (engine.py): the last step's sampled ids on the device, and each
        # sampling request's row in them
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None else \
            device.type == "cuda" and spec is None and tp is None and config.tensor_parallel_size == 1
        self._last_ids: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}

    def release(self, request_id: str) -> None:
        """A request finished or was aborted: what the runner kept for it goes."""
        self.penalties.release(request_id)

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any (the engine is done)."""
        if self.workers is not None:
            self.workers.stop()
            self.workers = None

    def execute(self, out: SchedulerOutput, grammar_mask: tuple[list[int], np.ndarray] | None = None
                ) -> ModelRunnerOutput:
        """Runs one step: the sampled tokens, and the prompt logprobs of the chunks that want them.
        `grammar_mask`: (rows, packed allowed-token bits) of the sampling rows that have a
        grammar (structured outputs; Grammars.bitmask)."""
        return self.finish(self.launch(out, grammar_mask))

    def launch(self, out: SchedulerOutput, grammar_mask: tuple[list[int], np.ndarray] | None = None
               ) -> LaunchedStep:
        """Starts one step: its forward and sampling are queued on the device, and only
        `finish` waits for the sampled ids. A request whose last token is still pending (async
        scheduling scheduled this step before the last one's update) reads it from the last
        step's ids on the device."""
        if self.workers is None:
            return self._launch(out, grammar_mask)
        try:
            return self._launch(out, grammar_mask)
        except WorkerGroupError:
            raise
        except Exception as e:
            # the workers may be waiting in a collective this step never reached: the ranks are
            # out of step, so no later step may run (the error ends the engine core); it names
            # the worker that died, if one did
            raise self.workers.fail(e) from e

    def finish(self, step: LaunchedStep) -> ModelRunnerOutput:
        """The launched step's results on the host: its one wait for the device."""
        sampled = step.sampled if step.pending is None else [[t] for t in step.pending.tokens()]
        return ModelRunnerOutput(sampled, step.prompt_logprobs)

    @torch.inference_mode()
    def _launch(self, out: SchedulerOutput, grammar_mask: tuple[list[int], np.ndarray] | None) -> LaunchedStep:
        bs = self.block_size
        query_lens = np.array(out.num_scheduled_tokens, dtype=np.int32)
        computed = np.array(out.num_computed_tokens, dtype=np.int64)
        input_ids: list[int] = []
        pending_at: list[int] = []  # where a token sampled by the last step goes in input_ids
        pending_rows: list[int] = []  # and its row in that step's ids
        for request, start, n, drafts in zip(out.requests, out.num_computed_tokens, out.num_scheduled_tokens,
                                             out.spec_token_ids):
            known = request.all_token_ids[start:start + n - len(drafts)]
            input_ids.extend(known)
            if len(known) + len(drafts) < n:
                pending_at.append(len(input_ids))
                pending_rows.append(self._last_rows[request.request_id])
                input_ids.append(0)
            input_ids.extend(drafts)  # scheduled after the known tokens
        block_table = out.block_table
        positions, slot_mapping = token_slots(query_lens, computed, block_table, bs)
        seq_lens = (computed + query_lens).astype(np.int32)
        # each sampling request's last token (with k drafts: its last k + 1); a sequence forked
        # this step samples from its parent's last token
        ends = np.cumsum(query_lens, dtype=np.int64)
        if any(out.spec_token_ids):
            logits_rows: list[int] = []
            num_rows: list[int] = []  # per sampling request
            for i, drafts in enumerate(out.spec_token_ids):
                if out.samples(i):
                    logits_rows.extend(range(ends[i] - len(drafts) - 1, ends[i]))
                    num_rows.append(len(drafts) + 1)
        else:  # one row per sampling request (most steps): its last token
            logits_rows = (ends - 1)[np.fromiter(out.sampling, dtype=bool, count=len(out.sampling))].tolist()
            num_rows = [1] * len(logits_rows)
        for i, _ in out.forked:
            logits_rows.append(ends[i] - 1)
            num_rows.append(1)
        sampling = out.sampling_requests
        spec = len(logits_rows) > len(sampling)
        plp = prompt_logprob_rows(out, query_lens)
        # the sampling rows, or None when they are every row (as in a decode-only step)
        sample_rows = np.array(logits_rows, dtype=np.int64) \
            if out.forked or len(logits_rows) != len(input_ids) else None
        step = StepInput(np.array(input_ids, dtype=np.int64), positions, slot_mapping, query_lens, seq_lens,
                         block_table, out.block_copies,
                         [*(plp.chunks if plp else ()), *((sample_rows,) if sampling else ())])
        if self.workers is not None:
            self.workers.send(step)

        self.staging.begin()
        put = self.staging.to_device
        fill = None
        if pending_at:  # the last step's sampled ids, gathered on the device: no wait for them
            fill = (put(np.array(pending_at, dtype=np.int64)),
                    self._last_ids[put(np.array(pending_rows, dtype=np.int64))])
        hidden = target_hidden = self._forward(step, fill)
        prompt_logprobs = compute_prompt_logprobs(self.model, self.staging, self.sampler, hidden, plp) if plp else {}
        if not sampling:
            self.staging.end()
            if self.drafter is not None:  # an EAGLE head keeps the chunks' hidden states
                self.drafter.run(out, [], target_hidden)
            return LaunchedStep([], None, prompt_logprobs)
        if sample_rows is not None:
            hidden = hidden[put(sample_rows)]
        first_row = np.cumsum([0, *num_rows])
        drafts = [d for i, d in enumerate(out.spec_token_ids) if out.samples(i)] + [[] for _ in out.forked]
        if spec:  # a request with k drafts has k + 1 rows: its j-th verifies draft j, the last is the bonus
            batch = build_sampling_batch(self.penalties, put, self.model_config.vocab_size,
                                         [r for r, k in zip(sampling, num_rows) for _ in range(k)],
                                         [j for k in num_rows for j in range(k)],
                                         [t for d in drafts for t in (*d, -1)])
        else:
            batch = build_sampling_batch(self.penalties, put, self.model_config.vocab_size, sampling)
        if grammar_mask is not None:
            rows, bits = grammar_mask
            batch.grammar = (put(first_row[rows].astype(np.int64)), put(bits))
        self.staging.end()
        pending = self.sampler.sample(self.model.compute_logits(hidden), batch)
        if self.async_scheduling and not spec:  # the next step may read these ids before they are on the host
            self._last_ids = pending.ids
            self._last_rows = {r.request_id: j for j, r in enumerate(sampling)}
        if not spec and (self.drafter is None or self.drafter.idle(out, len(logits_rows))):
            return LaunchedStep(None, pending, prompt_logprobs)
        tokens = pending.tokens()
        if spec:
            sampled = [accepted_prefix(d, tokens[first_row[j]:first_row[j + 1]]) for j, d in enumerate(drafts)]
        else:
            sampled = [[t] for t in tokens]
        if self.drafter is not None:  # the drafts the next step verifies
            self.drafter.run(out, sampled, target_hidden)
        return LaunchedStep(sampled, None, prompt_logprobs)

    def _forward(self, step: StepInput, fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The step's hidden states [tokens, hidden], after its copy-on-write block copies.
        `fill`: (positions in the input ids, the token ids to put there), on the device."""
        if step.block_copies:
            self._copy_blocks(step.block_copies)
        if self.graphs is not None and self.graphs.can_run(step.query_lens, len(step.input_ids)):
            return self.graphs.run(step.input_ids, step.positions, step.slot_mapping, step.seq_lens, step.block_table,
                                   step.query_lens, fill)
        if self.fits_one_call(len(step.input_ids), int(step.query_lens.max())):
            return self._forward_fused(step, fill)
        put = self.staging.to_device
        self.attn.begin_step(AttentionMetadata.from_host(step.query_lens, step.seq_lens, step.block_table,
                                                         put(step.slot_mapping), self.block_size, put))
        input_ids = put(step.input_ids)
        if fill is not None:
            input_ids[fill[0]] = fill[1]
        return self.model(input_ids, put(step.positions), self.attn)

    def fits_one_call(self, num_tokens: int, longest_query: int) -> bool:
        """Whether a step of `num_tokens` tokens, no request's query longer than `longest_query`,
        runs in one native call (_forward_fused)."""
        return self.fused is not None and num_tokens <= self.fused_rows and longest_query <= SHORT_QUERY

    def _forward_fused(self, step: StepInput, fill: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """_forward in one native call: each token a row of its own, with its request's block
        table row, attending to the context up to itself (as the CPU backend's decode rows do)."""
        t = torch.from_numpy
        ids = t(step.input_ids)
        if fill is not None:
            ids[fill[0]] = fill[1]
        return self.kernels.small_llama_decode(self.fused, ids, t(step.positions), t(step.slot_mapping),
                                               t(token_rows(step.block_table, step.query_lens)),
                                               t((step.positions + 1).astype(np.int32)), self.block_size)

    @torch.inference_mode()
    def run_worker_step(self, step: StepInput) -> None:
        """A tensor-parallel worker's step: the driver's forward and logits calls, in its order
        (their collectives pair up); the driver alone samples."""
        self.staging.begin()
        hidden = self._forward(step)
        for rows in step.logits_rows:
            self.model.compute_logits(hidden if rows is None else hidden[self.staging.to_device(rows)])
        self.staging.end()

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy on write (parallel sampling): each destination block gets its source's K/V,
        in every layer, before this step writes to it."""
        bs = self.block_size
        offsets = np.arange(bs, dtype=np.int64)
        src = (np.array([s for s, _ in copies], dtype=np.int64)[:, None] * bs + offsets).ravel()
        dst = (np.array([d for _, d in copies], dtype=np.int64)[:, None] * bs + offsets).ravel()
        put = self.staging.to_device
        self.kv_cache.copy_slots(put(dst), put(src))
