"""The server's side of tenants: who sent a request, may it run now, what did it cost.

    Authorization: Bearer KEY -> authenticate() -> Tenant (401 if unknown)
    body.priority, model      -> origin()       -> Origin: tenant, weight, lane for the engine
    prompts x max_tokens      -> admit()        -> Grant (429 over a limit, 503 store down)
    the answer's last token   -> release()      -> the reservation corrected to the tokens used

Limits and quotas live here; fairness between tenants lives in the engine's queue
policy (scheduling_policy="fair"), which only sees each request's tenant name and
weight (DESIGN.md, Boundaries).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenmill.server.limits import Grant, LimitExceeded, Limits, LimitStoreUnavailable, LocalLimitStore, Usage
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import APIError
from tokenmill.server.serving import Choice, Origin
from tokenmill.server.tenants import Tenant, Tenants, load_tenants

logger = logging.getLogger("tokenmill.server")


class Tenancy:
    """`limits` None: no keys at all, every request is anonymous and unlimited."""

    def __init__(self, limits: Limits | None, metrics: ServerMetrics | None = None,
                 admin_key: str | None = None) -> None:
        self.limits = limits
        self.metrics = metrics
        self.admin_key = admin_key

    @property
    def blocking(self) -> bool:
        """Its store's calls go over the network (Redis): the server makes them off the event loop."""
        return self.limits is not None and getattr(self.limits.store, "blocking", False)

    def authenticate(self, authorization: str) -> Tenant | None:
        """The tenant of an `Authorization: Bearer KEY` header; raises 401 when tenants are
        configured and the key is missing or unknown."""
        if self.limits is None:
            return None
        key = _bearer_key(authorization)
        tenant = self.limits.tenants.authenticate(key) if key else None
        if tenant is None:
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        return tenant

    def is_admin(self, authorization: str) -> bool:
        key = _bearer_key(authorization)
        return bool(self.admin_key) and key is not None and secrets.compare_digest(key.encode(),
                                                                                  self.admin_key.encode())

    def origin(self, tenant: Tenant | None, priority: int | None, model: str) -> Origin:
        """The engine's view of the request: its tenant, weight and priority lane. A request may
        ask for its tenant's lane or a lower one (a larger value), never a better one."""
        if tenant is None:
            return Origin(priority=priority or 0)
        if not tenant.may_use(model):
            raise APIError(404, f"The model `{model}` does not exist or tenant {tenant.name!r} may not use it",
                           param="model", code="model_not_found")
        if priority is not None and priority < tenant.priority:
            raise APIError(400, f"priority: {priority} is above this key's level; its requests may ask for "
                           f"priority >= {tenant.priority} (lower values run first)", param="priority")
        return Origin(tenant.name, tenant.weight, tenant.priority if priority is None else priority)

    def admit(self, tenant: Tenant | None, request_id: str, choices: Sequence[Choice], n: int) -> Grant | None:
        """Reserves prompt + max_tokens (for every sequence) of each prompt; raises 400 when the
        request can never fit the tenant's tokens per minute, 429 over a limit, 503 when the
        shared store is unreachable (unless failing open)."""
        if tenant is None or self.limits is None:
            return None
        tokens = reserved_tokens(choices, n)
        # a reservation that can never fit is bad input, not a limit to wait for
        for name, limit in (("whole token_quota", tenant.token_quota), ("tokens_per_minute", tenant.tokens_per_minute)):
            if limit is not None and tokens > limit:
                raise APIError(400, f"max_tokens: the prompt and max_tokens reserve {tokens} tokens, more than "
                               f"tenant {tenant.name!r}'s {name} ({limit}); lower max_tokens", param="max_tokens")
        try:
            return self.limits.admit(tenant, request_id, tokens)
        except LimitExceeded as e:
            refusal = e.refusal
            if self.metrics is not None:
                self.metrics.tenant_refused(tenant.name, "quota_exceeded" if refusal.code == "insufficient_quota"
                                            else "rate_limited")
            raise APIError(429, refusal.message, type=refusal.code, code=refusal.code,
                           headers={"Retry-After": str(max(1, math.ceil(refusal.retry_after)))}) from e
        except LimitStoreUnavailable as e:
            logger.warning("limits store unavailable, refusing a request of tenant %s: %s", tenant.name, e)
            raise _store_unavailable() from e

    def release(self, grant: Grant | None, choices: Sequence[Choice], n: int) -> None:
        """Charges what the answer used: every prompt (submitted prompts are charged, finished
        or not, as OpenAI charges them), and the tokens generated. A best_of answer returns only
        the n best of its sequences, so it is charged what it reserved for all of them."""
        if grant is None or self.limits is None or not choices:
            return
        requests = [c.request for c in choices[::n]]
        prompt = sum(r.num_prompt_tokens for r in requests)
        completion = choices[0].meter.completion_tokens
        if any(r.ranked_by_logprob for r in requests):  # the reservation's completion part
            completion = max(completion, grant.reserved_tokens - prompt)
        self.limits.release(grant, prompt, completion)

    def usage(self, authorization: str) -> dict[str, Any]:
        """GET /v1/usage: the caller's own usage and what is left, or every tenant's for the admin key."""
        if self.limits is None:
            raise APIError(404, "no tenants are configured (--tenants or --api-key)", code="not_found")
        try:
            if self.is_admin(authorization):
                return {"object": "list", "data": [self._usage(t) for t in self.limits.tenants.tenants]}
            return self._usage(self.authenticate(authorization))
        except LimitStoreUnavailable as e:
            raise _store_unavailable() from e

    def _usage(self, tenant: Tenant) -> dict[str, Any]:
        assert self.limits is not None
        u: Usage = self.limits.usage(tenant)
        quota = tenant.token_quota
        return {"object": "usage", "tenant": tenant.name, "quota_period": tenant.quota_period, "period": u.period,
                "period_end": None if math.isinf(u.period_end) else int(u.period_end),
                "requests": u.requests, "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "total_tokens": u.total_tokens, "token_quota": quota,
                "quota_remaining": None if quota is None else max(0, quota - u.total_tokens),
                "in_flight": u.in_flight, "reserved_tokens": u.reserved_tokens,
                "limits": {"requests_per_minute": tenant.requests_per_minute,
                           "tokens_per_minute": tenant.tokens_per_minute,
                           "max_concurrent_requests": tenant.max_concurrent_requests},
                "priority": tenant.priority, "weight": tenant.weight}


