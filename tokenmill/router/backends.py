"""The standalone router's backends: which answer, how loaded each is, what each caches.

    each backend, every --poll-interval (its own loop, so a slow one delays no other):
      GET /health                         200: healthy (an unhealthy one is recovered)
      GET /metrics                        num_requests_running + num_requests_waiting
      GET /v1/prefix_cache?since=CURSOR   its prefix-cache changes -> PrefixRouter's mirror
    any of them failing, or a proxied request that cannot reach it -> unhealthy at once,
    its mirror cleared; it is skipped until a poll finds it answering again

A backend's load is what others put on it as of the last poll (its running and waiting
requests less this router's in flight then) plus this router's in flight now, so requests
routed between two polls count at once and none counts twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.prefix import PrefixRouter
from tokenmill.router.summary import Summary

logger = logging.getLogger("tokenmill.router")

POLL_TIMEOUT_S = 5.0  # a poll not answered by then marks the backend unhealthy
DEFAULT_BLOCK_SIZE = 16  # until a backend's summary tells its own
_LOAD_GAUGES = ("tokenmill:num_requests_running", "tokenmill:num_requests_waiting")
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def backend_url(url: str) -> str:
    """A --backend value as a base URL without a trailing slash; raises ValueError naming
    the flag when it is not http(s)://HOST[:PORT]."""
    parts = urlsplit(url)
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:  # a port that is not a number
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or parts.query or parts.fragment:
        raise ValueError(f"--backend: expected a server's base URL such as http://HOST:PORT, got {url!r}")
    return url.rstrip("/")


@dataclass
class Backend:
    url: str
    index: int
    healthy: bool = False
    in_flight: int = 0  # requests this router has sent there and not finished
    others: int = 0  # requests running or waiting there that this router had not sent, at the last poll
    cursor: str | None = None  # of its prefix-cache summary
    generation: int = 0  # bumped when it goes unhealthy: a poll begun before is then discarded
    summary_error: str | None = None

    @property
    def load(self) -> int:
        return self.others + self.in_flight


