"""The waiting queue: one class per scheduling policy behind one interface (STYLE 15).

    fcfs      FCFSQueue      arrival order; a preempted request goes back to the front
    priority  PriorityQueue  lower `priority` value first, then earlier arrival
    fair      FairQueue      priority lanes, then the virtual token counters of tenants
                             (VTC: Sheng et al., "Fairness in Serving Large Language
                             Models", OSDI'24), then arrival within a tenant

The scheduler asks `peek` and acts with `pop` (admission); it gives a queue new requests
with `add`, preempted ones with `prepend` and takes aborted ones out with `remove`. When the
KV cache is full it asks the policy for its victim (`pick_victim`), and it reports the
service that requests get (`on_admitted`, `on_sampled`): only `fair` counts it.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator

from tokenmill.engine.request import Request

DEFAULT_TENANT = ""  # a request with no tenant is served as this one, with its own weight


class RequestQueue:
    """The waiting requests of one scheduling policy: who is admitted next, and who is
    preempted when the KV cache is full."""

    def add(self, request: Request) -> None:
        """A new request arrives."""
        raise NotImplementedError

    def prepend(self, request: Request) -> None:
        """A preempted request goes back: ahead of those that arrived after it."""
        raise NotImplementedError

    def peek(self) -> Request:
        """The request to admit next (the queue must not be empty)."""
        raise NotImplementedError

    def pop(self) -> Request:
        """Takes out the request that `peek` names: it was admitted."""
        raise NotImplementedError

    def remove(self, request: Request) -> None:
        """Takes out a waiting request that ended (abort, error)."""
        raise NotImplementedError

    def pick_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when the KV cache is full (`running` is in
        admission order, forked sequences after their parent's admission)."""
        raise NotImplementedError

    def on_admitted(self, request: Request) -> None:
        """`request` was admitted, with `num_computed_tokens` set to its prefix-cache hit."""

    def on_sampled(self, request: Request, num_tokens: int) -> None:
        """`num_tokens` output tokens were appended to `request` (accepted drafts included)."""

    def __len__(self) -> int:
        raise NotImplementedError

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Request]:
        """The waiting requests (in admission order for fcfs and priority)."""
        raise NotImplementedError


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def pick_victim(self, running: list[Request]) -> Request:
        return running[-1]  # the newest: the oldest keeps going, so someone always finishes

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: list[tuple[tuple[int, float, int], Request]] = []  # sorted by key
        self._order = itertools.count()

    def add(self, request: Request) -> None:
        # lower priority value first, then earlier arrival; a preempted request keeps its
        # arrival time, so it goes back ahead of later arrivals
        key = (request.priority, request.arrival_time, next(self._order))
        bisect.insort(self._queue, (key, request), key=lambda kv: kv[0])

    prepend = add

    def peek(self) -> Request:
        return self._queue[0][1]

    def pop(self) -> Request:
        return self._queue.pop(0)[1]

    def remove(self, request: Request) -> None:
        self._queue = [kv for kv in self._queue if kv[1] is not request]

    def pick_victim(self, running: list[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.arrival_time))

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return (r for _, r in self._queue)


