"""`--limits-store redis://HOST:PORT`: tenants' limits shared by several replicas.

The same rules as `limits.check()`, run inside Redis: admit and release are one Lua
script each, so two replicas admitting for one tenant at the same instant never both
take its last slot. Keys, all of one tenant under one hash tag (one Redis Cluster slot):

    {prefix}{tenant}:buckets          hash  requests, requests_at, tokens, tokens_at
                                            (levels and when they were last refilled)
    {prefix}{tenant}:inflight         zset  request id -> deadline (admitted + request_ttl)
    {prefix}{tenant}:reserved         hash  request id -> tokens it reserved
    {prefix}{tenant}:usage:{period}   hash  requests, prompt_tokens, completion_tokens

A request still in flight past its deadline is dropped by the next script that touches
its tenant, so a replica that died holding requests frees its tenant's concurrency
after `request_ttl`. Release counts a request only if it is still in flight: releasing
twice, or after it expired, or retrying a call whose reply was lost, counts nothing.
The tenants file stays the truth: each call passes the tenant's limits to the script.

A call that fails (timeout, connection lost) may still have run: Redis can execute a
script whose reply never arrived. So a replica keeps what it could not confirm and
replays it at its next call that reaches Redis: a failed release is sent again (counted
once, whichever copy lands), a failed admit is cancelled (the caller answered 503 and
will never release it; without this it would hold a concurrency slot for `request_ttl`).
"""

from __future__ import annotations

import math
import re
import threading
from collections import deque
from typing import Any

from tokenmill.server.limits import LimitStoreUnavailable, Refusal, Usage, check
from tokenmill.server.tenants import Tenant

# Time is the caller's `now` (the replica's clock), not Redis's TIME: quota periods are
# already cut on the replica's clock (`tenant.period(now)`), the local store and the tests
# move time the same way, and a bucket's `*_at` only moves forward (a replica whose clock
# lags refills nothing until it catches up), so clock skew between NTP-synced replicas
# shifts a refill by the skew (milliseconds), never refills twice.
_LIB = """
local function num(s) local v = tonumber(s); if v == nil then return -1 end; return v end
local function str(x) return string.format('%.17g', x) end
-- drop the requests past their deadline: their replica died (or never released them)
local function expire(inflight, reserved, now)
  local gone = redis.call('ZRANGEBYSCORE', inflight, '-inf', now)
  for _, id in ipairs(gone) do redis.call('HDEL', reserved, id) end
  if #gone > 0 then redis.call('ZREMRANGEBYSCORE', inflight, '-inf', now) end
end
-- a bucket's level now (it refills `cap` a minute, starts full) and its refill time
local function level(buckets, name, cap, now)
  local v = redis.call('HMGET', buckets, name, name .. '_at')
  local lvl, at = tonumber(v[1]), tonumber(v[2])
  if lvl == nil or at == nil then return cap, now end
  if now > at then lvl, at = lvl + (now - at) * cap / 60, now end
  return math.min(cap, lvl), at
end
local function reserved_total(reserved)
  local total = 0
  for _, t in ipairs(redis.call('HVALS', reserved)) do total = total + tonumber(t) end
  return total
end
"""

# KEYS: buckets, inflight, reserved, usage (this period)
# ARGV: request id, tokens, now, ttl, requests/min, tokens/min, max concurrent, quota (-1: none)
# -> {'ok'} or {'refused', requests, prompt, completion, in flight, reserved, request level, token level}
_ADMIT = _LIB + """
local id, tokens, now, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local rpm, tpm, max_in_flight, quota = num(ARGV[5]), num(ARGV[6]), num(ARGV[7]), num(ARGV[8])
expire(KEYS[2], KEYS[3], now)
if redis.call('ZSCORE', KEYS[2], id) then return {'ok'} end  -- admitted already: a retried call
local u = redis.call('HMGET', KEYS[4], 'requests', 'prompt_tokens', 'completion_tokens')
local used, reserved = (tonumber(u[2]) or 0) + (tonumber(u[3]) or 0), 0
if quota >= 0 then reserved = reserved_total(KEYS[3]) end  -- O(in flight): only when a quota needs it
local in_flight = redis.call('ZCARD', KEYS[2])
local rl, rat, tl, tat = 1, now, tokens, now
if rpm >= 0 then rl, rat = level(KEYS[1], 'requests', rpm, now) end
if tpm >= 0 then tl, tat = level(KEYS[1], 'tokens', tpm, now) end
-- check()'s rules, in its order; the replica words the refusal with check() itself
if (quota >= 0 and used + reserved + tokens > quota) or (max_in_flight >= 0 and in_flight >= max_in_flight)
    or (rpm >= 0 and rl < 1) or (tpm >= 0 and tl < tokens) then
  return {'refused', tonumber(u[1]) or 0, tonumber(u[2]) or 0, tonumber(u[3]) or 0, in_flight, reserved,
          str(rl), str(tl)}
end
if rpm >= 0 then redis.call('HSET', KEYS[1], 'requests', str(rl - 1), 'requests_at', str(rat)) end
if tpm >= 0 then redis.call('HSET', KEYS[1], 'tokens', str(tl - tokens), 'tokens_at', str(tat)) end
redis.call('ZADD', KEYS[2], str(now + ttl), id)
redis.call('HSET', KEYS[3], id, tokens)
return {'ok'}
"""