class Backends:
    """The backends, their health and the PrefixRouter that picks one per request. `api_key`:
    sent with the router's own summary polls. Used on one event loop."""

    def __init__(self, urls: Sequence[str], policy: str = "prefix", poll_interval: float = 1.0,
                 api_key: str | None = None, metrics: RouterMetrics | None = None) -> None:
        if not urls:
            raise ValueError("--backend: give at least one backend URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"--backend: a URL is given twice: {sorted(urls)}")
        if not poll_interval > 0:
            raise ValueError(f"--poll-interval must be > 0 seconds, got {poll_interval}")
        self.backends = [Backend(url, i) for i, url in enumerate(urls)]
        self.router = PrefixRouter(len(urls), DEFAULT_BLOCK_SIZE, policy)
        self.block_size: int | None = None  # the backends', from the first summary
        self.poll_interval = poll_interval
        self.metrics = metrics or RouterMetrics()
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        for b in self.backends:
            self.metrics.watch(b.url, lambda b=b: b.healthy, lambda b=b: b.in_flight, lambda b=b: b.load,
                               lambda b=b: len(self.router.held[b.index]))

    async def start(self) -> None:
        """Polls every backend once (so the first requests find the healthy ones), then
        keeps polling each in the background."""
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=POLL_TIMEOUT_S))
        await asyncio.gather(*(self.poll(b) for b in self.backends))
        self._tasks = [asyncio.create_task(self._keep_polling(b)) for b in self.backends]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.session is not None:
            await self.session.close()

    @property
    def any_healthy(self) -> bool:
        return any(b.healthy for b in self.backends)

    def choose(self, token_ids: Sequence[int] | None, tried: set[int]) -> Backend | None:
        """The healthy backend, not yet tried, for a prompt (None: a request that has none, as
        GET /v1/models: the first healthy one); None when there is none left."""
        alive = [b.healthy and b.index not in tried for b in self.backends]
        if not any(alive):
            return None
        if token_ids is None:
            return self.backends[alive.index(True)]
        router = self.router
        matched, prompt = router.num_matched_blocks, router.num_prompt_blocks
        backend = self.backends[router.route(token_ids, [b.load for b in self.backends], alive)]
        self.metrics.matched_blocks.inc(router.num_matched_blocks - matched)
        self.metrics.prompt_blocks.inc(router.num_prompt_blocks - prompt)
        self.metrics.routed.labels(backend=backend.url).inc()
        return backend

    def mark_unhealthy(self, backend: Backend, why: str) -> None:
        if backend.healthy:
            logger.warning("backend %s is unhealthy: %s", backend.url, why)
        backend.healthy = False
        backend.generation += 1
        backend.cursor = None  # its next summary is a whole one
        backend.others = 0
        self.router.apply_events(backend.index, None)

    # -- polling ----------------------------------------------------------------
    async def _keep_polling(self, backend: Backend) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self.poll(backend)
            except Exception:  # noqa: BLE001 - the poller outlives any one bad answer
                logger.exception("polling %s failed", backend.url)

    async def poll(self, backend: Backend) -> None:
        """Health, load and prefix-cache changes of one backend; unhealthy if any fails."""
        generation = backend.generation
        try:
            async with self._get(backend, "/health") as r:
                if r.status != 200:
                    raise _Unhealthy(f"/health answered {r.status}")
            async with self._get(backend, "/metrics") as r:
                if r.status != 200:
                    raise _Unhealthy(f"/metrics answered {r.status}")
                queued = _queued_requests(await r.text())
            since = {"since": backend.cursor} if backend.cursor else {}
            async with self._get(backend, "/v1/prefix_cache", params=since, headers=self._auth) as r:
                summary = await self._summary(backend, r)
        except (*TRANSPORT_ERRORS, ValueError, _Unhealthy) as e:  # ValueError: /metrics unreadable
            if generation == backend.generation:
                self.mark_unhealthy(backend, f"{type(e).__name__}: {e}".rstrip(": "))
            return
        if generation != backend.generation:  # marked unhealthy meanwhile: its answers are stale
            return
        if not backend.healthy:
            logger.info("backend %s is healthy", backend.url)
        backend.healthy = True
        backend.others = max(0, queued - backend.in_flight)
        if summary is not None:
            self._apply(backend, summary)

    def _get(self, backend: Backend, path: str, **kwargs: Any) -> Any:
        assert self.session is not None
        return self.session.get(backend.url + path, **kwargs)

    async def _summary(self, backend: Backend, r: aiohttp.ClientResponse) -> Summary | None:
        """A backend that keeps no summary (or refuses this router's key) is routed by load."""
        error = None
        if r.status != 200:
            error = f"GET /v1/prefix_cache answered {r.status}: {(await r.text())[:200]}"
        else:
            try:
                return Summary.parse(await r.json())
            except ValueError as e:
                error = str(e)
        if error != backend.summary_error:
            logger.warning("backend %s: no prefix-cache summary, routing it by load only (%s)", backend.url, error)
            backend.summary_error = error
        return None

    def _apply(self, backend: Backend, summary: Summary) -> None:
        router = self.router
        if self.block_size is None:
            # the first summary sets the block size: hashes held under the default go
            self.block_size = router.block_size = summary.block_size
            for b in self.backends:
                router.apply_events(b.index, None)
        if summary.block_size != self.block_size:
            logger.warning("backend %s has --block-size %d, the others %d: routing it by load only",
                           backend.url, summary.block_size, self.block_size)
            return
        if summary.reset:
            router.apply_events(backend.index, None)
        router.apply_events(backend.index, summary.events())
        backend.cursor = summary.cursor
        backend.summary_error = None


class _Unhealthy(Exception):
    """A backend answered, but not as a healthy one does."""


def _queued_requests(text: str) -> int:
    """Running plus waiting requests, from a tokenmill server's /metrics text."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name in _LOAD_GAUGES:
            total += sum(s.value for s in family.samples)
    return int(total)
