"""The Ray backend (`--distributed-executor-backend ray`): two data-parallel replicas as actors
of a local Ray cluster started here (`ray.init(num_cpus=2)`), talking to the front over TCP.
They answer as the offline engine; an actor killed mid-run fails its in-flight requests
(errors, not hangs), the router stops sending to it, and the other keeps serving."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.server.conftest import MODEL_NAME, start_server
from tokenmill import LLM, SamplingParams

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two replicas need two cores")

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, x):", "for i in range("]


@pytest.fixture(scope="module")
def ray_server():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=128 * 1024**2)
    srv = start_server(data_parallel_size=2, ray=True)
    yield srv
    srv.stop()
    ray.shutdown()


def _complete(url: str, prompt: str, max_tokens: int = 24) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": MODEL_NAME, "prompt": prompt,
                                                                "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_replicas_are_ray_actors_and_answer_as_offline(ray_server):
    for replica in ray_server.engine.replicas:  # each core is an actor's Ray worker process
        actor = replica._core.process.actor
        assert ray.get(actor.pid.remote()) == replica.pid
        assert Path(f"/proc/{replica.pid}/cmdline").read_text().startswith("ray::EngineCoreActor")
        # started with glibc's huge-page malloc tunable, as a subprocess core is
        assert b"glibc.malloc.hugetlb=1" in Path(f"/proc/{replica.pid}/environ").read_bytes()
    llm = LLM(max_model_len=256, kv_cache_memory="16MiB", dtype="float32")
    offline = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    answers: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, _complete(ray_server.url, PROMPTS[i])))
               for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [answers[i]["text"] for i in range(len(PROMPTS))] == [o.outputs[0].text for o in offline]
    assert all(n > 0 for n in ray_server.engine.router.num_routed)  # both replicas served


def _stream(url: str, prompt: str, lines: list[str], started: threading.Event) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                      json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 200, "ignore_eos": True,
                            "stream": True}) as r:
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) >= 4:
                started.set()


def test_a_killed_actor_fails_its_requests_and_is_routed_around(ray_server):
    engine = ray_server.engine
    # four long streams, two on each replica (loads break the ties of prompts with no shared prefix)
    streams = [([], threading.Event()) for _ in range(4)]
    threads = [threading.Thread(target=_stream, args=(ray_server.url, f"{i} {PROMPTS[i]}", *s))
               for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    for _, started in streams:
        assert started.wait(30)
    ray.kill(engine.replicas[0]._core.process.actor)
    killed = time.time()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a stream hung on a dead replica"
    assert time.time() - killed < 5
    ended = [[line for line in lines if line] for lines, _ in streams]
    assert all(lines[-1] == "data: [DONE]" for lines in ended)
    failed = [lines for lines in ended if any('"generation_failed"' in line for line in lines)]
    assert 1 <= len(failed) < 4  # the dead replica's requests failed; the other's finished
    assert not engine.replicas[0].is_running and engine.replicas[1].is_running
    assert httpx.get(f"{ray_server.url}/health").status_code == 200
    before = list(engine.router.num_routed)
    for prompt in PROMPTS:
        assert _complete(ray_server.url, prompt, max_tokens=8)["finish_reason"] == "length"
    assert engine.router.num_routed == [before[0], before[1] + len(PROMPTS)]
