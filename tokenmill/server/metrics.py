"""Prometheus metrics (prometheus_client), fed by the engine thread after every step.

Names carry the `tokenmill:` prefix and their unit; the README lists them all.
Latencies are measured from the request's arrival at the server.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.engine.request import RequestOutput

# seconds; fine at the low end, where a CPU decode step or a GPU TTFT lives
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_THROUGHPUT_WINDOW_S = 5.0


class ServerMetrics:
    """Implements EngineClient's StepObserver; `render()` is the /metrics body."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"tokenmill:{name}", doc, ["model_name", *extra], registry=r)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"tokenmill:{name}", doc, ["model_name"], buckets=_LATENCY_BUCKETS,
                             registry=r).labels(**labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tokenmill:{name}", doc, ["model_name"], registry=r).labels(**labels)

        self._labels = labels
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed").labels(**labels)
        self.generation_tokens = counter("generation_tokens", "Tokens generated").labels(**labels)
        self.requests_finished = counter("request_finished", "Requests finished, by finish reason "
                                         "(stop, length, abort, error)", ("finished_reason",))
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache").labels(**labels)
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache").labels(**labels)
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed later)").labels(**labels)
        # speculative decoding (vLLM's names), mirrored from the engine's running totals
        self._spec = {name: counter(name, doc).labels(**labels) for name, doc in (
            ("spec_decode_num_draft_tokens", "Draft tokens verified"),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted"),
            ("spec_decode_num_unspeculated_steps", "Request steps served without speculation because of the "
                                                   "request's features (sampling, penalties, ...)"))}
        self._spec_per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by "
                                     "position among the drafts", ("position",))
        self._spec_by_k = counter("spec_decode_num_steps_by_k", "Request steps of speculating requests, by the "
                                  "number of drafts chosen for them (adaptive speculation)", ("k",))
        self._seen_spec: dict[str, int] = {}
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token")
        self.tpot = histogram("time_per_output_token_seconds", "Per request: (last token - first token) / "
                              "(output tokens - 1)")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled")
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to run")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)")
        # per tenant (label `tenant`, from the tenants file: a bounded set)
        self.tenant_prompt_tokens = counter("tenant_prompt_tokens", "Prompt tokens processed, by tenant", ("tenant",))
        self.tenant_generation_tokens = counter("tenant_generation_tokens", "Tokens generated, by tenant",
                                                ("tenant",))
        self.tenant_requests = counter("tenant_requests", "Requests by tenant and outcome: stop, length, abort, "
                                       "error, rate_limited, quota_exceeded", ("tenant", "outcome"))
        self.tenant_queue_time = Histogram("tokenmill:tenant_request_queue_time_seconds", "Arrival to first "
                                           "scheduled, by tenant", ["model_name", "tenant"], buckets=_LATENCY_BUCKETS,
                                           registry=r)
        self.tenant_ttft = Histogram("tokenmill:tenant_time_to_first_token_seconds", "Arrival to first generated "
                                     "token, by tenant", ["model_name", "tenant"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / "
                                     "tokens looked up, since start (0..1)")
        self.throughput = gauge("generation_throughput_toks_per_s", "Tokens generated per second over the "
                                f"last {_THROUGHPUT_WINDOW_S:g} s")
        self.throughput.set_function(self._window_throughput)
        self._lock = threading.Lock()
        self._window: deque[tuple[float, int]] = deque()  # (time, tokens generated in that step)
        self._last_token_time: dict[str, dict[int, float]] = {}  # request id -> sequence index (n > 1) -> time
        self._seen_prefix = (0, 0)
        self._seen_preemptions = 0

    def observe_step(self, outputs: Sequence[RequestOutput], stats: dict[str, float], now: float) -> None:
        new_tokens = 0
        for out in outputs:
            n = len(out.new_token_ids)
            new_tokens += n
            m = out.metrics
            index = out.outputs[0].index
            last_times = self._last_token_time.setdefault(out.request_id, {})
            last = last_times.get(index)
            tenant = out.tenant
            if n:
                if tenant is not None:
                    self.tenant_generation_tokens.labels(**self._labels, tenant=tenant).inc(n)
                if last is None and index == 0:  # the prompt is done: first token(s)
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                    if m.first_token_time is not None:
                        self.ttft.observe(m.first_token_time - m.arrival_time)
                    if m.first_scheduled_time is not None:
                        self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
                    if tenant is not None:
                        self._observe_tenant_start(tenant, out)
                elif last is not None:
                    for _ in range(n):  # several tokens in one step share the gap
                        self.itl.observe((now - last) / n)
                last_times[index] = now
            if out.finished:
                self._finish(out, now)
        self.generation_tokens.inc(new_tokens)
        with self._lock:
            self._window.append((now, new_tokens))
            self._prune(now)
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.kv_usage.set(stats["kv_cache_usage"])
        self.prefix_hit_rate.set(stats["prefix_cache_hit_rate"])
        queries, hits = int(stats["prefix_cache_queries"]), int(stats["prefix_cache_hits"])
        # an engine core that was restarted counts from zero again
        self.prefix_queries.inc(_since(queries, self._seen_prefix[0]))
        self.prefix_hits.inc(_since(hits, self._seen_prefix[1]))
        self._seen_prefix = (queries, hits)
        preemptions = int(stats["num_preemptions"])
        self.preemptions.inc(_since(preemptions, self._seen_preemptions))
        self._seen_preemptions = preemptions
        if stats.get("spec_decode_num_draft_tokens"):
            self._observe_spec(stats)

    def _observe_spec(self, stats: dict) -> None:
        totals: dict[str | tuple[str, str], int] = {name: int(stats[name]) for name in self._spec}
        totals.update({("position", str(j)): n
                       for j, n in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"])})
        totals.update({("k", str(k)): n for k, n in enumerate(stats["spec_decode_num_steps_by_k"])})
        for name, total in totals.items():
            new = _since(total, self._seen_spec.get(name, 0))
            if new:
                if isinstance(name, str):
                    counter = self._spec[name]
                elif name[0] == "position":
                    counter = self._spec_per_pos.labels(**self._labels, position=name[1])
                else:
                    counter = self._spec_by_k.labels(**self._labels, k=name[1])
                counter.inc(new)
                self._seen_spec[name] = total

    def _observe_tenant_start(self, tenant: str, out: RequestOutput) -> None:
        m = out.metrics
        labels = {**self._labels, "tenant": tenant}
        self.tenant_prompt_tokens.labels(**labels).inc(len(out.prompt_token_ids))
        if m.first_token_time is not None:
            self.tenant_ttft.labels(**labels).observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.tenant_queue_time.labels(**labels).observe(m.first_scheduled_time - m.arrival_time)

    def tenant_refused(self, tenant: str, outcome: str) -> None:
        """A request refused at admission: `rate_limited` or `quota_exceeded`."""
        self.tenant_requests.labels(**self._labels, tenant=tenant, outcome=outcome).inc()

    def _finish(self, out: RequestOutput, now: float) -> None:
        self._last_token_time.pop(out.request_id, None)
        completion = out.outputs[0]
        reason = "error" if out.error is not None else (completion.finish_reason or "abort")
        self.requests_finished.labels(finished_reason=reason, **self._labels).inc()
        if out.tenant is not None and out.outputs[0].index == 0:  # a request once, not each of its sequences
            self.tenant_requests.labels(**self._labels, tenant=out.tenant, outcome=reason).inc()
        if reason not in ("stop", "length"):
            return
        m = out.metrics
        self.e2e.observe(now - m.arrival_time)
        num_out = len(completion.token_ids)
        if num_out > 1 and m.first_token_time is not None and m.last_token_time is not None:
            self.tpot.observe((m.last_token_time - m.first_token_time) / (num_out - 1))

    def _window_throughput(self) -> float:
        with self._lock:
            self._prune(time.time())
            tokens = sum(n for _, n in self._window)
        return tokens / _THROUGHPUT_WINDOW_S

    def _prune(self, now: float) -> None:
        while self._window and self._window[0][0] < now - _THROUGHPUT_WINDOW_S:
            self._window.popleft()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _since(total: int, seen: int) -> int:
    """What a running total added since it was `seen`; a total below that started again from
    zero (a restarted engine core)."""
    return total - seen if total >= seen else total
