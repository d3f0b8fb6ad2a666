"""Admission by tenant: rate limits, concurrency limits and token quotas.

    request -> Limits.admit(tenant, reserved tokens)  -> Grant, or 429 (LimitExceeded),
                                                         or 503 (the store is unreachable)
            -> generation ...
            -> Limits.release(grant, prompt, completion)  the reservation corrected to use

Rate limits are token buckets per tenant that refill over a minute: one for
requests, one for tokens. A request reserves its prompt plus `max_tokens` (times
its sequences) at admission, and gets back what it did not use when it finishes.
A request over a limit is refused at once, never queued behind it, so other
tenants are not slowed. Quotas count prompt + completion tokens per period; a
request is admitted only while its reservation fits in what is left, so a quota
is never overrun.

Stores: `LocalLimitStore` keeps buckets and counters in memory and the quota
usage in SQLite (WAL mode, a row per tenant and period, written as each request
finishes), so usage survives a restart, SIGTERM and SIGKILL (only requests still
in flight are lost). `RedisLimitStore` (limits_redis.py) shares all of it between
replicas.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tokenmill.server.tenants import Tenant, Tenants

logger = logging.getLogger("tokenmill.server")
_SCHEMA = """CREATE TABLE IF NOT EXISTS usage (
    tenant TEXT NOT NULL, period TEXT NOT NULL, requests INTEGER NOT NULL DEFAULT 0,
    prompt_tokens INTEGER NOT NULL DEFAULT 0, completion_tokens INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, period))"""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request was not admitted: `code` is OpenAI's (`rate_limit_exceeded`,
    `insufficient_quota`); `retry_after` in seconds."""

    code: str
    message: str
    retry_after: float


@dataclass(slots=True)
class Usage:
    """A tenant's usage in its current quota period."""

    period: str
    period_end: float
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    in_flight: int = 0
    reserved_tokens: int = 0  # held by requests in flight

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class LimitStoreUnavailable(RuntimeError):
    """The shared store cannot be reached (Redis down)."""


class LimitStore(Protocol):
    def admit(self, tenant: Tenant, request_id: str, tokens: int, now: float) -> Refusal | None:
        """Counts the request in (concurrency, buckets, reservation) unless a limit refuses it."""

    def release(self, tenant: Tenant, request_id: str, prompt_tokens: int, completion_tokens: int,
                now: float) -> None:
        """The request has finished: its reservation becomes its use. Counted once per id."""

    def usage(self, tenant: Tenant, now: float) -> Usage: ...

    def close(self) -> None: ...


def check(tenant: Tenant, usage: Usage, tokens: int, concurrent: int, request_level: float, token_level: float,
          now: float) -> Refusal | None:
    """The admission rules on a snapshot of the tenant's state (shared by the stores; the
    Redis store runs the same rules in Lua). Levels are the buckets' contents now."""
    if tenant.token_quota is not None:
        used = usage.total_tokens
        if used + tokens > tenant.token_quota:
            return Refusal("insufficient_quota", f"tenant {tenant.name!r} has used {used} of its {tenant.token_quota}"
                           f"-token {tenant.quota_period} quota; this request reserves {tokens} (prompt + max_tokens)",
                           _until(usage.period_end, now))
        if used + usage.reserved_tokens + tokens > tenant.token_quota:
            return Refusal("insufficient_quota", f"tenant {tenant.name!r}: {usage.reserved_tokens} tokens of its "
                           f"quota are reserved by requests in flight; this request reserves {tokens}", 1.0)
    if tenant.max_concurrent_requests is not None and concurrent >= tenant.max_concurrent_requests:
        return Refusal("rate_limit_exceeded", f"tenant {tenant.name!r} has {concurrent} requests in flight "
                       f"(max_concurrent_requests {tenant.max_concurrent_requests})", 1.0)
    if tenant.requests_per_minute is not None and request_level < 1:
        wait = (1 - request_level) * 60 / max(tenant.requests_per_minute, 1e-9)
        return Refusal("rate_limit_exceeded", f"tenant {tenant.name!r} is over its requests_per_minute "
                       f"({tenant.requests_per_minute})", wait)
    if tenant.tokens_per_minute is not None and token_level < tokens:
        wait = (tokens - token_level) * 60 / max(tenant.tokens_per_minute, 1e-9)
        return Refusal("rate_limit_exceeded", f"tenant {tenant.name!r} is over its tokens_per_minute "
                       f"({tenant.tokens_per_minute}); this request reserves {tokens} tokens (prompt + max_tokens)",
                       wait)
    return None


def _until(end: float, now: float) -> float:
    return 86400.0 * 365 if math.isinf(end) else max(1.0, end - now)


@dataclass(slots=True)
class _Bucket:
    """Refills `capacity` per minute, up to `capacity`; starts full."""

    capacity: float
    level: float
    updated: float

    def refill(self, now: float) -> float:
        if now > self.updated:  # a clock stepped back refills nothing until it catches up
            self.level = min(self.capacity, self.level + (now - self.updated) * self.capacity / 60)
            self.updated = now
        return self.level


@dataclass(slots=True)
class _TenantState:
    usage: Usage
    requests: _Bucket | None
    tokens: _Bucket | None
    in_flight: dict[str, int] = field(default_factory=dict)  # request id -> reserved tokens
    period_start: float = math.inf  # of usage's period


