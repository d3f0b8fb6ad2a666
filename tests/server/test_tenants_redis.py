"""Two tokenmill replicas share one tenant's limits and quota through a real redis-server;
Redis lost while serving: 503 (fail closed) or admitted uncounted (--limits-fail-open)."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest

from tests.server.conftest import MODEL_NAME, start_server
from tests.server.test_limits_store import _redis_server

TENANTS = {"tenants": [{"name": "acme", "api_keys": ["sk-acme"], "requests_per_minute": 2,
                        "token_quota": 100000, "quota_period": "day"}]}


@pytest.fixture
def redis_url(tmp_path):
    yield from _redis_server(tmp_path)


def post(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer sk-acme"}, timeout=60,
                      json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 3, "ignore_eos": True})


def test_replicas_share_limits_and_fail_closed_or_open_when_redis_is_lost(tmp_path, redis_url):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    shared = {"tenants_file": str(path), "limits_store": redis_url.url}
    a = start_server(tenancy=shared)
    b = start_server(tenancy=shared)
    open_ = start_server(tenancy={**shared, "fail_open": True})
    try:
        first, second = post(a.url), post(b.url)
        assert (first.status_code, second.status_code) == (200, 200)
        third = post(a.url)  # the bucket of 2 a minute is shared: a has sent only one
        assert third.status_code == 429 and third.json()["error"]["code"] == "rate_limit_exceeded"
        usage = httpx.get(f"{b.url}/v1/usage", headers={"Authorization": "Bearer sk-acme"}).json()
        used = first.json()["usage"]["total_tokens"] + second.json()["usage"]["total_tokens"]
        assert (usage["requests"], usage["total_tokens"]) == (2, used)

        redis_url.kill()
        lost = post(a.url)
        assert lost.status_code == 503 and lost.json()["error"]["code"] == "limits_unavailable"
        assert lost.headers["Retry-After"] == "1"
        assert post(open_.url).status_code == 200  # admitted, uncounted
        usage = httpx.get(f"{a.url}/v1/usage", headers={"Authorization": "Bearer sk-acme"})
        assert usage.status_code == 503 and usage.json()["error"]["code"] == "limits_unavailable"
        assert httpx.get(f"{a.url}/health").status_code == 200  # the engine is fine

        redis_url.start()  # back, empty (no persistence in this test): counting starts again
        assert post(b.url).status_code == 200
    finally:
        for server in (a, b, open_):
            server.stop()
