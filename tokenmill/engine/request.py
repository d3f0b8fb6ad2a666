"""Request state and the plain output records the engine hands back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace

from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # everything from here on is finished
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

# (token id, logprob of the chosen token, [(top token id, logprob), ...])
TokenLogprobs = tuple[int, float, list[tuple[int, float]]]


class Request:
    """One generation request as the scheduler and engine see it.

    `num_tokens` = prompt + generated so far; `num_computed_tokens` = tokens whose
    K/V are in the cache. The scheduler gives it `num_tokens - num_computed_tokens`
    or fewer tokens each step (DESIGN.md, the one invariant).
    """

    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "priority", "arrival_time",
                 "all_token_ids", "num_prompt_tokens", "num_computed_tokens", "num_cached_tokens",
                 "status", "stop_reason", "error", "logprobs", "max_tokens", "eos_token_ids",
                 "first_scheduled_time", "first_token_time", "finish_time", "num_preemptions",
                 "last_token_time", "bad_words_token_ids", "prompt_logprobs", "parent", "index",
                 "num_forks", "cumulative_logprob", "grammar", "spec_token_ids", "spec_accepted",
                 "spec_rejected", "tenant", "tenant_weight", "num_pending_tokens",
                 "sampling_row")

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), max_tokens: int | None = None,
                 priority: int = 0, arrival_time: float | None = None, tenant: str | None = None,
                 tenant_weight: float = 1.0) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        # who the request is for, and its share, under scheduling_policy="fair" (request_queue.py);
        # None is served as the default tenant ""
        self.tenant = tenant
        self.tenant_weight = tenant_weight
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.logprobs: list[TokenLogprobs] | None = [] if sampling_params.logprobs is not None else None
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.eos_token_ids = () if sampling_params.ignore_eos else eos_token_ids
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_preemptions = 0
        self.bad_words_token_ids: list[list[int]] = []  # SamplingParams.bad_words, tokenized by the engine
        # entry i: the logprobs of prompt token i given the ones before it (none for the first)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = \
            [None] if sampling_params.prompt_logprobs is not None else None
        # parallel sampling: sequence `index` of its group; the group's first sequence (index 0)
        # is the request itself, which forks `num_forks` more after its prefill (Request.fork)
        self.parent: Request | None = None
        self.index = 0
        self.num_forks = sampling_params.num_sequences - 1
        self.cumulative_logprob = 0.0  # of the sampled tokens, when logprobs are computed
        # structured outputs: the grammar's matcher (llguidance), set by the engine once compiled
        self.grammar = None
        # speculative decoding: draft tokens to verify in the next step (not part of all_token_ids)
        self.spec_token_ids: list[int] = []
        # adaptive speculation's evidence: drafts accepted, verification steps that rejected
        # one (float: they fade while the request drafts nothing, executor/spec/proposer.py)
        self.spec_accepted = 0.0
        self.spec_rejected = 0.0
        # tokens sampled by scheduled steps and not appended yet: 1 from the scheduling of a
        # sampling step to its update; with async scheduling, the next step is scheduled before
        # that update, and computes the pending token from the device (engine.py)
        self.num_pending_tokens = 0
        self.sampling_row: tuple | None = None  # its settings for a sampling batch (executor/sampling_batch.py)

    def fork(self, index: int) -> Request:
        """Sequence `index` of this request's group, at the end of its prefill: the same prompt
        and computed tokens (the scheduler shares the blocks), its own seed (seed + index, as
        vLLM's) and no prompt logprobs (the group's are the parent's)."""
        sp = self.sampling_params
        child_params = replace(sp, n=1, best_of=None, prompt_logprobs=None,
                               seed=None if sp.seed is None else sp.seed + index)
        child = Request(f"{self.request_id}#{index}", self.prompt_token_ids, child_params, (),
                        self.max_tokens, self.priority, self.arrival_time, self.tenant, self.tenant_weight)
        child.eos_token_ids = self.eos_token_ids
        child.parent, child.index = self, index
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.status = RequestStatus.RUNNING
        child.first_scheduled_time = self.first_scheduled_time
        child.bad_words_token_ids = self.bad_words_token_ids
        if self.grammar is not None:  # forked before the parent's first token: the same state
            child.grammar = self.grammar.deep_copy()
        return child

    def drop_last_tokens(self, k: int) -> None:
        """Takes back the last k output tokens (and their logprobs): speculative decoding
        accepted them in the step whose earlier token completed a stop string."""
        del self.all_token_ids[-k:]
        if self.logprobs is not None:
            for entry in self.logprobs[-k:]:
                self.cumulative_logprob -= entry[1]
            del self.logprobs[-k:]

    @property
    def ranked_by_logprob(self) -> bool:
        """Part of a best_of group: its sampled tokens' logprobs are summed to rank it."""
        sp = (self.parent or self).sampling_params
        return sp.best_of is not None and sp.best_of > sp.n

    @property
    def group_id(self) -> str:
        """The id the caller knows: the parent's, for every sequence of a group."""
        return self.request_id if self.parent is None else self.parent.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """num_tokens plus the drafts to verify and the sampled tokens not yet appended: what the
        next step may compute."""
        return len(self.all_token_ids) + len(self.spec_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Some prompt logprobs are still to be computed (so the prefix cache is no use)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # one dict {token_id: logprob} per generated token: the top-N plus the chosen token
    # (in the request's final output; streamed outputs carry RequestOutput.new_logprobs)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None  # with logprobs, or in a best_of request

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    # tokens and text added since the previous output of this request (streaming)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[dict[int, float]] | None = None
    # SamplingParams.prompt_logprobs: one dict per prompt token (None for the first), from the
    # first output on
    prompt_logprobs: list[dict[int, float] | None] | None = None
    tenant: str | None = None  # the request's tenant, as given to Engine.make_request
