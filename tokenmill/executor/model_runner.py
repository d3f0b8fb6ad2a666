"""The model runner: executes one SchedulerOutput. It never decides who runs.

Per step: Python lists for every input are built once, each becomes one tensor
(pinned and copied non-blocking on CUDA), attention metadata is built once, one
forward runs over all scheduled tokens flattened (no padding between requests),
logits are computed only for rows that sample, and the sampled ids come back
with the step's single device-to-host sync.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.request import Request, TokenLogprobs
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.executor.attention import AttentionMetadata, TorchNativeBackend
from tokenmill.executor.cpu_kernels import load_cpu_kernels
from tokenmill.executor.loader import load_model
from tokenmill.executor.sampler import Sampler, SamplingBatch

_NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32}

logger = logging.getLogger("tokenmill")

DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 1024**3


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path, device: torch.device,
                 dtype: torch.dtype, max_model_len: int) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        t0 = time.perf_counter()
        self.model = load_model(model_path, model_config, config.load_format, dtype, device,
                                max_position=max(max_model_len, model_config.max_position_embeddings),
                                seed=config.seed)
        self.load_time = time.perf_counter() - t0
        self.num_blocks = self._num_kv_blocks(max_model_len)
        self.kv_cache = torch.zeros(
            (model_config.num_layers, 2, self.num_blocks * self.block_size, model_config.num_kv_heads,
             model_config.head_dim), dtype=dtype, device=device)
        kernels = load_cpu_kernels() if device.type == "cpu" else None
        self.attn = TorchNativeBackend(self.kv_cache, self.block_size, kernels=kernels)
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(config.seed))
        self.pin = device.type == "cuda"

    def _num_kv_blocks(self, max_model_len: int) -> int:
        per_block = self.model_config.kv_bytes_per_token(self.dtype.itemsize) * self.block_size
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # what we may still take: the utilisation share of the device minus what is in use
            # already (weights, other processes), with headroom for activations
            used = total - free
            budget = int(total * self.config.gpu_memory_utilization) - used - 512 * 1024**2
            if budget < per_block:
                raise ValueError(f"gpu_memory_utilization={self.config.gpu_memory_utilization} leaves no room for "
                                 f"the KV cache ({used / 2**30:.1f} GiB of {total / 2**30:.1f} GiB in use)")
        else:
            # by default no more than every running sequence at full length could use
            usable = self.config.max_num_seqs * (-(-max_model_len // self.block_size)) * per_block
            budget = self.config.kv_cache_memory or min(DEFAULT_CPU_KV_CACHE_MEMORY, usable)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes is less than one KV block ({per_block} bytes)")
        return int(num_blocks)

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        # through numpy: about 3x faster than torch.tensor on Python lists
        t = torch.from_numpy(np.array(data, dtype=_NUMPY_DTYPES[dtype]))
        return t.pin_memory().to(self.device, non_blocking=True) if self.pin else t

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[tuple[int, TokenLogprobs | None]]:
        """Runs one step; returns (token id, logprobs) for each request that samples, in order."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, logits_indices = [], [], []
        sampling: list[Request] = []
        max_blocks = max(len(b) for b in out.block_tables)
        block_table = []
        for i, request in enumerate(out.requests):
            start, n = out.num_computed_tokens[i], out.num_scheduled_tokens[i]
            input_ids.extend(request.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            block_table.append(out.block_tables[i] + [0] * (max_blocks - len(out.block_tables[i])))
            if out.samples(i):
                logits_indices.append(len(input_ids) - 1)
                sampling.append(request)

        positions_t = self._tensor(positions, torch.long)
        block_table_t = self._tensor(block_table, torch.int32)
        req_of_token = torch.repeat_interleave(torch.arange(len(query_lens), device=self.device),
                                               self._tensor(query_lens, torch.long))
        slot_mapping = block_table_t[req_of_token, positions_t // bs].long() * bs + positions_t % bs
        query_start_loc = [0]
        for n in query_lens:
            query_start_loc.append(query_start_loc[-1] + n)
        md = AttentionMetadata(
            query_start_loc=self._tensor(query_start_loc, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_table=block_table_t,
            slot_mapping=slot_mapping,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )
        self.attn.begin_step(md)
        hidden = self.model(self._tensor(input_ids, torch.long), positions_t, self.attn)
        if not sampling:
            return []
        logits = self.model.compute_logits(hidden[self._tensor(logits_indices, torch.long)])
        return self.sampler(logits, self._sampling_batch(sampling))

    def _sampling_batch(self, requests: list[Request]) -> SamplingBatch:
        vocab = self.model_config.vocab_size
        temps, top_k, top_p, min_p, seeds, unseeded, num_logprobs = [], [], [], [], [], [], []
        banned_rows, banned_ids = [], []
        use_k = use_p = use_min_p = False
        for row, r in enumerate(requests):
            sp = r.sampling_params
            temps.append(sp.temperature if not sp.greedy else 0.0)
            k = sp.top_k if sp.top_k > 0 else vocab
            top_k.append(min(k, vocab))
            top_p.append(sp.top_p)
            min_p.append(sp.min_p)
            use_k |= k < vocab
            use_p |= sp.top_p < 1.0
            use_min_p |= sp.min_p > 0.0
            if sp.seed is not None:
                # the noise of output position j depends on (seed, j) only
                seeds.append((row, hash((sp.seed, r.num_output_tokens)) & 0x7FFF_FFFF_FFFF_FFFF))
            else:
                unseeded.append(row)
            num_logprobs.append(sp.logprobs)
            if r.num_output_tokens < sp.min_tokens:
                stops = set(r.eos_token_ids) | set(sp.stop_token_ids)
                banned_rows.extend([row] * len(stops))
                banned_ids.extend(stops)
        all_greedy = all(t == 0.0 for t in temps)
        wanted = [n for n in num_logprobs if n is not None]
        return SamplingBatch(
            temperature=self._tensor(temps, torch.float32),
            top_k=self._tensor(top_k, torch.long) if use_k and not all_greedy else None,
            top_p=self._tensor(top_p, torch.float32) if use_p and not all_greedy else None,
            min_p=self._tensor(min_p, torch.float32) if use_min_p and not all_greedy else None,
            all_greedy=all_greedy,
            seeds=seeds,
            unseeded_rows=self._tensor(unseeded, torch.long) if unseeded and not all_greedy else None,
            banned=(self._tensor(banned_rows, torch.long), self._tensor(banned_ids, torch.long))
            if banned_rows else None,
            num_logprobs=num_logprobs,
            max_logprobs=max(wanted) if wanted else -1,
        )
