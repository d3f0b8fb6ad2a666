"""`tokenmill router` in front of two real `tokenmill serve` processes (one with its engine
core in a process of its own, one with it on a thread): answers equal the servers' own,
requests sharing a prefix stick to one server, the servers' prefix-cache summaries hold what
they served, and a server killed mid-stream is routed around, retried past and recovered."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import pytest
import uvicorn

from tests.server.conftest import MODEL_NAME, free_port, launch_serve, start_server
from tokenmill.cli import main
from tokenmill.config import DEFAULT_MODEL_DIR
from tokenmill.engine.detokenizer import load_tokenizer
from tokenmill.router.backends import Backends
from tokenmill.router.prefix import prompt_block_hashes
from tokenmill.router.server import Proxy, build_router_app
from tokenmill.router.summary import Summary

KEY = "router-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SERVE = ("--max-model-len", "256", "--kv-cache-memory", "16MiB", "--dtype", "float32", "--num-threads", "1",
         "--served-model-name", MODEL_NAME, "--api-key", KEY, "--disable-access-log")


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    flags: tuple[str, ...]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@dataclass
class Cluster:
    servers: list[Server]
    router: subprocess.Popen
    url: str
    logs: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("router")
    flags = [SERVE, (*SERVE, "--engine-in-thread")]
    port, ports = free_port(), [free_port(), free_port()]
    # the router first: it finds its backends down, and takes them up as they start
    with open(logs / "router.log", "w") as log:
        router = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "router", "--port", str(port),
                                   "--backend", f"http://127.0.0.1:{ports[0]}",
                                   "--backend", f"http://127.0.0.1:{ports[1]}/",
                                   "--poll-interval", "0.3", "--api-key", KEY], stdout=log, stderr=subprocess.STDOUT)
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda i: launch_serve(logs / f"server{i}.log", *flags[i], port=ports[i]), range(2)))
    servers = [Server(proc, url, f) for (proc, url), f in zip(started, flags)]
    url = f"http://127.0.0.1:{port}"
    _wait(lambda: _healthy(url) == [True, True], 60, lambda: (logs / "router.log").read_text())
    yield Cluster(servers, router, url, logs)
    for proc in [router, *(s.proc for s in servers)]:
        proc.terminate()
    for proc in [router, *(s.proc for s in servers)]:
        proc.wait(30)


def _prefix(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 8000) for _ in range(96)]


def _wait(ready, timeout: float, why=lambda: "") -> None:
    deadline = time.time() + timeout
    while not ready():
        assert time.time() < deadline, why()
        time.sleep(0.1)


def _healthy(url: str) -> list[bool] | None:
    """The router's view of its backends, or None while it does not answer."""
    try:
        return [b["healthy"] for b in httpx.get(f"{url}/health", timeout=2).json()["backends"]]
    except (httpx.TransportError, KeyError, ValueError):
        return None


def _samples(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _routed(router_url: str, servers: list[Server]) -> list[float]:
    m = _samples(router_url)
    return [m[f"tokenmill:router_requests_routed_total{{{s.url}}}"] for s in servers]


def _complete(url: str, prompt, max_tokens: int = 4) -> dict:
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, body: dict) -> list:
    """The events of a streamed answer, parsed ("[DONE]" as is)."""
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [e if e == "[DONE]" else json.loads(e) for line in r.iter_lines() if line
                for e in [line.removeprefix("data: ")]]


def _text(events: list) -> str:
    out = ""
    for e in events[:-1]:
        for c in e["choices"]:
            out += c.get("text") or c.get("delta", {}).get("content") or ""
    return out


@pytest.mark.parametrize("path, body, answer", [
    ("/v1/completions", {"prompt": "def fibonacci(n):", "return_token_ids": True}, lambda c: c["text"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "write a loop"}]},
     lambda c: c["message"]["content"]),
])
def test_answers_equal_the_servers_own(cluster, path, body, answer):
    body = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 12, **body}
    direct = httpx.post(cluster.servers[0].url + path, json=body, headers=AUTH, timeout=60).json()
    routed = httpx.post(cluster.url + path, json=body, headers=AUTH, timeout=60).json()
    assert routed["choices"] == direct["choices"] and routed["usage"] == direct["usage"]
    streamed, streamed_direct = _stream(cluster.url + path, body), _stream(cluster.servers[1].url + path, body)
    assert streamed[-1] == streamed_direct[-1] == "[DONE]"
    assert _text(streamed) == _text(streamed_direct) == answer(direct["choices"][0])


