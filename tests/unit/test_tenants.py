"""The tenants file: the documented shape, sha256 keys, YAML, and errors that name the file,
the tenant and the field."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math

import pytest

from tokenmill.server.tenants import Tenants, TenantsFileError, load_tenants

ISSUE_SHAPE = {"tenants": [
    {"name": "acme", "api_keys": ["sk-acme-1"], "priority": 0, "weight": 2,
     "requests_per_minute": 600, "tokens_per_minute": 200000, "max_concurrent_requests": 64,
     "token_quota": 5000000, "quota_period": "month", "models": ["*"]},
    {"name": "batch-jobs", "api_keys": ["sk-batch"], "priority": 10, "weight": 1},
]}


def write(tmp_path, data, name="tenants.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_the_documented_shape_loads(tmp_path):
    tenants = load_tenants(write(tmp_path, ISSUE_SHAPE))
    acme, batch = tenants.tenants
    assert (acme.name, acme.weight, acme.priority, acme.requests_per_minute, acme.tokens_per_minute,
            acme.max_concurrent_requests, acme.token_quota, acme.quota_period) == \
        ("acme", 2.0, 0, 600, 200000, 64, 5000000, "month")
    # every field but name and api_keys is optional: a missing limit is no limit
    assert (batch.priority, batch.weight, batch.requests_per_minute, batch.token_quota) == (10, 1.0, None, None)
    assert tenants.authenticate("sk-acme-1") is acme
    assert tenants.authenticate("sk-batch") is batch
    assert tenants.authenticate("sk-acme-2") is None and tenants.authenticate("") is None
    assert acme.may_use("anything") and batch.may_use("m")


def test_keys_may_be_given_as_sha256_digests_and_are_kept_only_as_digests(tmp_path):
    digest = hashlib.sha256(b"secret-key").hexdigest()
    path = write(tmp_path, {"tenants": [{"name": "a", "api_keys": [f"sha256:{digest.upper()}"], "models": ["m*"]}]})
    tenants = load_tenants(path)
    assert tenants.authenticate("secret-key").name == "a"
    assert tenants.authenticate(f"sha256:{digest}") is None  # the digest itself is not a key
    assert "secret-key" not in repr(tenants.tenants)
    assert tenants.tenants[0].may_use("m-1") and not tenants.tenants[0].may_use("other")


def test_yaml_files_load_the_same(tmp_path):
    path = write(tmp_path, "tenants:\n  - name: acme\n    api_keys: [sk-acme-1]\n    weight: 2\n"
                           "    token_quota: 1000\n    quota_period: day\n", "tenants.yaml")
    (acme,) = load_tenants(path).tenants
    assert (acme.weight, acme.token_quota, acme.quota_period) == (2.0, 1000, "day")


@pytest.mark.parametrize("data, tenant, field", [
    ({"tenants": [{"name": "a", "api_keys": ["k"], "requests_per_minute": -1}]}, "a", "requests_per_minute"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "token_quota": 1.5}]}, "a", "token_quota"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "rate": 5}]}, "a", "rate"),
    ({"tenants": [{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}]}, "b", "api_keys"),
    ({"tenants": [{"name": "a", "api_keys": ["k", "k"]}]}, "a", "api_keys"),
    ({"tenants": [{"name": "a", "api_keys": ["k"]}, {"name": "a", "api_keys": ["j"]}]}, "a", "name"),
    ({"tenants": [{"name": "a", "api_keys": []}]}, "a", "api_keys"),
    ({"tenants": [{"name": "a", "api_keys": ["sha256:abc"]}]}, "a", "api_keys"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "weight": 0}]}, "a", "weight"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "priority": "high"}]}, "a", "priority"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "quota_period": "year"}]}, "a", "quota_period"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "models": []}]}, "a", "models"),
    ({"tenants": [{"api_keys": ["k"]}]}, None, "name"),
    ({"tenants": []}, None, "tenants"),
])
def test_a_bad_file_names_the_file_the_tenant_and_the_field(tmp_path, data, tenant, field):
    path = write(tmp_path, data)
    with pytest.raises(TenantsFileError) as e:
        load_tenants(path)
    assert (e.value.tenant, e.value.field) == (tenant, field)
    message = str(e.value)
    assert message.startswith(path) and field in message
    if tenant is not None:
        assert repr(tenant) in message


@pytest.mark.parametrize("text, name", [("{not json", "t.json"), ("tenants: [a: b: c", "t.yaml"),
                                        ('{"users": []}', "t.json")])
def test_a_malformed_file_is_refused(tmp_path, text, name):
    path = write(tmp_path, text, name)
    with pytest.raises(TenantsFileError, match=path):
        load_tenants(path)
    with pytest.raises(TenantsFileError, match="cannot be read"):
        load_tenants(tmp_path / "missing.json")


def test_quota_periods_are_utc_calendar_periods(tmp_path):
    now = dt.datetime(2026, 11, 24, 18, 30, tzinfo=dt.timezone.utc).timestamp()  # a Tuesday

    def period(p: str):
        t = load_tenants(write(tmp_path, {"tenants": [{"name": "a", "api_keys": ["k"], "quota_period": p}]}))
        key, start, end = t.tenants[0].period(now)
        return key, dt.datetime.fromtimestamp(start, dt.timezone.utc), end

    assert period("day")[0] == "2026-11-24"
    assert period("week")[0] == "2026-11-23"  # from Monday
    key, start, end = period("month")
    assert key == "2026-11-01" and end == dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc).timestamp()
    assert period("total")[0] == "total" and math.isinf(period("total")[2])


def test_api_key_alone_is_one_tenant_without_limits():
    tenants = Tenants.single_key("sk-1")
    (t,) = tenants.tenants
    assert tenants.authenticate("sk-1") is t and t.name == "default"
    assert (t.requests_per_minute, t.tokens_per_minute, t.max_concurrent_requests, t.token_quota) == (None,) * 4


def test_a_malformed_yaml_file_does_not_echo_its_keys(tmp_path):
    path = write(tmp_path, "tenants:\n  - name: a\n    api_keys: [sk-live-SECRET, \n", "t.yaml")
    with pytest.raises(TenantsFileError) as e:
        load_tenants(path)
    assert "SECRET" not in str(e.value) and "line" in str(e.value)