# KEYS: buckets, inflight, reserved, usage (the period holding `now`)
# ARGV: request id, prompt tokens, completion tokens, now, tokens/min (-1: none), count (0: cancel an
# admission the caller never saw: free it, count no use)
# -> 1 when released, 0 when the id was not in flight (released already, or expired)
_RELEASE = _LIB + """
local id, prompt, completion, now, tpm = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), num(ARGV[5])
expire(KEYS[2], KEYS[3], now)
if redis.call('ZREM', KEYS[2], id) == 0 then return 0 end
local reserved = tonumber(redis.call('HGET', KEYS[3], id)) or 0
redis.call('HDEL', KEYS[3], id)
if tpm >= 0 then  -- what was reserved and not used goes back
  local tl, tat = level(KEYS[1], 'tokens', tpm, now)
  redis.call('HSET', KEYS[1], 'tokens', str(math.min(tpm, tl + reserved - prompt - completion)), 'tokens_at', str(tat))
end
if ARGV[6] == '1' then
  redis.call('HINCRBY', KEYS[4], 'requests', 1)
  redis.call('HINCRBY', KEYS[4], 'prompt_tokens', prompt)
  redis.call('HINCRBY', KEYS[4], 'completion_tokens', completion)
end
return 1
"""

# KEYS: inflight, reserved, usage; ARGV: now -> {requests, prompt, completion, in flight, reserved}
_USAGE = _LIB + """
expire(KEYS[1], KEYS[2], tonumber(ARGV[1]))
local u = redis.call('HMGET', KEYS[3], 'requests', 'prompt_tokens', 'completion_tokens')
return {tonumber(u[1]) or 0, tonumber(u[2]) or 0, tonumber(u[3]) or 0, redis.call('ZCARD', KEYS[1]),
        reserved_total(KEYS[2])}
"""


