"""The limits stores: the same behaviour from LocalLimitStore (memory + SQLite) and
RedisLimitStore (a real redis-server on a free loopback port), then what only Redis
does: replicas sharing limits, atomic admission under threads, Redis lost and back.

Time moves through the `now` argument, never by sleeping."""

from __future__ import annotations

import datetime as dt
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import free_port
from tokenmill.server.limits import LimitStoreUnavailable, LocalLimitStore, Refusal
from tokenmill.server.tenants import Tenant

T0 = dt.datetime(2031, 3, 10, 12, tzinfo=dt.timezone.utc).timestamp()  # a Monday, mid-month
DAY_END = dt.datetime(2031, 3, 11, tzinfo=dt.timezone.utc).timestamp()
NO_REDIS = ("redis-server is not installed: make install installs it from Debian's packages "
            "(apt-get install redis-server)")


class RedisServer:
    """A redis-server subprocess on one port; it can be killed, paused and started again
    on the same port (with `appendonly`, its data comes back from the file)."""

    def __init__(self, directory: Path, appendonly: bool = False) -> None:
        self.port, self.directory, self.appendonly = free_port(), directory, appendonly
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        import redis

        persist = ["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly else ["--appendonly", "no"]
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--dir", str(self.directory), *persist],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except redis.exceptions.RedisError:  # not listening yet, or still loading its file
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)
        client.close()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def flush(self) -> None:
        import redis

        with redis.Redis(port=self.port) as client:
            client.flushall()


def _redis_server(directory: Path, appendonly: bool = False) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip(NO_REDIS)
    pytest.importorskip("redis", reason="the redis package is missing: pip install 'tokenmill[redis]'")
    server = RedisServer(directory, appendonly)
    server.start()
    try:
        yield server
    finally:
        assert server.proc is not None
        server.proc.send_signal(signal.SIGCONT)  # in case a test left it paused
        server.kill()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    yield from _redis_server(tmp_path_factory.mktemp("redis"))


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    redis_server.flush()
    return redis_server.url


def redis_store(url: str, **kwargs: Any) -> Any:
    from tokenmill.server.limits_redis import RedisLimitStore

    return RedisLimitStore(url, **kwargs)


