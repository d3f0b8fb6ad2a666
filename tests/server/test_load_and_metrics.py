"""Many concurrent streams, client disconnects, and /metrics counting what was sent."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time

import httpx2 as httpx
import openai

from tests.server.conftest import MODEL_NAME


def finished(m: dict[str, float], reason: str) -> float:
    return m.get(f"tokenmill:request_finished_total{{finished_reason={reason}}}", 0.0)


def test_64_concurrent_streams_and_metrics(server):
    before = server.wait_idle()
    rng = random.Random(0)
    lengths = [rng.randint(4, 40) for _ in range(64)]
    prompts = [f"def f{i}(x):\n    return x * {i}" for i in range(64)]

    async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[int, int, str]:
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                                 stream=True, stream_options={"include_usage": True},
                                                 temperature=0.7, seed=max_tokens, extra_body={"ignore_eos": True})
        usage, text = None, ""
        async for chunk in stream:
            usage = chunk.usage or usage
            text += "".join(c.text for c in chunk.choices)
        return usage.prompt_tokens, usage.completion_tokens, text

    async def run_all():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    results = asyncio.run(run_all())
    assert [r[1] for r in results] == lengths
    after = server.wait_idle()
    # the KV cache is empty again, and consistent
    assert after["tokenmill:kv_cache_usage_perc"] == 0.0
    server.engine.engine.kv_cache.check_integrity()
    assert server.engine.engine.kv_cache.usage == 0.0
    # counters match what was sent
    sent_prompt = sum(r[0] for r in results)
    assert after["tokenmill:prompt_tokens_total"] - before["tokenmill:prompt_tokens_total"] == sent_prompt
    assert after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] == sum(lengths)
    assert finished(after, "length") - finished(before, "length") == 64
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "time_per_output_token_seconds"):
        assert after[f"tokenmill:{name}_count"] - before[f"tokenmill:{name}_count"] == 64, name
    itl = after["tokenmill:inter_token_latency_seconds_count"] - before["tokenmill:inter_token_latency_seconds_count"]
    assert itl == sum(n - 1 for n in lengths)
    assert after["tokenmill:generation_throughput_toks_per_s"] > 0
    assert 0.0 <= after["tokenmill:prefix_cache_hit_rate"] <= 1.0


def test_streaming_client_disconnect_aborts(server):
    before = server.wait_idle()
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{server.url}/v1/completions",
                           json={"prompt": "while True:", "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            got = [json.loads(line[6:]) for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
            assert got and server.metrics()["tokenmill:num_requests_running"] == 1
    # the response is closed mid-stream: the request is aborted and its blocks freed
    after = server.wait_idle(timeout=10)
    assert finished(after, "abort") - finished(before, "abort") == 1
    assert after["tokenmill:kv_cache_usage_perc"] == 0.0
    assert after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] < 200


def test_non_streaming_client_disconnect_aborts(server):
    before = server.wait_idle()
    body = json.dumps({"prompt": "while True:", "max_tokens": 200, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.time() + 10
        while server.metrics()["tokenmill:num_requests_running"] < 1 and time.time() < deadline:
            time.sleep(0.01)
    after = server.wait_idle(timeout=10)
    assert finished(after, "abort") - finished(before, "abort") == 1
    assert after["tokenmill:kv_cache_usage_perc"] == 0.0
    assert after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] < 200