class RedisLimitStore:
    """Limits, concurrency and quota usage of every tenant in one Redis, shared by every
    replica pointed at it. `request_ttl`: seconds after which a request still in flight is
    dropped (its replica is taken to have died). Redis down: LimitStoreUnavailable, in about
    a second (short timeouts, one retry), so the server answers 503 rather than hanging."""

    blocking = True  # calls go over the network: the server makes them on a thread

    def __init__(self, url: str, key_prefix: str = "tokenmill:limits:", request_ttl: float = 3600.0,
                 timeout: float = 0.5) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise ValueError(f"--limits-store {_redacted(url)}: Redis needs the redis package: "
                             f"pip install 'tokenmill[redis]'") from e
        if not request_ttl > 0:
            raise ValueError(f"request_ttl must be > 0 seconds, got {request_ttl!r}")
        self.url, self.key_prefix, self.request_ttl = _redacted(url), key_prefix, request_ttl
        self._errors = (redis.exceptions.RedisError,)
        try:
            # one retry, at once (redis-py's default, 10 with backoff, would hang a request for
            # seconds): it reconnects a pooled connection that Redis closed (a restart); the
            # scripts are idempotent per request id, so a retry never counts twice
            self._redis = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                               retry=Retry(NoBackoff(), 1), decode_responses=True)
            self._redis.ping()
        except ValueError as e:
            raise ValueError(f"--limits-store {self.url}: not a Redis URL (redis://HOST:PORT): {e}") from e
        except self._errors as e:
            raise ValueError(f"--limits-store {self.url}: cannot reach Redis: {e}") from e
        # release-script calls Redis may not have run, replayed at the next call that reaches it:
        # releases (usage to count) apart from cancelled admissions, so that clients retrying
        # admissions through an outage never push a release out; bounded, past it request_ttl
        # clears what is lost
        self._releases: deque[tuple[list[str], list[Any]]] = deque(maxlen=1_000_000)
        self._cancels: deque[tuple[list[str], list[Any]]] = deque(maxlen=10_000)
        self._replay_lock = threading.Lock()
        self._admit = self._redis.register_script(_ADMIT)
        self._release = self._redis.register_script(_RELEASE)
        self._usage = self._redis.register_script(_USAGE)

    def admit(self, tenant: Tenant, request_id: str, tokens: int, now: float) -> Refusal | None:
        period, _, end = tenant.period(now)
        keys = self._keys(tenant, period)
        limits = [_arg(tenant.requests_per_minute), _arg(tenant.tokens_per_minute),
                  _arg(tenant.max_concurrent_requests), _arg(tenant.token_quota)]
        try:
            reply = self._call(self._admit, keys, [request_id, tokens, repr(now), repr(self.request_ttl), *limits])
        except LimitStoreUnavailable:
            self._cancels.append((keys, [request_id, 0, 0, repr(now), _arg(tenant.tokens_per_minute), 0]))
            raise
        if reply[0] == "ok":
            return None
        requests, prompt, completion, in_flight, reserved = (int(x) for x in reply[1:6])
        usage = Usage(period, end, requests, prompt, completion, in_flight, reserved)
        levels = [float(reply[6]) if tenant.requests_per_minute is not None else math.inf,
                  float(reply[7]) if tenant.tokens_per_minute is not None else math.inf]
        refusal = check(tenant, usage, tokens, in_flight, levels[0], levels[1], now)
        # the script and check() run the same comparisons on the same numbers: they agree
        return refusal or Refusal("rate_limit_exceeded", f"tenant {tenant.name!r} is over a limit", 1.0)

    def release(self, tenant: Tenant, request_id: str, prompt_tokens: int, completion_tokens: int,
                now: float) -> None:
        keys = self._keys(tenant, tenant.period(now)[0])  # a request that ran across a period's end: the new one
        args = [request_id, prompt_tokens, completion_tokens, repr(now), _arg(tenant.tokens_per_minute), 1]
        try:
            self._call(self._release, keys, args)
        except LimitStoreUnavailable:
            self._releases.append((keys, args))
            raise

    def usage(self, tenant: Tenant, now: float) -> Usage:
        period, _, end = tenant.period(now)
        requests, prompt, completion, in_flight, reserved = (
            int(x) for x in self._call(self._usage, self._keys(tenant, period)[1:], [repr(now)]))
        return Usage(period, end, requests, prompt, completion, in_flight, reserved)

    def close(self) -> None:
        self._redis.close()

    def _keys(self, tenant: Tenant, period: str) -> list[str]:
        base = f"{self.key_prefix}{{{tenant.name}}}:"
        return [base + "buckets", base + "inflight", base + "reserved", f"{base}usage:{period}"]

    def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            if self._releases or self._cancels:
                self._replay()
            return script(keys=keys, args=args)
        except self._errors as e:
            # connection refused, timeouts, and a Redis that answers but cannot serve (loading,
            # read-only replica, out of memory): the store is unavailable, the server answers 503
            raise LimitStoreUnavailable(f"the limits store {self.url} is unavailable: "
                                        f"{type(e).__name__}: {e}") from e

    def _replay(self, batch: int = 256) -> None:
        """Sends again up to `batch` releases, then cancellations, that Redis may have missed,
        oldest first (the rest at the next calls)."""
        if not self._replay_lock.acquire(blocking=False):
            return  # another thread replays: this one does not queue behind its timeouts
        try:
            for queue in (self._releases, self._cancels):
                while queue and batch > 0:
                    keys, args = queue[0]
                    self._release(keys=keys, args=args)  # raises, keeping it, while Redis is still away
                    queue.popleft()
                    batch -= 1
        finally:
            self._replay_lock.release()


def _arg(limit: int | None) -> int:
    return -1 if limit is None else limit


def _redacted(url: str) -> str:
    """The URL without its password, for messages."""
    return re.sub(r"(://[^:@/]*:)[^@/]*@", r"\1***@", url)