class FairQueue(RequestQueue):
    """Priority lanes, then VTC between the tenants of a lane, then arrival within a tenant.

    Service: each tenant has a virtual token counter, raised by the service its requests get
    divided by their `tenant_weight` (weight 2: twice the service for the same growth):
        prompt_token_weight * prompt tokens + output_token_weight * output tokens.
    A prompt token counts once, when the request is first admitted, and only if it was not a
    prefix-cache hit: as in the paper, a hit costs nothing, and recomputing a preempted
    request is the engine's choice, not service the tenant asked for. An output token counts
    when it is appended (sampled, or a draft accepted; a rejected draft is not service).
    Charging a prompt whole at admission (as the paper does) also makes the next admission of
    the same step see it, whether or not chunked prefill spreads its compute over steps.

    Admission: the best lane (lowest `priority` value) with waiting requests is strict; in
    it, the tenant with the smallest counter (ties: the earlier head request); its oldest
    request (a preempted one goes back to the front of its tenant's line).

    Counter lift (the paper's Algorithm 2): a tenant that becomes backlogged (gets a waiting
    request while it has none waiting) has its counter raised to the smallest counter of the
    other tenants backlogged in the same lane (those it competes with), or if there are none to
    the counter of the tenant that last
    left the queue (by admission). So a tenant that was idle, or running without asking for
    more, cannot bank that time and catch up later: between two backlogged tenants, weighted
    service differs by at most about 2 * max(prompt_token_weight * longest prompt,
    output_token_weight * tokens in a full batch). A preempted request going back does not
    lift: its tenant did not go idle.

    Victim: from the worst lane among the running requests, the tenant with the largest
    counter, its latest admitted request. With one tenant and one lane this is FCFS exactly.
    """

    def __init__(self, prompt_token_weight: float = 1.0, output_token_weight: float = 2.0) -> None:
        self.prompt_token_weight = prompt_token_weight
        self.output_token_weight = output_token_weight
        self.counters: dict[str, float] = {}  # tenant -> virtual token counter; kept while it is idle
        # lane (priority) -> tenant -> its waiting requests, oldest first; empty ones are dropped
        self._lanes: dict[int, dict[str, deque[Request]]] = {}
        self._num_waiting: dict[str, int] = {}  # tenant -> waiting requests in all lanes; backlogged if > 0
        self._last_left: str | None = None  # the tenant whose last waiting request was admitted last
        self._len = 0

    def add(self, request: Request) -> None:
        tenant = _tenant(request)
        if not self._num_waiting.get(tenant):
            self._lift(tenant, request.priority)
        self._line(request, tenant).append(request)
        self._count(tenant, 1)

    def prepend(self, request: Request) -> None:
        tenant = _tenant(request)
        self.counters.setdefault(tenant, 0.0)
        self._line(request, tenant).appendleft(request)
        self._count(tenant, 1)

    def peek(self) -> Request:
        return self._choose()[0]

    def pop(self) -> Request:
        request, lane, tenant = self._choose()
        self._drop(lane, tenant, self._lanes[lane][tenant].popleft())
        if not self._num_waiting.get(tenant):
            self._last_left = tenant
        return request

    def remove(self, request: Request) -> None:
        lane, tenant = request.priority, _tenant(request)
        self._lanes[lane][tenant].remove(request)
        self._drop(lane, tenant, request)

    def pick_victim(self, running: list[Request]) -> Request:
        counters = self.counters
        i = max(range(len(running)),
                key=lambda i: (running[i].priority, counters.get(_tenant(running[i]), 0.0), i))
        return running[i]

    def on_admitted(self, request: Request) -> None:
        # the first admission (a forked sequence is admitted only after a preemption)
        if request.num_preemptions == 0:
            num_new = max(0, request.num_prompt_tokens - request.num_computed_tokens)
            self._charge(request, self.prompt_token_weight * num_new)

    def on_sampled(self, request: Request, num_tokens: int) -> None:
        self._charge(request, self.output_token_weight * num_tokens)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        for lane in sorted(self._lanes):
            for line in self._lanes[lane].values():
                yield from line

    # -- internals ----------------------------------------------------------------
    def _charge(self, request: Request, service: float) -> None:
        tenant = _tenant(request)
        self.counters[tenant] = self.counters.get(tenant, 0.0) + service / request.tenant_weight

    def _lift(self, tenant: str, lane: int) -> None:
        counter = self.counters.get(tenant, 0.0)
        # the tenants it competes with: those waiting in its lane
        backlogged = [self.counters[t] for t in self._lanes.get(lane, {}) if t != tenant]
        if backlogged:
            counter = max(counter, min(backlogged))
        elif self._last_left is not None:
            counter = max(counter, self.counters[self._last_left])
        self.counters[tenant] = counter

    def _choose(self) -> tuple[Request, int, str]:
        lane = min(self._lanes)
        lines = self._lanes[lane]
        tenant = min(lines, key=lambda t: (self.counters[t], lines[t][0].arrival_time))
        return lines[tenant][0], lane, tenant

    def _line(self, request: Request, tenant: str) -> deque[Request]:
        return self._lanes.setdefault(request.priority, {}).setdefault(tenant, deque())

    def _count(self, tenant: str, n: int) -> None:
        self._num_waiting[tenant] = self._num_waiting.get(tenant, 0) + n
        self._len += n

    def _drop(self, lane: int, tenant: str, request: Request) -> None:
        """Bookkeeping after `request` left the line of `tenant` in `lane`."""
        lines = self._lanes[lane]
        if not lines[tenant]:
            del lines[tenant]
            if not lines:
                del self._lanes[lane]
        self._count(tenant, -1)


def _tenant(request: Request) -> str:
    return DEFAULT_TENANT if request.tenant is None else request.tenant


def make_request_queue(policy: str, prompt_token_weight: float = 1.0,
                       output_token_weight: float = 2.0) -> RequestQueue:
    """The waiting queue of a scheduling policy: fcfs | priority | fair (EngineConfig's
    `scheduling_policy`; the token weights are fair's)."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    if policy == "fair":
        return FairQueue(prompt_token_weight, output_token_weight)
    raise ValueError(f"scheduling_policy must be one of fcfs, priority, fair; got {policy!r}")