class LocalLimitStore:
    """One server's limits: buckets and counters in memory, quota usage in SQLite (a file, or
    ":memory:" when nothing needs to survive)."""

    def __init__(self, db_path: str | Path = ":memory:") -> None:
        if str(db_path) != ":memory:":
            Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        # the event loop's thread calls in; tests run servers on other threads
        self._db = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: a commit survives the process being killed (not a power cut), with no fsync
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)
        self._lock = threading.Lock()
        self._state: dict[str, _TenantState] = {}

    def admit(self, tenant: Tenant, request_id: str, tokens: int, now: float) -> Refusal | None:
        with self._lock:
            state = self._tenant(tenant, now)
            levels = [b.refill(now) if b is not None else math.inf for b in (state.requests, state.tokens)]
            refusal = check(tenant, state.usage, tokens, len(state.in_flight), levels[0], levels[1], now)
            if refusal is not None:
                return refusal
            if state.requests is not None:
                state.requests.level -= 1
            if state.tokens is not None:
                state.tokens.level -= tokens
            state.in_flight[request_id] = tokens
            state.usage.in_flight += 1
            state.usage.reserved_tokens += tokens
            return None

    def release(self, tenant: Tenant, request_id: str, prompt_tokens: int, completion_tokens: int,
                now: float) -> None:
        with self._lock:
            state = self._state.get(tenant.name)
            reserved = None if state is None else state.in_flight.pop(request_id, None)
            if state is None or reserved is None:
                return  # released already
            # the period's now: a request that ran across a period's end counts in the new one
            usage = self._tenant(tenant, now).usage
            usage.in_flight -= 1
            usage.reserved_tokens -= reserved
            usage.requests += 1
            usage.prompt_tokens += prompt_tokens
            usage.completion_tokens += completion_tokens
            if state.tokens is not None:  # what was reserved and not used goes back
                state.tokens.level = min(state.tokens.capacity, state.tokens.level + reserved
                                         - prompt_tokens - completion_tokens)
            self._db.execute(
                "INSERT INTO usage VALUES (?, ?, 1, ?, ?) ON CONFLICT (tenant, period) DO UPDATE SET "
                "requests = requests + 1, prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
                "completion_tokens = completion_tokens + excluded.completion_tokens",
                (tenant.name, usage.period, prompt_tokens, completion_tokens))

    def usage(self, tenant: Tenant, now: float) -> Usage:
        with self._lock:
            u = self._tenant(tenant, now).usage
            return Usage(u.period, u.period_end, u.requests, u.prompt_tokens, u.completion_tokens, u.in_flight,
                         u.reserved_tokens)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tenant(self, tenant: Tenant, now: float) -> _TenantState:
        state = self._state.get(tenant.name)
        if state is not None and state.period_start <= now < state.usage.period_end:
            return state  # the common case, without calendar arithmetic (admission stays ~10 us)
        period, start, end = tenant.period(now)
        if state is None:
            def bucket(per_minute: int | None) -> _Bucket | None:
                return None if per_minute is None else _Bucket(per_minute, per_minute, now)

            state = _TenantState(self._load(tenant.name, period, end), bucket(tenant.requests_per_minute),
                                 bucket(tenant.tokens_per_minute))
            self._state[tenant.name] = state
        elif state.usage.period != period:  # a new period: its usage starts from the file
            fresh = self._load(tenant.name, period, end)
            fresh.in_flight, fresh.reserved_tokens = state.usage.in_flight, state.usage.reserved_tokens
            state.usage = fresh
        state.period_start = start
        return state

    def _load(self, name: str, period: str, end: float) -> Usage:
        row = self._db.execute("SELECT requests, prompt_tokens, completion_tokens FROM usage WHERE tenant = ? AND "
                               "period = ?", (name, period)).fetchone()
        return Usage(period, end, *(row or (0, 0, 0)))


class LimitExceeded(Exception):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


@dataclass(slots=True)
class Grant:
    """An admitted request; `counted` is False when a fail-open store let it in uncounted."""

    tenant: Tenant
    request_id: str
    reserved_tokens: int
    counted: bool = True
    released: bool = False


class Limits:
    """The server's admission front over one store. `fail_open`: when the store is unreachable,
    admit requests uncounted instead of refusing them (503)."""

    def __init__(self, tenants: Tenants, store: LimitStore, fail_open: bool = False) -> None:
        self.tenants = tenants
        self.store = store
        self.fail_open = fail_open

    def admit(self, tenant: Tenant, request_id: str, tokens: int) -> Grant:
        """Raises LimitExceeded (429) or LimitStoreUnavailable (503, unless failing open)."""
        try:
            refusal = self.store.admit(tenant, request_id, tokens, time.time())
        except LimitStoreUnavailable:
            if not self.fail_open:
                raise
            return Grant(tenant, request_id, tokens, counted=False)
        if refusal is not None:
            raise LimitExceeded(refusal)
        return Grant(tenant, request_id, tokens)

    def release(self, grant: Grant, prompt_tokens: int, completion_tokens: int) -> None:
        """Corrects the reservation to the tokens used; at most once per grant. A store that is
        down keeps the request reserved until it can take the release (RedisLimitStore replays
        it; its entries also expire)."""
        if grant.released or not grant.counted:
            return
        grant.released = True
        try:
            self.store.release(grant.tenant, grant.request_id, prompt_tokens, completion_tokens, time.time())
        except LimitStoreUnavailable as e:  # the Redis store sends it again once Redis is back
            logger.warning("could not release request %s of tenant %s yet: %s", grant.request_id,
                           grant.tenant.name, e)

    def usage(self, tenant: Tenant) -> Usage:
        return self.store.usage(tenant, time.time())

    def close(self) -> None:
        self.store.close()
