"""`tokenmill bench serve --tenants FILE --tenant-mix ...` against the known-timing server
(which counts each request's Authorization header and answers 429 to keys ending in -429),
and the per-tenant arithmetic: the split, the report, Jain's index."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import uuid

import httpx2 as httpx
import pytest

from tests.bench.conftest import run_bench
from tokenmill.bench.client import RequestRecord, run_benchmark
from tokenmill.bench.tenants import (assign_tenants, fairness_index, interleave, jain_index, load_tenant_mix,
                                     tenant_report, with_tenant)
from tokenmill.bench.workloads import BenchRequest
from tokenmill.cli import main
from tokenmill.config import DEFAULT_MODEL_DIR

HASHED = "sha256:" + hashlib.sha256(b"a secret").hexdigest()


def tenants_file(tmp_path, suffix: str = ".json", limited: bool = False) -> tuple[str, dict[str, str]]:
    """A tenants file with keys unique to the test (the known server is shared); the plain key of each tenant."""
    tag = uuid.uuid4().hex[:8]
    keys = {"acme": f"sk-acme-{tag}", "batch-jobs": f"sk-batch-{tag}" + ("-429" if limited else "")}
    data = {"tenants": [
        # a sha256 key first: the benchmark sends the first plain one
        {"name": "acme", "api_keys": [HASHED, keys["acme"], f"sk-acme-2-{tag}"], "weight": 2, "priority": 0},
        {"name": "batch-jobs", "api_keys": [keys["batch-jobs"]]},
        {"name": "hashed", "api_keys": ["sha256:" + hashlib.sha256(tag.encode()).hexdigest()]},
    ]}
    path = tmp_path / f"tenants{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(data))
    else:
        import yaml

        path.write_text(yaml.safe_dump(data))
    return str(path), keys


def auth_counts(url: str, keys: dict[str, str]) -> dict[str, int]:
    counts = httpx.get(f"{url}/auth-counts", timeout=5).json()
    return {name: counts.get(f"Bearer {key}", 0) for name, key in keys.items()}


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_tenant_mix_is_honoured(known_server, tmp_path, suffix):
    path, keys = tenants_file(tmp_path, suffix)
    r = run_bench(tmp_path, "--base-url", known_server, "--model", "known", "--num-prompts", "20", "--warmup", "3",
                  "--input-len", "6", "--output-len", "4:12", "--max-concurrency", "8", "--seed", "3",
                  "--tenants", path, "--tenant-mix", "acme=0.7, batch-jobs=0.3", "--save-detailed")
    # warm-up 3 -> 2 + 1 (largest remainder), measured 20 -> 14 + 6, each in its seeded order
    assert auth_counts(known_server, keys) == {"acme": 16, "batch-jobs": 7}
    assert [x["tenant"] for x in r["requests"]] == assign_tenants(20, {"acme": 0.7, "batch-jobs": 0.3}, seed=3)
    t = r["tenants"]
    assert list(t) == ["acme", "batch-jobs"]  # only the tenants of the mix
    assert (t["acme"]["requests"], t["batch-jobs"]["requests"]) == (14, 6)
    assert (t["acme"]["weight"], t["batch-jobs"]["weight"]) == (2.0, 1.0)
    assert t["acme"]["share"] == pytest.approx(0.7)
    # the parts add up to the whole
    assert r["completed"] == 20 and r["failed"] == 0
    assert sum(x["completed"] for x in t.values()) == r["completed"]
    assert sum(x["input_tokens"] for x in t.values()) == r["total_input_tokens"] == 20 * 6
    assert sum(x["output_tokens"] for x in t.values()) == r["total_output_tokens"]
    assert sum(x["output_throughput"] for x in t.values()) == pytest.approx(r["output_throughput"])
    assert sum(x["service_share"] for x in t.values()) == pytest.approx(1.0)
    for x in t.values():
        assert x["service"] == x["input_tokens"] + x["output_tokens"]
        assert x["weighted_service"] == pytest.approx(x["service"] / x["weight"])
        assert x["rate_limited"] == 0 and x["failed_by_status"] == {}
        assert 45 <= x["median_ttft_ms"] <= x["p99_ttft_ms"] and x["mean_tpot_ms"] == pytest.approx(10, abs=2)
        assert x["mean_e2el_ms"] > x["mean_ttft_ms"]
    expected = jain_index([t["acme"]["service"], t["batch-jobs"]["service"]], [2, 1])
    assert r["jain_fairness_index"] == pytest.approx(expected)
    assert "tenants from" in r["workload"] and "acme 70% (weight 2)" in r["workload"]
    assert "sk-" not in json.dumps(r["config"])  # the keys stay out of the file


def test_rate_limited_tenant(known_server, tmp_path, capsys):
    path, keys = tenants_file(tmp_path, limited=True)
    r = run_bench(tmp_path, "--base-url", known_server, "--model", "known", "--num-prompts", "10",
                  "--input-len", "4", "--output-len", "3", "--tenants", path, "--tenant-mix", "acme=1,batch-jobs=1")
    assert auth_counts(known_server, keys) == {"acme": 5, "batch-jobs": 5}
    acme, batch = r["tenants"]["acme"], r["tenants"]["batch-jobs"]
    assert (acme["completed"], acme["failed"], acme["rate_limited"]) == (5, 0, 0)
    assert (batch["completed"], batch["failed"], batch["rate_limited"]) == (0, 5, 5)
    assert batch["failed_by_status"] == {"429": 5} and batch["service"] == 0 and batch["output_tokens"] == 0
    assert r["failed"] == 5 and r["completed"] == 5
    assert r["jain_fairness_index"] == pytest.approx(0.5)  # one of two tenants got everything
    out = capsys.readouterr().out
    assert "per tenant" in out and "429: 5" in out and "rate limited on purpose" in out


def test_default_mix_is_every_tenant(tmp_path, known_server):
    path, keys = tenants_file(tmp_path)
    with pytest.raises(ValueError, match="--tenants: tenant 'hashed' has only sha256: keys"):
        load_tenant_mix(path)  # every tenant, hashed included
    tmp_path.joinpath("two.json").write_text(json.dumps(
        {"tenants": [{"name": "a", "api_keys": [f"{keys['acme']}-x"]}, {"name": "b", "api_keys": ["k-b"]}]}))
    mix = load_tenant_mix(tmp_path / "two.json")
    assert mix.shares == {"a": 0.5, "b": 0.5} and mix.weights == {"a": 1.0, "b": 1.0}
    assert mix.keys == {"a": f"{keys['acme']}-x", "b": "k-b"}


def test_two_arrival_processes(known_server, tmp_path):
    """The function-level API a script uses: one schedule per tenant, merged."""
    path, keys = tenants_file(tmp_path)
    mix = load_tenant_mix(path, "acme=1,batch-jobs=1")
    a = with_tenant([BenchRequest("a b c", 3, 3)] * 4, "acme")
    b = with_tenant([BenchRequest("d e", 2, 2)] * 2, "batch-jobs")
    requests, offsets = interleave([(a, [0.0, 0.04, 0.08, 0.12]), (b, [0.02, 0.02])])
    assert [r.tenant for r in requests] == ["acme", "batch-jobs", "batch-jobs", "acme", "acme", "acme"]
    assert offsets == [0.0, 0.02, 0.02, 0.04, 0.08, 0.12]
    records, duration = asyncio.run(run_benchmark(known_server, "known", requests, offsets=offsets,
                                                  tenant_keys=mix.keys))
    assert auth_counts(known_server, keys) == {"acme": 4, "batch-jobs": 2}
    report = tenant_report(records, duration, mix.weights)
    assert report["acme"]["service"] == 4 * (3 + 3) and report["batch-jobs"]["service"] == 2 * (2 + 2)
    assert fairness_index(report) == pytest.approx(jain_index([24, 8], [2, 1]))
    assert min(r.start - r.scheduled for r in records) > -0.001  # sent on schedule, never early
    with pytest.raises(ValueError, match="no API key for tenant 'acme'"):
        asyncio.run(run_benchmark(known_server, "known", requests, tenant_keys={"batch-jobs": "k"}))


def test_jain_index():
    assert jain_index([5, 5, 5]) == pytest.approx(1.0)  # equal service
    assert jain_index([1, 0]) == pytest.approx(0.5)  # one of n takes everything: 1/n
    assert jain_index([7, 0, 0, 0]) == pytest.approx(0.25)
    assert jain_index([1, 1, 0]) == pytest.approx(2 / 3)  # k of n share equally: k/n
    assert jain_index([2, 1], weights=[2, 1]) == pytest.approx(1.0)  # service in proportion to weight is fair
    assert jain_index([1, 1], weights=[2, 1]) == pytest.approx(0.9)  # x = (0.5, 1): 1.5^2 / (2 x 1.25)
    assert jain_index([3, 1]) == pytest.approx(16 / 20)
    assert math.isnan(jain_index([0, 0]))  # nobody served: undefined
    with pytest.raises(ValueError):
        jain_index([1, 2], weights=[1])


def test_assign_tenants():
    shares = {"acme": 0.7, "batch-jobs": 0.3}
    for seed in range(5):
        names = assign_tenants(20, shares, seed)
        assert names.count("acme") == 14 and names.count("batch-jobs") == 6
        assert names == assign_tenants(20, shares, seed)  # deterministic
    assert assign_tenants(20, shares, 0) != assign_tenants(20, shares, 1)  # the order follows the seed
    thirds = assign_tenants(10, {"a": 1, "b": 1, "c": 1})  # 3.33 each: the one left over goes to the first
    assert [thirds.count(x) for x in "abc"] == [4, 3, 3]
    assert assign_tenants(0, shares) == []


def test_tenant_report_by_hand():
    def rec(tenant, status, prompt=None, output=None, error=None, chunks=()):
        return RequestRecord(start=0.0, end=0.5, chunk_times=list(chunks), prompt_tokens=prompt,
                             output_tokens=output, error=error, status=status, tenant=tenant)

    records = [rec("a", 200, 10, 3, chunks=(0.1, 0.2, 0.3)), rec("a", 429, error="HTTP 429"),
               rec("b", 200, 4, 2, chunks=(0.2, 0.4)), rec("b", 500, error="HTTP 500"),
               rec("b", None, error="ClientConnectorError"), rec("b", 200, error="stream error")]
    report = tenant_report(records, 2.0, {"a": 2.0, "b": 1.0, "c": 1.0})
    a, b, c = report["a"], report["b"], report["c"]
    assert (a["completed"], a["failed"], a["rate_limited"], a["failed_by_status"]) == (1, 1, 1, {"429": 1})
    assert (b["completed"], b["failed"], b["rate_limited"]) == (1, 3, 0)
    assert b["failed_by_status"] == {"500": 1, "connection": 1, "stream": 1}
    assert (a["service"], a["weighted_service"], b["service"]) == (13, 6.5, 6)
    assert a["output_throughput"] == 1.5 and b["output_throughput"] == 1.0  # over the run's 2 s
    assert a["mean_ttft_ms"] == pytest.approx(100) and b["mean_tpot_ms"] == pytest.approx(300)
    assert c["requests"] == 0 and c["service"] == 0 and c["mean_ttft_ms"] == 0.0
    assert a["service_share"] == pytest.approx(13 / 19)
    assert fairness_index(report) == pytest.approx(jain_index([6.5, 6, 0]))
    with pytest.raises(ValueError, match="'x'"):
        tenant_report([rec("x", 200, 1, 1)], 1.0, {"a": 1.0})


@pytest.mark.parametrize("args, message", [
    (["--tenant-mix", "nobody=1"], "--tenant-mix: 'nobody' is not a tenant of --tenants"),
    (["--tenant-mix", "acme=0"], "--tenant-mix: the share of 'acme' must be > 0"),
    (["--tenant-mix", "acme=0.5,batch-jobs=-1"], "--tenant-mix: the share of 'batch-jobs' must be > 0"),
    (["--tenant-mix", "acme"], "--tenant-mix: expected NAME=SHARE"),
    (["--tenant-mix", "acme=1,"], "--tenant-mix: expected NAME=SHARE"),
    (["--tenant-mix", "acme=lots"], "--tenant-mix: the share of 'acme' must be a number"),
    (["--tenant-mix", "acme=1,acme=2"], "--tenant-mix: tenant 'acme' is given twice"),
    (["--tenant-mix", "acme=1,hashed=1"], "--tenants: tenant 'hashed' has only sha256: keys"),
    ([], "--tenants: tenant 'hashed' has only sha256: keys"),  # the default mix is every tenant
])
def test_bad_tenant_arguments(tmp_path, capsys, args, message):
    path, _ = tenants_file(tmp_path)
    base = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer",
            str(DEFAULT_MODEL_DIR), "--no-progress", "--tenants", path]
    assert main(base + args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--tenant-mix", "acme=1"], "--tenant-mix needs --tenants"),
    (["--tenants", "/does/not/exist.json"], "--tenants: /does/not/exist.json: cannot be read"),
    (["--tenants", "BAD"], "--tenants: "),
])
def test_bad_tenants_file(tmp_path, capsys, args, message):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tenants": [{"name": "acme", "api_keys": ["k"], "weight": 0}]}))
    args = [str(bad) if a == "BAD" else a for a in args]
    base = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", "none",
            "--no-progress"]
    assert main(base + args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    if args[-1] == str(bad):
        assert "tenant 'acme': weight" in err


def test_help_names_the_flags(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--help"])
    out = capsys.readouterr().out
    assert "--tenants FILE" in out and "--tenant-mix NAME=SHARE" in out
