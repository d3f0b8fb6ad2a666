"""Engine: validates and adds requests, runs steps, turns finished work into RequestOutputs.

    step():  Scheduler.schedule() -> ModelRunner.execute() -> Scheduler.update()
             -> detokenize, stop strings -> RequestOutput deltas
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.detokenizer import IncrementalDetokenizer, load_tokenizer
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import (CompletionOutput, Request, RequestMetrics, RequestOutput, RequestStatus,
                                     TokenLogprobs)
from tokenmill.engine.scheduler import Scheduler
from tokenmill.executor.loader import choose_device, choose_dtype, resolve_model_path
from tokenmill.executor.model_runner import ModelRunner
from tokenmill.sampling_params import ParamError, SamplingParams

logger = logging.getLogger("tokenmill")


def _logprob_dict(entry: TokenLogprobs) -> dict[int, float]:
    token, logprob, top = entry
    return {**dict(top), token: logprob}


@dataclass(slots=True)
class _Tracked:
    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None
    final_only: bool = False
    num_sent_tokens: int = 0  # output tokens handed out in RequestOutputs
    num_decoded_tokens: int = 0  # output tokens fed to the detokenizer
    prompt_logprobs: list[dict[int, float] | None] | None = None  # as dicts, built once when complete


def _check_without_tokenizer(params: SamplingParams) -> None:
    """What needs text cannot run under skip_tokenizer_init: raises ParamError naming it."""
    for name, needs_text in (("stop", params.stop_strings), ("bad_words", params.bad_words)):
        if needs_text:
            raise ParamError(name, f"{name}: needs a tokenizer, and this engine runs with skip_tokenizer_init "
                             "(stop_token_ids work without one)")


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_dir(self.model_path)
        # skip_tokenizer_init: token ids in and out, for a checkpoint without tokenizer files
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or self.model_path)
        self.device = choose_device(config.device)
        self.dtype = choose_dtype(config.dtype, self.device)
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if mc.sliding_window is not None and self.max_model_len > mc.sliding_window:
            # attention here is full, which equals sliding-window attention up to the window
            logger.warning("max_model_len capped at the sliding window (%d)", mc.sliding_window)
            self.max_model_len = mc.sliding_window
        budget = config.max_num_batched_tokens or (8192 if self.device.type == "cuda" else 2048)
        if not config.enable_chunked_prefill:
            budget = max(budget, self.max_model_len)
        self.runner = ModelRunner(config, mc, self.model_path, self.device, self.dtype, self.max_model_len, budget)
        self.kv_cache = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, budget, self.max_model_len,
                                   policy=config.scheduler, scheduling_policy=config.scheduling_policy,
                                   enable_chunked_prefill=config.enable_chunked_prefill)
        self.kv_capacity_tokens = self.runner.num_blocks * config.block_size
        tokenizer_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(sorted(set(mc.eos_token_ids) | ({tokenizer_eos} if tokenizer_eos is not None
                                                                  else set())))
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self.total_steps = 0
        logger.info("model %s (%s, %s on %s, attention %s) loaded in %.2fs; KV cache: %d blocks x %d = %d tokens; "
                    "prefix caching %s; max_model_len %d", self.model_path, mc.architecture,
                    str(self.dtype).removeprefix("torch."), self.device, self.runner.attn.name, self.runner.load_time,
                    self.runner.num_blocks, config.block_size, self.kv_capacity_tokens,
                    "on" if config.enable_prefix_caching else "off", self.max_model_len)

    # -- requests -------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ParamError("prompt", "prompt: text needs a tokenizer, and this engine runs with "
                             "skip_tokenizer_init; pass token ids (prompt_token_ids)")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None,
                     priority: int = 0, arrival_time: float | None = None) -> tuple[Request, str | None]:
        """Validates a prompt against the model and the cache; raises ParamError naming the limit."""
        if not isinstance(params, SamplingParams):
            raise ParamError("sampling_params",
                             f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenize(prompt)
        else:
            text, token_ids = None, list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ParamError("prompt_token_ids", f"prompt_token_ids: {bad[0]!r} is outside the vocabulary "
                                 f"[0, {vocab})")
        if not token_ids:
            raise ParamError("prompt", "prompt: must not be empty (it has 0 tokens)")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ParamError("stop_token_ids", f"stop_token_ids: {bad_stop[0]} is outside the vocabulary [0, {vocab})")
        bad_bias = [t for t in params.logit_bias or () if t >= vocab]
        if bad_bias:
            raise ParamError("logit_bias", f"logit_bias: token {bad_bias[0]} is outside the vocabulary [0, {vocab})")
        n = len(token_ids)
        room = self.max_model_len - n
        if room < 1:
            raise ParamError("prompt", f"prompt: {n} tokens leaves no room to generate within max_model_len "
                             f"{self.max_model_len} (the prompt must be at most {self.max_model_len - 1} tokens)")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise ParamError("max_tokens", f"max_tokens: {max_tokens} is too large: the prompt has {n} tokens and "
                             f"max_model_len is {self.max_model_len}, so at most {room} tokens can be generated")
        if n + max_tokens > self.kv_capacity_tokens:
            raise ParamError("max_tokens", f"max_tokens: prompt ({n}) + max_tokens ({max_tokens}) exceeds the KV "
                             f"cache capacity of {self.kv_capacity_tokens} tokens; raise kv_cache_memory")
        if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
            raise ParamError("priority", f"priority must be an integer, got {priority!r}")
        rid = request_id if request_id is not None else str(next(self._ids))
        request = Request(rid, token_ids, params, self.eos_token_ids, max_tokens, priority, arrival_time)
        if self.tokenizer is None:
            _check_without_tokenizer(params)
        if params.bad_words:
            request.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        return request, text

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as the token sequences it may be generated as: on its own and after a
        space (vLLM's rule); a word may not be split in some other way, as in vLLM."""
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def add_request(self, request: Request, prompt: str | None = None, final_only: bool = False) -> None:
        """Queues a request. With final_only, step() returns its output once, when it
        finishes (as vLLM's FINAL_ONLY): no per-step output objects for offline batches."""
        sp = request.sampling_params
        detok = None
        if sp.detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(self._decoder(sp.skip_special_tokens), request.prompt_token_ids,
                                           sp.stop_strings, sp.include_stop_str_in_output)
        self.scheduler.add_request(request)
        self._tracked[request.request_id] = _Tracked(request, prompt, detok, final_only)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends a request and frees its blocks; returns its final output (None if it was not
        running here)."""
        return self._end(request_id, RequestStatus.FINISHED_ABORTED, None)

    def fail_request(self, request: Request, message: str) -> RequestOutput:
        """Ends a request with an error, whether or not it was added; returns its final output."""
        out = self._end(request.request_id, RequestStatus.FINISHED_ERROR, message)
        if out is None:  # never got in
            request.status, request.error, request.finish_time = RequestStatus.FINISHED_ERROR, message, time.time()
            out = self._snapshot(_Tracked(request, None, None), "", [])
        return out

    def _end(self, request_id: str, status: RequestStatus, error: str | None) -> RequestOutput | None:
        self.scheduler.finish_request(request_id, status)
        tracked = self._forget(request_id)
        if tracked is None:
            return None
        tracked.request.error = error
        return self._snapshot(tracked, tracked.detokenizer.delta(True) if tracked.detokenizer else "", [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step; returns an output for each request that got new
        tokens or finished (for a final_only request: only when it finished)."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        sampled = self.runner.execute(sched)
        changed = self.scheduler.update(sched, sampled)
        self.total_steps += 1
        outputs = []
        for request in changed:
            tracked = self._tracked.get(request.request_id)
            if tracked is None:
                if request.is_finished:
                    self._forget(request.request_id)
                continue
            try:
                if tracked.final_only and not request.is_finished:
                    if tracked.detokenizer is None or not tracked.detokenizer.stop:
                        continue  # nothing to check before the end: the text is decoded then
                    self._detokenize(tracked)  # stop strings are checked as tokens come
                    if not request.is_finished:
                        continue
                outputs.append(self._output(tracked))
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the loop
                logger.exception("request %s failed in post-processing", request.request_id)
                if not request.is_finished:
                    self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
                request.status, request.error = RequestStatus.FINISHED_ERROR, f"{type(e).__name__}: {e}"
                outputs.append(self._snapshot(tracked, "", []))
            if request.is_finished:
                self._forget(request.request_id)
        return outputs

    def _forget(self, request_id: str) -> _Tracked | None:
        """A finished request: the engine and the runner drop what they kept for it."""
        self.runner.release(request_id)
        return self._tracked.pop(request_id, None)

    def _detokenize(self, tracked: _Tracked) -> None:
        """Feeds the new output tokens to the detokenizer; a stop string ends the request."""
        request = tracked.request
        new_ids = request.all_token_ids[request.num_prompt_tokens + tracked.num_decoded_tokens:]
        tracked.num_decoded_tokens += len(new_ids)
        hit = tracked.detokenizer.add(new_ids)
        if hit is not None:
            request.stop_reason = hit
            if not request.is_finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            request.status = RequestStatus.FINISHED_STOPPED

    def _output(self, tracked: _Tracked) -> RequestOutput:
        request = tracked.request
        new_text = ""
        if tracked.detokenizer is not None:
            self._detokenize(tracked)
            new_text = tracked.detokenizer.delta(request.is_finished)
        new_ids = request.all_token_ids[request.num_prompt_tokens + tracked.num_sent_tokens:]
        tracked.num_sent_tokens += len(new_ids)
        return self._snapshot(tracked, new_text, new_ids)

    def _snapshot(self, tracked: _Tracked, new_text: str, new_ids: list[int]) -> RequestOutput:
        r = tracked.request
        logprobs = new_logprobs = None
        if r.logprobs is not None:
            # the whole list only once, at the end: rebuilding it every step would be quadratic
            new_logprobs = [_logprob_dict(e) for e in r.logprobs[len(r.logprobs) - len(new_ids):]]
            logprobs = [_logprob_dict(e) for e in r.logprobs] if r.is_finished else None
        completion = CompletionOutput(
            index=0,
            text=tracked.detokenizer.text if tracked.detokenizer is not None else "",
            token_ids=r.output_token_ids,
            finish_reason=r.finish_reason,
            stop_reason=r.stop_reason,
            logprobs=logprobs,
        )
        if tracked.prompt_logprobs is None and r.prompt_logprobs is not None and not r.needs_prompt_logprobs:
            tracked.prompt_logprobs = [None if e is None else _logprob_dict(e) for e in r.prompt_logprobs]
        metrics = RequestMetrics(r.arrival_time, r.first_scheduled_time, r.first_token_time, r.last_token_time,
                                 r.finish_time, max(r.num_cached_tokens, 0), r.num_preemptions)
        return RequestOutput(r.request_id, tracked.prompt, r.prompt_token_ids, [completion], r.is_finished,
                             metrics, r.error, new_ids, new_text, new_logprobs, tracked.prompt_logprobs)

    def _decoder(self, skip_special_tokens: bool):
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:  # the Rust tokenizer directly: no Python wrapper per call
            return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return lambda ids: self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- stats ------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        kv = self.kv_cache
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": kv.usage,
            "prefix_cache_hit_rate": kv.prefix_hits / kv.prefix_queries if kv.prefix_queries else 0.0,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
        }
