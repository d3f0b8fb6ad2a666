"""Engine: validates and adds requests, runs steps, turns finished work into RequestOutputs.

    step():  Scheduler.schedule() -> ModelRunner.launch() -> .finish() -> Scheduler.update()
             -> detokenize, stop strings -> RequestOutput deltas

With async scheduling (CUDA's default) a call schedules and launches step N, then
finishes step N - 1 while the device runs N: the host's scheduling, input building
and output processing overlap the GPU instead of leaving it idle between steps. A
request decoding in both computes its step N - 1 token in step N from the device
(Request.num_pending_tokens); one that ends in step N - 1 wastes its row of step N.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.detokenizer import IncrementalDetokenizer, load_tokenizer
from tokenmill.engine.grammar import Grammars
from tokenmill.engine.input_processor import EngineLimits, InputProcessor
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.outputs import Seq, Tracked, failed_output, snapshot
from tokenmill.engine.request import Request, RequestOutput, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerOutput
from tokenmill.executor.loader import choose_device, choose_dtype, resolve_model_path
from tokenmill.executor.model_runner import LaunchedStep, ModelRunner
from tokenmill.executor.spec.ngram import NgramProposer
from tokenmill.executor.spec.proposer import Proposer
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")


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
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   fair_prompt_token_weight=config.fair_prompt_token_weight,
                                   fair_output_token_weight=config.fair_output_token_weight)
        self.kv_capacity_tokens = self.runner.num_blocks * config.block_size
        tokenizer_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(sorted(set(mc.eos_token_ids) | ({tokenizer_eos} if tokenizer_eos is not None
                                                                  else set())))
        self._tracked: dict[str, Tracked] = {}
        # async scheduling: the launched step whose tokens the next call takes; and the requests
        # whose next inputs need their last tokens on the host (grammar, bad words), which make
        # each step wait for the one before it is scheduled
        self._in_flight: tuple[SchedulerOutput, LaunchedStep, bool, float] | None = None
        self._sync_only: set[str] = set()
        self.grammars = Grammars(self.tokenizer, mc.vocab_size, self.eos_token_ids) if self.tokenizer else None
        spec = config.speculative_config
        self.proposer: Proposer | None = self.runner.drafter if self.runner.drafter is not None \
            else NgramProposer(spec, self.max_model_len, self.runner.step_cost) if spec is not None else None
        self.limits = EngineLimits(mc.vocab_size, self.max_model_len, self.kv_capacity_tokens, self.eos_token_ids)
        self.processor = InputProcessor(self.tokenizer, self.limits)
        self.total_steps = 0
        logger.info("model %s (%s, %s on %s, attention %s, quantization %s) loaded in %.2fs; KV cache: %d blocks "
                    "x %d = %d tokens (%s); prefix caching %s; max_model_len %d", self.model_path, mc.architecture,
                    str(self.dtype).removeprefix("torch."), self.device, self.runner.attn.name,
                    self.runner.quant.name if self.runner.quant else "none", self.runner.load_time,
                    self.runner.num_blocks, config.block_size, self.kv_capacity_tokens,
                    str(self.runner.kv_cache_dtype).removeprefix("torch."),
                    "on" if config.enable_prefix_caching else "off", self.max_model_len)

    def shutdown(self) -> None:
        """Stops what the engine started beside it (tensor-parallel workers); safe to repeat."""
        self.runner.shutdown()

    # -- requests -------------------------------------------------------------
    def make_request(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None,
                     priority: int = 0, arrival_time: float | None = None, tenant: str | None = None,
                     tenant_weight: float = 1.0) -> tuple[Request, str | None]:
        """InputProcessor.make_request: validates; raises ParamError naming the limit."""
        return self.processor.make_request(prompt, params, request_id, priority, arrival_time, tenant, tenant_weight)

    def add_request(self, request: Request, prompt: str | None = None, final_only: bool = False) -> None:
        """Queues a request. With final_only, step() returns its output once, when it
        finishes (as vLLM's FINAL_ONLY): no per-step output objects for offline batches.
        A request with structured outputs reaches the scheduler once its grammar is compiled."""
        if request.request_id in self._tracked:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.sampling_params.structured_outputs is not None:
            self.grammars.add(request)
        else:
            self.scheduler.add_request(request)
        if request.sampling_params.structured_outputs is not None or request.bad_words_token_ids:
            self._sync_only.add(request.request_id)
        quiet = (final_only or request.ranked_by_logprob) and not request.sampling_params.stop_strings
        self._tracked[request.request_id] = Tracked(request, prompt, [self._new_seq(request)], final_only,
                                                    quiet=quiet)

    def _new_seq(self, request: Request) -> Seq:
        sp = request.sampling_params
        detok = None
        if sp.detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(self._decoder(sp.skip_special_tokens), request.prompt_token_ids,
                                           sp.stop_strings, sp.include_stop_str_in_output)
        return Seq(request, detok)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends a request, every sequence of it, and frees their blocks; returns its final
        output (None if it was not running here)."""
        return self._end(request_id, RequestStatus.FINISHED_ABORTED, None)

    def fail_request(self, request: Request, message: str) -> RequestOutput:
        """Ends a request (all its sequences) with an error, whether or not it was added;
        returns its final output."""
        request = request.parent or request
        out = self._end(request.request_id, RequestStatus.FINISHED_ERROR, message)
        return out if out is not None else failed_output(request, message)  # None: it never got in

    def _end(self, request_id: str, status: RequestStatus, error: str | None) -> RequestOutput | None:
        tracked = self._tracked.get(request_id)
        if tracked is None:
            self.scheduler.finish_request(request_id, status)
            return None
        for seq in tracked.seqs:
            q = seq.request
            if self.scheduler.finish_request(q.request_id, status) is None and not q.is_finished:
                q.status, q.finish_time = status, time.time()  # it was waiting for its grammar
        self._forget(tracked)
        tracked.request.error = error
        seq = tracked.seqs[0]
        text = seq.detokenizer.delta(True) if seq.detokenizer else ""
        return snapshot(tracked, tracked.seqs[:1], text, [], finished=True)

    def has_unfinished_requests(self) -> bool:
        # a step in flight holds no other request: until its update, its requests are the
        # scheduler's (one with nothing else in the scheduler only ended ones, whose tokens go)
        return self.scheduler.has_unfinished() or bool(self.grammars and self.grammars.pending)

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: queued, or waiting for their grammar."""
        return self.scheduler.num_waiting + (len(self.grammars.pending) if self.grammars else 0)

    def unfinished_requests(self) -> list[Request]:
        """Every request in flight, as its caller knows it (not its forked sequences)."""
        return [tracked.request for tracked in self._tracked.values()]

    # -- one step -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step; returns outputs for the sequences that got new tokens or
        finished, one per sequence (for a final_only request: one for all of them, when the
        last finishes). A request's last output of the step says whether it has finished."""
        start = time.perf_counter()
        compiled = []  # requests whose grammar is done go to the scheduler; one that failed to compile ends
        waiting = self.grammars is not None and bool(self.grammars.pending)
        if waiting:
            started, failed = self.grammars.ready()
            for request in started:
                self.scheduler.add_request(request)
            compiled = [self.fail_request(request, str(error)) for request, error in failed]
        outputs = compiled
        last, self._in_flight = self._in_flight, None
        if last is not None and self._sync_only:
            outputs += self._complete(*last)  # a grammar or bad words need its tokens before scheduling
            last = None
        sched = self.scheduler.schedule()
        # parallel sampling: the group's sequences are known from now, so an abort while this
        # step is in flight ends them too
        for _, seq in sched.forked:
            tracked = self._tracked.get(seq.group_id)
            if tracked is not None:
                tracked.seqs.append(self._new_seq(seq))
        launched = None
        if not sched.is_empty:
            mask = self.grammars.bitmask(sched.sampling_requests) if self.grammars is not None else None
            launched = (sched, self.runner.launch(sched, mask), mask is not None, start)
        elif waiting and last is None:  # nothing to run until a grammar is ready: wait for one, briefly
            self.grammars.wait(timeout=0.05)
        if last is not None:  # the device runs the step just launched meanwhile
            outputs += self._complete(*last)
        if launched is not None:
            if self.runner.async_scheduling:
                self._in_flight = launched  # its outputs come with the next step's call
            else:
                outputs += self._complete(*launched)
        return outputs

    def _complete(self, sched: SchedulerOutput, launched: LaunchedStep, constrained: bool,
                  start: float) -> list[RequestOutput]:
        """Waits for a launched step's tokens, updates its requests and returns their outputs.
        `constrained`: some of its rows sampled under a grammar."""
        result = self.runner.finish(launched)
        changed = self.scheduler.update(sched, result)
        if constrained:  # each constrained sequence follows its token; a complete output stops
            for request, verdict in self.grammars.advance(changed):
                if verdict != "stop":
                    request.error = verdict
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED
                                              if verdict == "stop" else RequestStatus.FINISHED_ERROR)
        if self.proposer is not None:  # the drafts that the next step verifies
            s = self.scheduler
            self.proposer.propose(changed, s.num_running, s.num_accepted_tokens, s.num_spec_rejected_steps,
                                  (s.num_later_accepted, s.num_later_reached))
        self.total_steps += 1
        groups: dict[str, tuple[Tracked, list[Seq]]] = {}
        for request in changed:
            finished = request.is_finished
            if finished:  # a sequence's runner state goes when it ends, not with its group
                self._release(request.request_id)
            tracked = self._tracked.get(request.group_id)
            if tracked is None:
                continue
            if tracked.quiet and not finished:
                continue
            groups.setdefault(request.group_id, (tracked, []))[1].append(tracked.seqs[request.index])
        outputs = []
        for tracked, seqs in groups.values():
            try:
                outputs.extend(self._outputs(tracked, seqs))
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the loop
                logger.exception("request %s failed in post-processing", tracked.request.request_id)
                for seq in tracked.seqs:
                    if not seq.request.is_finished:
                        self.scheduler.finish_request(seq.request.request_id, RequestStatus.FINISHED_ERROR)
                tracked.request.status = RequestStatus.FINISHED_ERROR
                tracked.request.error = f"{type(e).__name__}: {e}"
                outputs.append(snapshot(tracked, tracked.seqs[:1], "", [], finished=True))
            if tracked.finished:
                self._forget(tracked)
        if self.proposer is not None and self.proposer.cost is not None:  # adaptive speculation learns
            self.proposer.observe_step(sched, time.perf_counter() - start, self.scheduler.num_accepted_tokens)
        return outputs

    def _outputs(self, tracked: Tracked, seqs: list[Seq]) -> list[RequestOutput]:
        """The outputs of one request's changed sequences this step."""
        sp = tracked.request.sampling_params
        ranked = tracked.request.ranked_by_logprob
        if tracked.final_only or ranked:
            for seq in seqs:  # stop strings are checked as tokens come
                if seq.detokenizer is not None and seq.detokenizer.stop and not seq.request.is_finished:
                    self._detokenize(seq)
            if not tracked.finished:
                return []
            chosen = tracked.seqs
            if ranked:  # best_of: the n of highest cumulative logprob, best first
                chosen = sorted(chosen, key=lambda q: -q.request.cumulative_logprob)[:sp.n]
            if tracked.final_only:
                deltas = [self._deltas(seq) for seq in chosen]  # decodes every chosen one's text
                return [snapshot(tracked, chosen, *deltas[0], finished=True, index=0 if ranked else None)]
            outs = [snapshot(tracked, [seq], *self._deltas(seq), finished=False, index=i)
                    for i, seq in enumerate(chosen)]
        else:
            outs = [snapshot(tracked, [seq], *self._deltas(seq), finished=False) for seq in seqs]
        outs[-1].finished = tracked.finished
        return outs

    def _forget(self, tracked: Tracked) -> None:
        """A finished request: the engine and the runner drop what they kept for it."""
        for seq in tracked.seqs:
            self._release(seq.request.request_id)
        self._tracked.pop(tracked.request.request_id, None)
        self._sync_only.discard(tracked.request.request_id)
        if self.grammars is not None:
            self.grammars.pending.pop(tracked.request.request_id, None)

    def _release(self, request_id: str) -> None:
        self.runner.release(request_id)
        if self.proposer is not None:
            self.proposer.release(request_id)

    def _detokenize(self, seq: Seq) -> None:
        """Feeds the new output tokens to the detokenizer; a stop string ends the sequence."""
        request = seq.request
        new_ids = request.all_token_ids[request.num_prompt_tokens + seq.num_decoded_tokens:]
        seq.num_decoded_tokens += len(new_ids)
        hit = seq.detokenizer.add(new_ids)
        if hit is not None:
            # tokens accepted in the same step after the one that completed the stop string
            extra = len(new_ids) - seq.detokenizer.num_added
            if extra:
                request.drop_last_tokens(extra)
                seq.num_decoded_tokens -= extra
            request.stop_reason = hit
            if not request.is_finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            request.status = RequestStatus.FINISHED_STOPPED

    def _deltas(self, seq: Seq) -> tuple[str, list[int]]:
        """The text and token ids of a sequence not yet handed out."""
        request = seq.request
        new_text = ""
        if seq.detokenizer is not None:
            self._detokenize(seq)
            new_text = seq.detokenizer.delta(request.is_finished)
        new_ids = request.all_token_ids[request.num_prompt_tokens + seq.num_sent_tokens:]
        seq.num_sent_tokens += len(new_ids)
        return new_text, new_ids

    def _decoder(self, skip_special_tokens: bool):
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:  # the Rust tokenizer directly: no Python wrapper per call
            return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return lambda ids: self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- stats ------------------------------------------------------------------
    def stats(self) -> dict[str, float | list[int]]:
        kv = self.kv_cache
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.num_waiting,
            "kv_cache_usage": kv.usage,
            "prefix_cache_hit_rate": kv.prefix_hits / kv.prefix_queries if kv.prefix_queries else 0.0,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_prompt_tokens_computed": self.scheduler.num_prompt_tokens_computed,
            "spec_decode_num_draft_tokens": self.scheduler.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.scheduler.num_accepted_tokens,
            "spec_decode_num_unspeculated_steps": self.proposer.num_unspeculated_steps if self.proposer else 0,
            "spec_decode_num_accepted_tokens_per_pos": list(self.scheduler.num_accepted_per_position),
            "spec_decode_num_steps_by_k": list(self.proposer.num_steps_by_k) if self.proposer else [],
        }