@pytest.fixture(params=["local", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    s = LocalLimitStore(tmp_path / "l.db") if request.param == "local" else redis_store(
        request.getfixturevalue("redis_url"))
    yield s
    s.close()


def tenant(**limits: Any) -> Tenant:
    return Tenant("acme", ("0" * 64,), **limits)


def refused(refusal: Refusal | None, code: str = "rate_limit_exceeded") -> Refusal:
    assert refusal is not None, "admitted, expected a refusal"
    assert refusal.code == code, refusal
    return refusal


# -- the same behaviour from both stores --------------------------------------------------------------------------

def test_requests_per_minute(store: Any) -> None:
    t = tenant(requests_per_minute=3)
    for i in range(3):
        assert store.admit(t, f"r{i}", 10, T0) is None
    r = refused(store.admit(t, "r3", 10, T0))
    assert "requests_per_minute" in r.message and r.retry_after == pytest.approx(20.0)  # a request every 60/3 s
    r = refused(store.admit(t, "r3", 10, T0 + 19))
    assert r.retry_after == pytest.approx(1.0)
    assert store.admit(t, "r3", 10, T0 + 20) is None
    refused(store.admit(t, "r4", 10, T0 + 20))
    assert store.admit(t, "r4", 10, T0 + 60) is None  # refills a third of the bucket every 20 s


def test_tokens_per_minute_reservation_corrected_at_release(store: Any) -> None:
    t = tenant(tokens_per_minute=1000)
    assert store.admit(t, "a", 1000, T0) is None
    r = refused(store.admit(t, "b", 100, T0))
    assert "tokens_per_minute" in r.message and r.retry_after == pytest.approx(6.0)  # 100 tokens at 1000/min
    store.release(t, "a", 4, 6, T0)  # reserved 1000, used 10: 990 come back
    assert store.admit(t, "b", 990, T0) is None
    assert refused(store.admit(t, "c", 1, T0)).retry_after == pytest.approx(0.06)


def test_concurrency(store: Any) -> None:
    t = tenant(max_concurrent_requests=2)
    assert store.admit(t, "a", 1, T0) is None
    assert store.admit(t, "b", 1, T0) is None
    r = refused(store.admit(t, "c", 1, T0))
    assert "2 requests in flight" in r.message and r.retry_after == 1.0
    store.release(t, "a", 1, 0, T0)
    assert store.admit(t, "c", 1, T0) is None
    assert store.usage(t, T0).in_flight == 2


def test_quota(store: Any) -> None:
    t = tenant(token_quota=100, quota_period="day")
    assert store.admit(t, "a", 60, T0) is None
    r = refused(store.admit(t, "b", 50, T0), "insufficient_quota")  # 0 used + 60 reserved + 50 > 100
    assert "reserved by requests in flight" in r.message and r.retry_after == 1.0
    store.release(t, "a", 30, 10, T0)  # 40 used
    r = refused(store.admit(t, "b", 61, T0 + 5), "insufficient_quota")
    assert "has used 40 of its 100-token day quota" in r.message
    assert r.retry_after == pytest.approx(DAY_END - T0 - 5)  # the time to the period's end
    assert store.admit(t, "b", 60, T0 + 5) is None  # 40 + 60 fits exactly


def test_usage(store: Any) -> None:
    t = tenant(token_quota=10_000, quota_period="week")
    assert store.admit(t, "a", 100, T0) is None
    assert store.admit(t, "b", 200, T0) is None
    store.release(t, "a", 20, 30, T0 + 1)
    u = store.usage(t, T0 + 2)
    assert (u.period, u.period_end) == ("2031-03-10", T0 + 7 * 86400 - 12 * 3600)
    assert (u.requests, u.prompt_tokens, u.completion_tokens, u.total_tokens) == (1, 20, 30, 50)
    assert (u.in_flight, u.reserved_tokens) == (1, 200)


def test_release_twice_counts_once(store: Any) -> None:
    t = tenant(tokens_per_minute=1000, max_concurrent_requests=5)
    assert store.admit(t, "a", 500, T0) is None
    assert store.admit(t, "b", 500, T0) is None
    store.release(t, "a", 10, 10, T0)
    store.release(t, "a", 10, 10, T0)
    u = store.usage(t, T0)
    assert (u.requests, u.total_tokens, u.in_flight, u.reserved_tokens) == (1, 20, 1, 500)
    assert refused(store.admit(t, "c", 481, T0)) and store.admit(t, "c", 480, T0) is None  # 480 came back, once


def test_new_quota_period_starts_from_zero(store: Any) -> None:
    t = tenant(token_quota=100, quota_period="day")
    assert store.admit(t, "a", 100, T0) is None
    store.release(t, "a", 50, 50, T0)
    refused(store.admit(t, "b", 1, T0), "insufficient_quota")
    tomorrow = T0 + 86400
    u = store.usage(t, tomorrow)
    assert (u.period, u.requests, u.total_tokens) == ("2031-03-11", 0, 0)
    assert store.admit(t, "b", 100, tomorrow) is None
    assert store.usage(t, T0).total_tokens == 100  # yesterday's is kept


def test_threads_never_over_admit(store: Any) -> None:
    _hammer([store], tenant(max_concurrent_requests=10), 10)
    _hammer([store], Tenant("other", ("1" * 64,), requests_per_minute=100), 100)


def _hammer(stores: list[Any], t: Tenant, limit: int, threads: int = 8, each: int = 50) -> None:
    """`threads` x `each` admits at once, spread over the stores: exactly `limit` get in."""
    admitted: list[str] = []
    start = threading.Barrier(threads)

    def run(k: int) -> None:
        start.wait()
        for i in range(each):
            if stores[k % len(stores)].admit(t, f"t{k}-{i}", 1, T0) is None:
                admitted.append(f"t{k}-{i}")

    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(admitted) == limit
    assert stores[0].usage(t, T0).in_flight == limit


# -- Redis only ---------------------------------------------------------------------------------------------------

def test_replicas_share_limits(redis_url: str) -> None:
    a, b = redis_store(redis_url), redis_store(redis_url)
    t = tenant(max_concurrent_requests=2, token_quota=100, quota_period="month")
    assert a.admit(t, "1", 30, T0) is None
    assert b.admit(t, "2", 30, T0) is None
    refused(a.admit(t, "3", 30, T0))  # concurrency across both
    refused(b.admit(t, "3", 30, T0))
    a.release(t, "2", 30, 30, T0)  # released by the other replica: fine, it is one store
    b.release(t, "1", 10, 0, T0)
    u = b.usage(t, T0)
    assert (u.requests, u.total_tokens, u.in_flight) == (2, 70, 0)
    r = refused(a.admit(t, "3", 31, T0), "insufficient_quota")  # quota across both
    assert "has used 70 of its 100-token month quota" in r.message
    assert b.admit(t, "3", 30, T0) is None
    a.close(), b.close()


def test_replicas_under_threads_never_over_admit(redis_url: str) -> None:
    stores = [redis_store(redis_url) for _ in range(2)]
    _hammer(stores, tenant(max_concurrent_requests=10), 10)
    _hammer(stores, Tenant("other", ("1" * 64,), requests_per_minute=100), 100)
    for s in stores:
        s.close()


def test_limits_are_read_from_the_tenant_each_call(redis_url: str) -> None:
    s = redis_store(redis_url)
    assert s.admit(tenant(max_concurrent_requests=1), "a", 1, T0) is None
    refused(s.admit(tenant(max_concurrent_requests=1), "b", 1, T0))
    assert s.admit(tenant(max_concurrent_requests=2), "b", 1, T0) is None  # the tenants file changed
    assert s.admit(tenant(), "c", 1, T0) is None  # no limit at all
    s.close()


def test_requests_in_flight_expire(redis_url: str) -> None:
    s = redis_store(redis_url, request_ttl=600)
    t = tenant(max_concurrent_requests=1, token_quota=1000, quota_period="total")
    assert s.admit(t, "lost", 500, T0) is None  # its replica dies: never released
    refused(s.admit(t, "b", 1, T0 + 599))
    u = s.usage(t, T0 + 601)
    assert (u.in_flight, u.reserved_tokens) == (0, 0)
    assert s.admit(t, "b", 1000, T0 + 601) is None
    s.release(t, "lost", 100, 100, T0 + 602)  # too late: counts nothing
    assert s.usage(t, T0 + 602).requests == 0
    s.close()


def test_retried_admit_counts_once(redis_url: str) -> None:
    s = redis_store(redis_url)  # a retry after a lost reply runs the script again with the same id
    t = tenant(max_concurrent_requests=2, requests_per_minute=2)
    assert s.admit(t, "a", 1, T0) is None and s.admit(t, "a", 1, T0) is None
    assert s.usage(t, T0).in_flight == 1
    assert s.admit(t, "b", 1, T0) is None
    s.close()


def test_unreachable_at_start(tmp_path: Path) -> None:
    pytest.importorskip("redis")
    url = f"redis://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=f"--limits-store {url}: cannot reach Redis"):
        redis_store(url)
    with pytest.raises(ValueError, match="--limits-store"):
        redis_store("http://example.com")


def _timed(call: Callable[[], object]) -> float:
    start = time.monotonic()
    with pytest.raises(LimitStoreUnavailable, match="127.0.0.1"):
        call()
    return time.monotonic() - start


def test_redis_lost_and_back(tmp_path: Path) -> None:
    """Killed: admit and release fail at once (503s). Restarted from its append-only file:
    the requests admitted before are released exactly once, the failed release replayed by
    the store itself and retried by its caller."""
    for server in _redis_server(tmp_path, appendonly=True):
        s = redis_store(server.url)
        t = tenant(max_concurrent_requests=3, token_quota=1000, quota_period="month")
        assert s.admit(t, "a", 100, T0) is None and s.admit(t, "b", 100, T0) is None
        server.kill()
        assert _timed(lambda: s.admit(t, "c", 100, T0)) < 2
        assert _timed(lambda: s.release(t, "a", 10, 10, T0)) < 2
        assert _timed(lambda: s.usage(t, T0)) < 2
        server.start()
        s.release(t, "b", 20, 20, T0)  # replays a's release first
        u = s.usage(t, T0)
        assert (u.requests, u.total_tokens, u.in_flight, u.reserved_tokens) == (2, 60, 0, 0)
        s.release(t, "a", 10, 10, T0)  # the caller retries: counts nothing
        s.release(t, "b", 20, 20, T0)
        assert s.usage(t, T0).total_tokens == 60
        assert s.admit(t, "c", 100, T0) is None
        s.close()


def test_redis_hanging_fails_fast(redis_url: str, redis_server: RedisServer) -> None:
    """Paused (a hung Redis, a network that drops packets): timeouts, not hung requests.
    The timed-out admit still runs when Redis wakes up; the store cancels it, as the
    caller answered 503 and will never release it."""
    s = redis_store(redis_url)
    t = tenant(max_concurrent_requests=2, tokens_per_minute=100)
    assert s.admit(t, "a", 10, T0) is None
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        assert _timed(lambda: s.admit(t, "b", 50, T0)) < 2
        assert _timed(lambda: s.release(t, "a", 1, 1, T0)) < 2
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    u = s.usage(t, T0)
    assert (u.requests, u.total_tokens, u.in_flight, u.reserved_tokens) == (1, 2, 0, 0)
    s.release(t, "a", 1, 1, T0)
    assert s.usage(t, T0).requests == 1
    assert s.admit(t, "c", 98, T0) is None  # b's 50 tokens came back, and a's 8 unused
    s.close()


# -- Local only ---------------------------------------------------------------------------------------------------

def test_local_usage_survives_a_restart(tmp_path: Path) -> None:
    t = tenant(token_quota=100, quota_period="day")
    s = LocalLimitStore(tmp_path / "l.db")
    assert s.admit(t, "a", 50, T0) is None
    s.release(t, "a", 20, 20, T0)
    s.close()
    s = LocalLimitStore(tmp_path / "l.db")
    u = s.usage(t, T0)
    assert (u.requests, u.total_tokens, u.in_flight) == (1, 40, 0)
    refused(s.admit(t, "b", 61, T0), "insufficient_quota")
    s.close()