def test_errors_keys_and_models_pass_through(cluster):
    server = cluster.servers[0].url
    for body, headers, status in (({"model": MODEL_NAME, "prompt": "x", "max_tokens": -1}, AUTH, 400),
                                  ({"model": MODEL_NAME, "prompt": "x"}, {}, 401),
                                  ({"model": MODEL_NAME, "prompt": "x"}, {"Authorization": "Bearer nope"}, 401),
                                  ({"model": "other", "prompt": "x"}, AUTH, 404)):
        direct = httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=30)
        routed = httpx.post(f"{cluster.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert routed.status_code == direct.status_code == status
        assert routed.json() == direct.json()
    models = httpx.get(f"{cluster.url}/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert httpx.get(f"{cluster.url}/v1/models").status_code == 401
    assert httpx.get(f"{cluster.url}/nowhere").json()["error"]["message"] == "Not Found"


def test_requests_sharing_a_prefix_stick_to_one_backend(cluster):
    servers = cluster.servers
    before_all = [_samples(s.url) for s in servers]
    matched_before = _samples(cluster.url)["tokenmill:router_matched_blocks_total"]
    homes = []
    for seed in (11, 12):
        before = _routed(cluster.url, servers)
        for i in range(4):
            _complete(cluster.url, _prefix(seed) + [200 + i])
        delta = [a - b for a, b in zip(_routed(cluster.url, servers), before)]
        assert sorted(delta) == [0, 4], delta  # all four on one backend
        homes.append(delta.index(4))
    after_all = [_samples(s.url) for s in servers]
    for home in homes:  # there the 3 requests after the first found the prefix's 96 tokens
        hits = [after["tokenmill:prefix_cache_hits_total"] - before["tokenmill:prefix_cache_hits_total"]
                for before, after in zip(before_all, after_all)]
        assert hits[home] >= 3 * 96 * homes.count(home)
        rate = "tokenmill:prefix_cache_hit_rate"
        assert after_all[home][rate] > before_all[home][rate]
    assert _samples(cluster.url)["tokenmill:router_matched_blocks_total"] - matched_before == 2 * 3 * 6


@pytest.mark.parametrize("which", [0, 1])  # the engine core in a process of its own; on a thread
def test_the_summary_holds_a_served_prompts_hashes(cluster, which):
    url = f"{cluster.servers[which].url}/v1/prefix_cache"
    first = Summary.parse(httpx.get(url, headers=AUTH).json())
    prompt = _prefix(20 + which) + [7]
    _complete(cluster.servers[which].url, prompt)
    hashes = set(prompt_block_hashes(prompt, 16))
    changes = Summary.parse(httpx.get(url, headers=AUTH, params={"since": first.cursor}).json())
    assert not changes.reset and changes.block_size == 16
    assert hashes <= set(changes.stored) and not hashes & set(changes.removed)
    whole = Summary.parse(httpx.get(url, headers=AUTH).json())
    assert whole.reset and hashes <= set(whole.stored)
    assert httpx.get(url).status_code == 401  # it tells what was served: a key, as for /v1/*


def test_the_summary_takes_a_tenants_key_or_the_admin_key():
    server = start_server(tenancy={"api_key": "tenant-key", "admin_key": "admin-key"})
    try:
        url = f"{server.url}/v1/prefix_cache"
        for key, status in (("tenant-key", 200), ("admin-key", 200), ("nope", 401), (None, 401)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            assert httpx.get(url, headers=headers).status_code == status
    finally:
        server.stop()


@contextlib.contextmanager
def _router_in_thread(urls: list[str], poll_interval: float, policy: str = "prefix") -> Iterator[str]:
    """A router in this process (as `tokenmill router` builds it); yields its URL."""
    backends = Backends(urls, policy, poll_interval=poll_interval, api_key=KEY)
    app = build_router_app(backends, Proxy(backends, load_tokenizer(DEFAULT_MODEL_DIR)))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait(lambda: server.started, 30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_killed_backend_is_routed_around_retried_past_and_recovered(cluster):
    servers = cluster.servers
    # a router that polled once only: it still believes in the backend that dies below, so of
    # two requests it sends round robin, the one sent there must find out and go to the other
    with _router_in_thread([s.url for s in servers], poll_interval=3600, policy="round_robin") as blind:
        body = {"model": MODEL_NAME, "prompt": "def fibonacci(n):", "max_tokens": 200, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, headers=AUTH, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            in_flight = _samples(cluster.url)
            [victim] = [s for s in servers if in_flight[f"tokenmill:router_backend_in_flight{{{s.url}}}"] == 1]
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(10)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["code"] == "backend_failed"
        [survivor] = [s for s in servers if s is not victim]
        assert _healthy(cluster.url) == [s is survivor for s in servers]
        before = _routed(cluster.url, servers)
        for seed in range(3):
            _complete(cluster.url, _prefix(40 + seed))
        assert [a - b for a, b in zip(_routed(cluster.url, servers), before)] == [3 * (s is survivor) for s in servers]
        for seed in (50, 51):
            _complete(blind, _prefix(seed))
        m = _samples(blind)
        assert m[f"tokenmill:router_retries_total{{{victim.url}}}"] == 1
        assert m[f"tokenmill:router_backend_healthy{{{victim.url}}}"] == 0
        assert _routed(blind, [survivor]) == [2]
    victim.proc, _ = launch_serve(cluster.logs / "restarted.log", *victim.flags, port=victim.port)
    _wait(lambda: _healthy(cluster.url) == [True, True], 10)
    before = _routed(cluster.url, servers)
    _complete(cluster.url, _prefix(60))  # equal loads, nothing held: to the one holding less
    assert [a - b for a, b in zip(_routed(cluster.url, servers), before)] == [s is victim for s in servers]


def test_no_healthy_backend_is_a_503():
    with _router_in_thread([f"http://127.0.0.1:{free_port()}"], poll_interval=0.2) as router:
        health = httpx.get(f"{router}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "no_backend"
        r = httpx.post(f"{router}/v1/completions", json={"model": MODEL_NAME, "prompt": "x"}, headers=AUTH)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "no_backend"


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: --backend"),
    (["--backend", "localhost:8000"], "--backend: expected a server's base URL"),
    (["--backend", "http://h:1", "--backend", "http://h:1/"], "--backend: a URL is given twice"),
    (["--backend", "http://h:1", "--poll-interval", "0"], "--poll-interval must be > 0"),
    (["--backend", "http://h:1", "--port", "0"], "--port must be in [1, 65535]"),
])
def test_bad_router_flags_exit_2_naming_the_flag(argv, message, capsys):
    try:
        code = main(["router", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2 and message in capsys.readouterr().err