def _bearer_key(authorization: str) -> str | None:
    """The KEY of an `Authorization: Bearer KEY` header, or None."""
    scheme, _, key = authorization.partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None


def _store_unavailable() -> APIError:
    return APIError(503, "the limits store is unavailable; retry later", type="server_error",
                    code="limits_unavailable", headers={"Retry-After": "1"})


def reserved_tokens(choices: Sequence[Choice], n: int) -> int:
    """Prompt plus max_tokens for each sequence, over the request's prompts (one engine request
    per prompt; its n or best_of sequences share the prompt)."""
    total = 0
    for c in choices[::n]:
        r = c.request
        total += r.num_prompt_tokens + r.sampling_params.num_sequences * r.max_tokens
    return total


def make_tenancy(metrics: ServerMetrics, tenants_file: str | None = None, api_key: str | None = None,
                 admin_key: str | None = None, limits_db: str | None = None, limits_store: str | None = None,
                 fail_open: bool = False) -> Tenancy:
    """`tokenmill serve`'s flags as a Tenancy; raises ValueError naming the flag."""
    if tenants_file is not None and api_key is not None:
        raise ValueError("--api-key and --tenants: give one (--api-key KEY is one tenant with no limits; put the "
                         "key in the tenants file instead)")
    if admin_key is not None and not admin_key.strip():
        raise ValueError("--admin-key: must not be empty (an empty key would make every caller an admin)")
    if tenants_file is None and api_key is None:
        if limits_store is not None or limits_db is not None or admin_key is not None:
            raise ValueError("--limits-store, --limits-db and --admin-key need --tenants FILE (or --api-key)")
        return Tenancy(None, metrics)
    tenants = load_tenants(tenants_file) if tenants_file is not None else Tenants.single_key(api_key or "")
    if admin_key is not None and tenants.authenticate(admin_key) is not None:
        raise ValueError("--admin-key: is also a tenant's API key; give the admin its own key")
    if limits_store is not None:
        if not limits_store.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--limits-store: expected redis://HOST:PORT, got {limits_store!r}")
        from tokenmill.server.limits_redis import RedisLimitStore

        store: Any = RedisLimitStore(limits_store)
    elif tenants_file is None:
        store = LocalLimitStore()  # --api-key alone: no limits, nothing to keep
    else:
        store = LocalLimitStore(limits_db or default_limits_db())
    return Tenancy(Limits(tenants, store, fail_open=fail_open), metrics, admin_key)


def default_limits_db() -> str:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(state) / "tokenmill" / "limits.db")
