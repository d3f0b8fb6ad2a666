"""The scheduler: who runs this step, and with how many tokens.

There is no prefill phase and no decode phase (DESIGN.md). Each step every chosen
request gets `num_scheduled_tokens` under one token budget: a decode is a request
scheduled for one token, a chunked prefill one scheduled for part of its prompt,
a prefix hit one whose `num_computed_tokens` starts above zero. With speculative
decoding a decoding request is scheduled for 1 + k tokens, its drafts included
(`num_tokens_with_spec`); after the step `num_computed_tokens` rolls back to the
accepted tokens and the blocks past them are freed.

Order of a step: running requests first (in admission order), preempting by recompute
when the KV cache is full; then, if nothing was preempted, waiting requests are
admitted while budget, `max_num_seqs` and KV blocks allow. Who is admitted next and
who is preempted is the waiting queue's policy (request_queue.py: fcfs | priority |
fair, the last with per-tenant virtual token counters fed by `on_admitted` and
`on_sampled`). The `static` policy admits a new batch only once the previous batch has
fully finished: the baseline that continuous batching is measured against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus, TokenLogprobs
from tokenmill.engine.request_queue import RequestQueue, make_request_queue


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs. Lists are aligned: one entry per scheduled request."""

    requests: list[Request] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step
    num_scheduled_tokens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    # the same as one int32 array, zeros after each row (the runner's; the lists are the drafters')
    block_table: np.ndarray | None = None
    preempted: list[Request] = field(default_factory=list)
    # parallel sampling: (i, sequence) forked from requests[i] this step, sampling from its last row
    forked: list[tuple[int, Request]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) blocks
    # speculative decoding: the draft tokens scheduled after each request's known tokens
    spec_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def is_decode_only(self) -> bool:
        """Every request computes one known token and its drafts: no prompt chunks."""
        return all(n == 1 + len(s) for n, s in zip(self.num_scheduled_tokens, self.spec_token_ids))

    # whether request i reaches its last known token this step, so samples a new one
    sampling: list[bool] = field(default_factory=list)

    def samples(self, i: int) -> bool:
        return self.sampling[i]

    @property
    def sampling_requests(self) -> list[Request]:
        """Who gets a token this step, in the order of the runner's sampled rows."""
        return [r for r, s in zip(self.requests, self.sampling) if s] + [seq for _, seq in self.forked]


