"""Async load generator for any OpenAI-compatible server: streamed completions, one
timestamp per chunk, a bounded number of requests in flight.

It is an HTTP client only (DESIGN.md): it never imports the engine. Token counts come
from the server's `usage` (asked for with `stream_options.include_usage`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from tokenmill.bench.workloads import BenchRequest


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times are time.perf_counter() seconds."""

    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried text
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None


async def stream_completion(session: aiohttp.ClientSession, url: str, model: str, request: BenchRequest,
                            headers: dict[str, str] | None = None) -> RequestRecord:
    payload = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
               "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    record = RequestRecord(start=time.perf_counter())
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return record
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = chunk["error"].get("message", "stream error")
                    break
                if any(c.get("text") for c in chunk.get("choices", ())):
                    record.chunk_times.append(now)
                usage = chunk.get("usage")
                if usage:
                    record.prompt_tokens, record.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"
    record.end = time.perf_counter()
    if record.error is None and record.output_tokens is None:
        record.error = "the stream ended without a usage chunk"
    return record


async def run_concurrent(base_url: str, model: str, requests: Sequence[BenchRequest], max_concurrency: int,
                         api_key: str | None = None) -> tuple[list[RequestRecord], float]:
    """Sends every request, at most `max_concurrency` in flight; returns the records (in
    request order) and the wall time from the first send to the last answer."""
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    limit = asyncio.Semaphore(max_concurrency)
    connector = aiohttp.TCPConnector(limit=max_concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def one(request: BenchRequest) -> RequestRecord:
            async with limit:
                return await stream_completion(session, url, model, request, headers)

        start = time.perf_counter()
        records = await asyncio.gather(*(one(r) for r in requests))
        return list(records), time.perf_counter() - start
