"""The engine core in a process of its own (as under `tokenmill serve`): the same answers as the
offline engine, aborts and metrics across the boundary, a core that dies answers 503 and fails
its requests instead of hanging them, --restart-engine brings a new one, and a core whose server
is gone exits by itself."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.server.conftest import MODEL_NAME, launch_serve, start_server
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.core_client import EngineCoreClient, EngineCoreError

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, x):", "for i in range("]


@pytest.fixture(scope="module")
def proc_server():
    srv = start_server(engine_process=True)
    yield srv
    srv.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def _complete(url: str, prompt: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 24,
                                                   "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_same_greedy_text_and_logprobs_as_offline(proc_server):
    llm = LLM(max_model_len=256, kv_cache_memory="16MiB", dtype="float32")
    offline = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, logprobs=0), use_tqdm=False)
    answers: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, _complete(proc_server.url, PROMPTS[i],
                                                                                   logprobs=0)))
               for i in range(len(PROMPTS))]
    for t in threads:  # concurrent: one batch in the core
        t.start()
    for t in threads:
        t.join()
    for i, out in enumerate(offline):
        choice = answers[i]["choices"][0]
        assert choice["text"] == out.outputs[0].text
        served = choice["logprobs"]["token_logprobs"]
        expected = [lp[t] for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]
        assert served == pytest.approx(expected, abs=1e-4)
    # streamed: the same text, chunk by chunk
    text = ""
    with httpx.stream("POST", f"{proc_server.url}/v1/completions", timeout=60,
                      json={"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0,
                            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == offline[0].outputs[0].text


def test_disconnect_aborts_in_the_core_and_metrics_travel(proc_server):
    proc_server.wait_idle()
    with httpx.stream("POST", f"{proc_server.url}/v1/completions", timeout=60,
                      json={"model": MODEL_NAME, "prompt": "while True:", "max_tokens": 200, "ignore_eos": True,
                            "stream": True}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n == 6:
                break
    m = proc_server.wait_idle(timeout=10)
    # the core checks its KV cache's integrity after every step; a failed check would have ended it
    assert proc_server.engine.is_running
    assert proc_server.engine.stats["kv_cache_usage"] == 0.0
    assert m["tokenmill:kv_cache_usage_perc"] == 0.0
    assert m['tokenmill:request_finished_total{finished_reason=abort}'] >= 1
    assert m["tokenmill:generation_tokens_total"] > 0
    assert m["tokenmill:prefix_cache_queries_total"] > 0
    # n > 1 and a bad request across the boundary
    two = _complete(proc_server.url, "x = ", n=2, temperature=1.0, seed=3)
    assert sorted(c["index"] for c in two["choices"]) == [0, 1]
    r = httpx.post(f"{proc_server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 999})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_core_that_fails_to_start_raises_its_error(tmp_path):
    with pytest.raises(ValueError, match="no-such-model"):  # found before any process starts
        EngineCoreClient(EngineConfig(model="/tmp/no-such-model-dir"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    start = time.time()
    with pytest.raises(EngineCoreError, match="NoSuchForCausalLM"):  # raised in the core, reported here
        EngineCoreClient(EngineConfig(model=str(tmp_path), skip_tokenizer_init=True))
    assert time.time() - start < 60


def _stream_until_killed(url: str, pid: int) -> tuple[list[str], float]:
    """Streams a long request, SIGKILLs the core after the first chunks; returns the lines and
    the time of the kill."""
    lines: list[str] = []
    killed = 0.0
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                      json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 200, "ignore_eos": True,
                            "stream": True}) as r:
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 4:
                os.kill(pid, signal.SIGKILL)
                killed = time.time()
    return lines, killed


def test_killed_core_fails_its_requests_and_answers_503():
    srv = start_server(engine_process=True)
    try:
        pid = srv.engine.pid
        lines, killed = _stream_until_killed(srv.url, pid)
        ended = time.time()
        assert ended - killed < 2.0, "the stream hung on a dead engine"
        assert any('"generation_failed"' in line for line in lines), lines[-3:]
        assert [line for line in lines if line][-1] == "data: [DONE]"
        deadline = killed + 1.0
        while httpx.get(f"{srv.url}/health").status_code == 200:
            assert time.time() < deadline, "/health still passes a second after the core died"
            time.sleep(0.02)
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        srv.stop()
    assert not srv.thread.is_alive()


def test_restart_engine_brings_a_new_core():
    srv = start_server(engine_process=True, restart_engine=True)
    try:
        assert _complete(srv.url, "def f():")["choices"][0]["finish_reason"] == "length"
        old = srv.engine.pid
        lines, killed = _stream_until_killed(srv.url, old)
        assert any('"generation_failed"' in line for line in lines)
        deadline = time.time() + 60
        while not (srv.engine.is_running and srv.engine.pid != old):
            assert time.time() < deadline, "no new engine core"
            time.sleep(0.1)
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert _complete(srv.url, "def f():")["choices"][0]["finish_reason"] == "length"
        assert srv.engine.num_restarts == 1
        m = srv.wait_idle()
        assert m["tokenmill:num_requests_running"] == 0
        assert m['tokenmill:request_finished_total{finished_reason=length}'] == 2
    finally:
        srv.stop()
    assert not _alive(srv.engine.pid)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_serve_runs_the_engine_in_a_child_that_exits_with_its_server(tmp_path):
    proc, url = launch_serve(tmp_path / "server.log", "--max-model-len", "256", "--kv-cache-memory", "16MiB",
                             "--disable-access-log")
    try:
        (core,) = _children(proc.pid)
        assert "tokenmill.engine.core_proc" in Path(f"/proc/{core}/cmdline").read_text()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "def f():", "max_tokens": 8}, timeout=60)
        assert r.status_code == 200, r.text
        proc.kill()  # no chance to stop the core in order: it notices its parent is gone
        proc.wait()
        deadline = time.time() + 5
        while _alive(core):
            assert time.time() < deadline, "the engine core outlived its server"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_tensor_parallel_core_answers_as_offline_and_stops_its_workers():
    """`serve --tensor-parallel-size 2`: the core process is rank 0 and starts rank 1 beside it;
    stopping the server stops both."""
    srv = start_server(engine_process=True, tensor_parallel_size=2, num_threads=2)
    try:
        workers = _children(srv.engine.pid)
        assert len(workers) == 1 and _alive(workers[0])
        for pid in (srv.engine.pid, workers[0]):  # malloc advises huge pages there (executor/huge_pages.py)
            assert b"glibc.malloc.hugetlb=1" in Path(f"/proc/{pid}/environ").read_bytes()
        llm = LLM(max_model_len=256, kv_cache_memory="16MiB", dtype="float32")
        offline = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
        for prompt, out in zip(PROMPTS, offline):
            assert _complete(srv.url, prompt)["choices"][0]["text"] == out.outputs[0].text
    finally:
        srv.stop()
    deadline = time.monotonic() + 10
    while _alive(workers[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(workers[0])


def test_a_dead_tensor_parallel_worker_ends_the_core():
    """A rank that dies leaves a core that cannot step: the request in flight fails, the core
    ends, and the server answers 503."""
    srv = start_server(engine_process=True, tensor_parallel_size=2, num_threads=2)
    try:
        [worker] = _children(srv.engine.pid)
        os.kill(worker, signal.SIGKILL)
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 8},
                       timeout=30)
        assert r.status_code == 500 and "tensor-parallel worker 1 failed" in r.json()["error"]["message"]
        deadline = time.monotonic() + 2
        while httpx.get(f"{srv.url}/health").status_code != 503:
            assert time.monotonic() < deadline, "/health still passes with a dead worker"
            time.sleep(0.05)
    finally:
        srv.stop()