class ModelRunnerOutput(NamedTuple):
    """What one step computed: for each request that samples, in order, its new tokens as
    (token id, logprobs): one, or with drafts the accepted ones and the target's next; and
    the prompt logprobs computed this step, by request id, to append to each one's."""

    sampled: list[list[tuple[int, TokenLogprobs | None]]]
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "continuous", scheduling_policy: str = "fcfs",
                 enable_chunked_prefill: bool = True, fair_prompt_token_weight: float = 1.0,
                 fair_output_token_weight: float = 2.0) -> None:
        self.kv = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.static = policy == "static"
        self.enable_chunked_prefill = enable_chunked_prefill
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(scheduling_policy, fair_prompt_token_weight, fair_output_token_weight)
        self.running: list[Request] = []
        self._batch_open = True  # static policy: may the current batch still take requests?
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prefill work done, recomputation included
        # speculative decoding: drafts verified, drafts accepted, accepted at each draft position
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_per_position: list[int] = []
        self.num_spec_steps = 0  # request-steps that verified drafts
        self.num_spec_rejected_steps = 0  # of which rejected a draft
        # drafts after a request's first whose draft before was accepted, and of them accepted
        # (how often acceptance continues once it has begun: adaptive speculation's estimate)
        self.num_later_reached = 0
        self.num_later_accepted = 0

    # -- requests in and out -------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request from outside (abort, stop string, error); frees its blocks."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status)
        return request

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ---------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: dict[str, int] = {}  # request_id -> num_scheduled_tokens
        budget = self.max_num_batched_tokens

        allocate_slots = self.kv.allocate_slots
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            pending = request.num_pending_tokens
            if pending and self._ends_with_pending(request):
                i += 1  # async scheduling: its token in flight is its last; nothing more to compute
                continue
            # (num_tokens_with_spec, written out: this runs for every request in every step)
            num_new = min(len(request.all_token_ids) + len(request.spec_token_ids) + pending
                          - request.num_computed_tokens, budget)
            while not allocate_slots(request, num_new):
                victim = self.waiting.pick_victim(self.running)
                if self.running.index(victim) < i:
                    i -= 1
                self.running.remove(victim)
                budget += scheduled.pop(victim.request_id, 0)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = num_new
                budget -= num_new
                i += 1

        if self.static and not self.running:
            self._batch_open = True  # the previous batch has fully finished
        if not out.preempted and (not self.static or self._batch_open):
            budget = self._admit_waiting(scheduled, budget)

        get_block_ids = self.kv.get_block_ids
        for request in self.running:
            n = scheduled.get(request.request_id)
            if n is None:
                continue
            computed, num_tokens = request.num_computed_tokens, len(request.all_token_ids)
            out.requests.append(request)
            out.num_computed_tokens.append(computed)
            out.num_scheduled_tokens.append(n)
            out.block_tables.append(get_block_ids(request.request_id))
            samples = computed + n >= num_tokens
            request.num_pending_tokens += samples
            if request.spec_token_ids:  # the drafts the budget left room for
                del request.spec_token_ids[max(0, computed + n - num_tokens):]
            out.spec_token_ids.append(request.spec_token_ids)
            out.sampling.append(samples)
            if computed < request.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(n, request.num_prompt_tokens - computed)
            request.num_computed_tokens = computed + n
            if samples and request.num_forks:
                self._fork(out, len(out.requests) - 1, request)
        out.block_copies = self.kv.take_copies()
        out.block_table = self.kv.tables.gather([r.request_id for r in out.requests],
                                                max(map(len, out.block_tables), default=0))
        return out

    def _fork(self, out: SchedulerOutput, row: int, request: Request) -> None:
        """Parallel sampling: the request's prefill ends this step; its other sequences start
        here, sharing its blocks, each sampling its first token from the same logits."""
        for index in range(1, request.num_forks + 1):
            seq = request.fork(index)
            seq.num_pending_tokens = 1  # it samples this step
            self.kv.fork(request, seq)
            self.requests[seq.request_id] = seq
            self.running.append(seq)
            out.forked.append((row, seq))
        request.num_forks = 0

    def _admit_waiting(self, scheduled: dict[str, int], budget: int) -> int:
        now = time.time()
        while self.waiting and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                self._batch_open = False
                break
            request = self.waiting.peek()
            # cached blocks have no logits: a prompt that wants its logprobs is computed whole
            hits, num_cached = ([], 0) if request.needs_prompt_logprobs else self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if not self.enable_chunked_prefill and num_new > budget:
                break  # whole prompts only: wait for a step with room
            num_new = min(num_new, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                self._batch_open = False
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.waiting.on_admitted(request)  # before the next peek: fair charges the prompt here
            self.running.append(request)
            scheduled[request.request_id] = num_new
            budget -= num_new
        if not self.waiting:
            self._batch_open = False
        return budget

    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Appends the sampled tokens (one per sampling request, in order) and prompt logprobs,
        applies stop conditions and frees finished requests. Returns the requests that got a
        token or finished this step."""
        changed = []
        now = time.time()
        # a queue that counts sampled tokens (fair) hears of them; the others' hook does nothing
        on_sampled = self.waiting.on_sampled if type(self.waiting).on_sampled is not RequestQueue.on_sampled else None
        if result.prompt_logprobs:
            for request in out.requests:
                entries = result.prompt_logprobs.get(request.request_id)
                # not if it ended during the step (its id may be another request's by now)
                if entries is not None and self.requests.get(request.request_id) is request:
                    request.prompt_logprobs.extend(entries)
        for request, tokens in zip(out.sampling_requests, result.sampled, strict=True):
            running = request.status == RequestStatus.RUNNING
            # async scheduling: a request preempted after this step was launched keeps its token
            # (it resumes with it, as it would had the step ended first); one that ended does not
            if not running and request.status != RequestStatus.PREEMPTED:
                continue
            request.num_pending_tokens -= 1
            if request.spec_token_ids:
                self._count_accepted(request, len(request.spec_token_ids), len(tokens) - 1)
                request.spec_token_ids = []
            status, num_appended = None, 0
            for token_id, logprobs in tokens:  # one by one: a stop ends the request where it is
                request.all_token_ids.append(token_id)
                num_appended += 1
                if logprobs is not None:
                    request.cumulative_logprob += logprobs[1]
                    if request.logprobs is not None:
                        request.logprobs.append(logprobs)
                status = self._check_stop(request, token_id)
                if status is not None:
                    break
            if on_sampled is not None:
                on_sampled(request, num_appended)
            if status is not None:
                (self.running if running else self.waiting).remove(request)
                self._finish(request, status)
            elif running and request.num_computed_tokens >= request.num_tokens + request.num_pending_tokens:
                # rejected drafts: roll back
                request.num_computed_tokens = request.num_tokens - 1
                self.kv.trim(request, request.num_computed_tokens)
            elif running and request.num_pending_tokens:
                # async scheduling: the next step computes this token already, and its block
                # may be full now that the token is known
                self.kv.register_known(request)
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            changed.append(request)
        return changed

    def _count_accepted(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        rejected = num_accepted < num_drafts
        request.spec_accepted += num_accepted
        request.spec_rejected += rejected
        self.num_spec_rejected_steps += rejected
        self.num_spec_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_later_reached += max(0, min(num_drafts, num_accepted + 1) - 1)
        self.num_later_accepted += max(0, num_accepted - 1)
        per_position = self.num_accepted_per_position
        per_position.extend([0] * (num_drafts - len(per_position)))
        for j in range(num_accepted):
            per_position[j] += 1

    # -- internals --------------------------------------------------------------
    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        num_tokens = len(request.all_token_ids)  # (the properties, written out: once per token)
        num_output = num_tokens - request.num_prompt_tokens
        sp = request.sampling_params
        if num_output >= sp.min_tokens:
            if token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in sp.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens or num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _ends_with_pending(self, request: Request) -> bool:
        """Whether the request's sampled tokens in flight reach max_tokens or max_model_len, so
        that it ends with them (_check_stop) and is not scheduled again."""
        num_tokens = len(request.all_token_ids) + request.num_pending_tokens
        return num_tokens - request.num_prompt_tokens >= request.max_tokens or num_tokens >= self.max_model_len

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.finish_time = time.time()
        self.kv.free(request, finished=True)
        del self.requests[request.request_id]

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the request's blocks and send it back to the
        queue, ahead of later arrivals; it recomputes its prompt and output so far when it resumes
        (much of it from the prefix cache) and goes on exactly where it stopped. A token still
        in flight (async scheduling) is appended when its step's update comes, before it resumes."""
        self.kv.free(request, finished=False)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
