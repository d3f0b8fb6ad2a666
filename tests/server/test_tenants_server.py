"""Tenants on a real server: keys, 429s with Retry-After, quotas, /v1/usage, priority lanes,
per-tenant metrics and an access log that names the tenant and never the key."""

from __future__ import annotations

import json
import logging
import threading

import httpx2 as httpx
import pytest

from tests.server.conftest import MODEL_NAME, start_server

TENANTS = {"tenants": [
    {"name": "acme", "api_keys": ["sk-acme"], "priority": 0, "weight": 2, "requests_per_minute": 3},
    {"name": "metered", "api_keys": ["sk-metered"], "token_quota": 60, "quota_period": "day", "priority": 5},
    {"name": "narrow", "api_keys": ["sk-narrow"], "tokens_per_minute": 40},
    {"name": "single", "api_keys": ["sk-single"], "max_concurrent_requests": 1},
    {"name": "free", "api_keys": ["sk-free"]},
]}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    server = start_server(tenancy={"tenants_file": str(path), "admin_key": "sk-admin",
                                   "limits_db": str(path.parent / "limits.db")},
                          access_log=True, scheduling_policy="fair")
    yield server
    server.stop()


def post(srv, key: str | None, max_tokens: int = 4, path: str = "completions", **extra) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    if path == "completions":
        body.setdefault("prompt", "def f(x):")
    else:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return httpx.post(f"{srv.url}/v1/{path}", json=body, headers=headers, timeout=60)


def usage(srv, key: str) -> dict:
    r = httpx.get(f"{srv.url}/v1/usage", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("key", [None, "sk-nobody", "sk-admin"])
def test_no_key_or_an_unknown_one_is_a_401(srv, key):
    for path in ("completions", "chat/completions"):
        r = post(srv, key, path=path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{srv.url}/v1/models").status_code == 401
    assert httpx.get(f"{srv.url}/health").status_code == 200  # stays open


def test_requests_per_minute_answers_429_with_retry_after_and_spares_other_tenants(srv):
    codes = [post(srv, "sk-acme").status_code for _ in range(3)]
    assert codes == [200, 200, 200]
    r = post(srv, "sk-acme", path="chat/completions")
    assert r.status_code == 429
    error = r.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "requests_per_minute" in error["message"]
    assert 1 <= int(r.headers["Retry-After"]) <= 20  # a request's worth of a 3/minute bucket
    assert post(srv, "sk-free").status_code == 200  # another tenant is not slowed
    samples = srv.metrics()
    assert samples["tokenmill:tenant_requests_total{outcome=rate_limited,tenant=acme}"] == 1
    assert samples["tokenmill:tenant_requests_total{outcome=length,tenant=acme}"] >= 3


def test_quota_is_charged_what_was_used_and_refuses_what_would_overrun_it(srv):
    before = usage(srv, "sk-metered")
    assert (before["token_quota"], before["quota_period"], before["total_tokens"]) == (60, "day", 0)
    r = post(srv, "sk-metered", max_tokens=5)
    assert r.status_code == 200
    used = r.json()["usage"]["total_tokens"]
    after = usage(srv, "sk-metered")
    assert after["total_tokens"] == used and after["requests"] == 1
    assert after["quota_remaining"] == 60 - used and after["in_flight"] == 0 and after["reserved_tokens"] == 0
    # more than the whole quota: it can never run (a 400, not a 429 to retry at the period's end)
    r = post(srv, "sk-metered", max_tokens=61)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # prompt + max_tokens would pass what is left: refused before anything runs
    r = post(srv, "sk-metered", max_tokens=60 - used)
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "insufficient_quota" == r.json()["error"]["type"]
    assert int(r.headers["Retry-After"]) >= 1
    assert usage(srv, "sk-metered")["total_tokens"] == used
    assert srv.metrics()["tokenmill:tenant_requests_total{outcome=quota_exceeded,tenant=metered}"] == 1


def test_tokens_per_minute_reserves_max_tokens_and_gives_back_the_rest(srv):
    r = post(srv, "sk-narrow", max_tokens=100)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # can never fit 40/minute
    prompt_tokens = post(srv, "sk-free", max_tokens=1).json()["usage"]["prompt_tokens"]
    # each reserves 26 of the bucket's 40, so the second fits only if the first gave back what it did
    # not use: a one-word choice ends after a token or two
    for _ in range(2):
        r = post(srv, "sk-narrow", max_tokens=26 - prompt_tokens, ignore_eos=False, guided_choice=["yes"])
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["total_tokens"] <= 14
    # what the two used is gone from the bucket (less a few seconds of refill): 34 do not fit
    r = post(srv, "sk-narrow", max_tokens=34 - prompt_tokens)
    assert r.status_code == 429 and "tokens_per_minute" in r.json()["error"]["message"]
    assert int(r.headers["Retry-After"]) >= 1


def test_concurrency_limit_refuses_the_second_request_in_flight(srv):
    started = threading.Event()
    result: dict[str, int] = {}

    def long_stream() -> None:
        # (200 tokens: 30 had all come, at a millisecond a token or less, before the second request)
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer sk-single"}) as r:
            result["status"] = r.status_code
            for _ in r.iter_lines():
                started.set()

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(30)
    r = post(srv, "sk-single", max_tokens=2)
    t.join(60)
    assert result["status"] == 200
    assert r.status_code == 429 and "max_concurrent_requests" in r.json()["error"]["message"]
    assert post(srv, "sk-single", max_tokens=2).status_code == 200  # the stream released its slot as it ended
    assert usage(srv, "sk-single")["in_flight"] == 0


def test_a_request_may_not_ask_for_a_better_lane_than_its_tenant(srv):
    r = post(srv, "sk-metered", priority=1)  # metered's level is 5
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert post(srv, "sk-free", priority=3).status_code == 200  # a lower lane than its own is fine


def test_usage_is_the_callers_own_and_the_admin_key_sees_every_tenant(srv):
    own = usage(srv, "sk-free")
    assert own["tenant"] == "free" and own["object"] == "usage" and own["token_quota"] is None
    everyone = usage(srv, "sk-admin")
    assert [u["tenant"] for u in everyone["data"]] == ["acme", "metered", "narrow", "single", "free"]
    assert httpx.get(f"{srv.url}/v1/usage").status_code == 401


def test_tenant_metrics_and_the_access_log_name_the_tenant_never_the_key(srv, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.access"):
        assert post(srv, "sk-free", max_tokens=3).status_code == 200
        assert post(srv, "sk-nobody").status_code == 401
    lines = [r.getMessage() for r in caplog.records if r.name == "tokenmill.access"]
    assert any("tenant=free" in line and '"POST /v1/completions HTTP/1.1" 200' in line for line in lines), lines
    assert any("tenant=- " in line and " 401 " in line for line in lines), lines
    assert not any("sk-" in r.getMessage() for r in caplog.records)
    samples = srv.wait_idle()
    assert samples["tokenmill:tenant_generation_tokens_total{tenant=free}"] >= 3
    assert samples["tokenmill:tenant_prompt_tokens_total{tenant=free}"] > 0
    assert samples["tokenmill:tenant_time_to_first_token_seconds_count{tenant=free}"] >= 1
    assert samples["tokenmill:tenant_request_queue_time_seconds_count{tenant=free}"] >= 1
