"""The standalone router's own Prometheus metrics (its GET /metrics); every series about a
backend is labelled `backend` with its URL (a bounded set: the --backend flags)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.routed = Counter("tokenmill:router_requests_routed", "Requests sent to a backend (a retry counts "
                              "again, on the backend it went to)", ["backend"], registry=r)
        self.retries = Counter("tokenmill:router_retries", "Requests that could not reach a backend before it "
                               "answered and were sent to another, by the backend that failed", ["backend"],
                               registry=r)
        self.failed = Counter("tokenmill:router_backend_failures", "Requests whose backend failed after its answer "
                              "had started (a 502, or an error event in the stream)", ["backend"], registry=r)
        self.unavailable = Counter("tokenmill:router_no_backend", "Requests answered 503: no healthy backend left "
                                   "to try", registry=r)
        self.matched_blocks = Counter("tokenmill:router_matched_blocks", "Prompt blocks found in the chosen "
                                      "backend's prefix-cache mirror", registry=r)
        self.prompt_blocks = Counter("tokenmill:router_prompt_blocks", "Full blocks of the prompts routed",
                                     registry=r)
        self._healthy = Gauge("tokenmill:router_backend_healthy", "1 while the backend answers, else 0",
                              ["backend"], registry=r)
        self._in_flight = Gauge("tokenmill:router_backend_in_flight", "Requests this router has in flight there",
                                ["backend"], registry=r)
        self._load = Gauge("tokenmill:router_backend_load", "Requests running or waiting there: others' as of "
                           "the last poll plus this router's in flight", ["backend"], registry=r)
        self._cached = Gauge("tokenmill:router_backend_cached_blocks", "Block hashes in the backend's "
                             "prefix-cache mirror", ["backend"], registry=r)

    def watch(self, backend: str, healthy: Callable[[], bool], in_flight: Callable[[], int],
              load: Callable[[], int], cached: Callable[[], int]) -> None:
        """The backend's gauges read its state when scraped."""
        self._healthy.labels(backend=backend).set_function(lambda: float(healthy()))
        self._in_flight.labels(backend=backend).set_function(in_flight)
        self._load.labels(backend=backend).set_function(load)
        self._cached.labels(backend=backend).set_function(cached)
        for counter in (self.routed, self.retries, self.failed):  # present at 0 from the start
            counter.labels(backend=backend)

    def render(self) -> bytes:
        return generate_latest(self.registry)
