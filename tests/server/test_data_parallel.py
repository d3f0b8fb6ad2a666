"""Data parallel: two engine-core processes behind one server. Answers equal the offline
engine's, requests sharing a prefix go to the replica that caches it, metrics sum the
replicas, and a replica that dies is routed around while the other serves."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import httpx2 as httpx
import pytest

from tests.server.conftest import MODEL_NAME, start_server
from tokenmill import LLM, SamplingParams
from tokenmill.executor.distributed.parallel import split_cpus
from tokenmill.router.summary import Summary

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two replicas need two cores")


def _prefix(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 8000) for _ in range(96)]


def _complete(url: str, prompt: list[int], max_tokens: int = 8) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": MODEL_NAME, "prompt": prompt,
                                                                "max_tokens": max_tokens, "temperature": 0,
                                                                "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.fixture(scope="module")
def dp_server():
    srv = start_server(data_parallel_size=2)
    yield srv
    srv.stop()


def test_prefix_groups_stay_on_one_replica_with_offline_answers(dp_server):
    prompts = [_prefix(p) + [200 + i, 300 + i] for i in range(4) for p in (1, 2)]
    answers: dict[int, dict] = {}

    def send(i: int) -> None:
        time.sleep(0.05 * i)  # in order, overlapping
        answers[i] = _complete(dp_server.url, prompts[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    llm = LLM(max_model_len=256, kv_cache_memory="16MiB", dtype="float32")
    offline = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert [answers[i]["token_ids"] for i in range(len(prompts))] == [o.outputs[0].token_ids for o in offline]
    router = dp_server.engine.router
    assert router.num_routed == [4, 4]
    # each prefix's blocks in exactly one replica's mirror
    assert router.held[0] and router.held[1] and not router.held[0].keys() & router.held[1].keys()
    m = dp_server.wait_idle()
    assert m["tokenmill:prefix_cache_hits_total"] >= 2 * 3 * 80  # 3 of each prefix's 4 requests hit it
    # the server's prefix-cache summary (for a router in front of several servers) is the union
    summary = Summary.parse(httpx.get(f"{dp_server.url}/v1/prefix_cache").json())
    assert set(summary.stored) == router.held[0].keys() | router.held[1].keys()
    assert m["tokenmill:num_requests_running"] == 0 and m["tokenmill:kv_cache_usage_perc"] == 0.0


def test_a_dead_replica_is_routed_around(dp_server):
    pid = dp_server.engine.pids[0]
    os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 2
    while dp_server.engine.replicas[0].is_running:
        assert time.time() < deadline, "the dead replica was not noticed"
        time.sleep(0.02)
    assert httpx.get(f"{dp_server.url}/health").status_code == 200  # the other one serves
    before = list(dp_server.engine.router.num_routed)
    for seed in range(4):
        assert _complete(dp_server.url, _prefix(seed))["finish_reason"] == "length"
    assert dp_server.engine.router.num_routed == [before[0], before[1] + 4]
    assert not dp_server.engine.router.held[0]  # what the dead replica held is forgotten
    assert dp_server.prefix_cache.held == dp_server.engine.router.held[1].keys()  # by the summary too


def test_replicas_split_the_cores():
    cores = sorted(os.sched_getaffinity(0))
    half = len(cores) // 2
    assert split_cpus(2, None, "--data-parallel-size") == [cores[:half], cores[half:2 * half]]
    with pytest.raises(ValueError, match="--data-parallel-size"):
        split_cpus(len(cores) + 1, None, "--data-parallel-size")
    with pytest.raises(ValueError, match="--num-threads"):
        split_cpus(2, len(cores) + 1, "--data-parallel-size")
