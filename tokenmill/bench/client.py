"""Async load generator for any OpenAI-compatible server: streamed completions, one
timestamp per chunk, a bounded number of requests in flight.

It is an HTTP client only (DESIGN.md): it never imports the engine. Token counts come
from the server's `usage` (asked for with `stream_options.include_usage`); a server that
sends none gets its tokens counted by the caller (`count_tokens`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from tokenmill.bench.workloads import BenchRequest


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times are time.perf_counter() seconds."""

    start: float
    end: float = 0.0
    scheduled: float | None = None  # when the arrival schedule said to send it
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried text
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None
    status: int | None = None  # the HTTP status; None when no answer came (connection errors)
    tenant: str | None = None  # the tenant it was sent as (BenchRequest.tenant)
    text: str = ""  # the generated text
    usage: bool = True  # token counts from the server's usage; False: counted by the client

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None


ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def request_payload(model: str, request: BenchRequest, endpoint: str, ignore_eos: bool = True) -> dict:
    """Greedy, at most `output_len` tokens, exactly that many with `ignore_eos` (an extension
    that vLLM, SGLang and tokenmill take, sent only when on, as vLLM sends it), streamed with
    a final usage chunk."""
    payload = {"model": model, "max_tokens": request.output_len, "temperature": 0.0,
               "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        payload["ignore_eos"] = True
    if endpoint == "chat":
        if not isinstance(request.prompt, str):
            raise ValueError("the chat endpoint needs text prompts, not token ids")
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    return payload


def _chunk_text(chunk: dict, chat: bool) -> str:
    text = ""
    for choice in chunk.get("choices") or ():
        if chat:
            delta = choice.get("delta") or {}
            text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        else:
            text += choice.get("text") or ""
    return text


async def stream_request(session: aiohttp.ClientSession, url: str, payload: dict,
                         headers: dict[str, str] | None = None) -> RequestRecord:
    """Sends one streamed request; a chunk is timed when it carries text. Reads whatever
    bytes have arrived and parses every whole event in them: events that arrived together
    get the same time, and the client spends one loop turn per read, not per line."""
    chat = "messages" in payload
    record = RequestRecord(start=time.perf_counter())  # moved to the moment the body is sent (_TRACE)
    parts: list[str] = []
    pending = b""
    try:
        async with session.post(url, json=payload, headers=headers, trace_request_ctx=record) as resp:
            record.status = resp.status
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return record
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                *lines, pending = (pending + data).replace(b"\r\n", b"\n").split(b"\n")
                if _take_lines(lines, now, record, parts, chat):
                    break
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"
    record.end = time.perf_counter()
    record.text = "".join(parts)
    return record


def _take_lines(lines: list[bytes], now: float, record: RequestRecord, parts: list[str], chat: bool) -> bool:
    """Reads SSE lines into the record; True at [DONE] or an error event."""
    for line in lines:
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, event names
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            record.error = str((chunk["error"] or {}).get("message", "stream error"))
            return True
        text = _chunk_text(chunk, chat)
        if text:
            record.chunk_times.append(now)
            parts.append(text)
        usage = chunk.get("usage")
        if usage:
            record.prompt_tokens, record.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    return False


async def _body_sent(session: aiohttp.ClientSession, ctx: object, params: object) -> None:
    # latencies count from when the request left the client; the client's own delay before
    # that is reported as lateness against the schedule instead
    record = getattr(ctx, "trace_request_ctx", None)
    if isinstance(record, RequestRecord):
        record.start = time.perf_counter()


def _trace_config() -> aiohttp.TraceConfig:
    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(_body_sent)
    return trace


def arrival_offsets(num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of `num` requests: all at 0 for an infinite rate,
    else gaps drawn from a gamma distribution of mean 1/rate (shape `burstiness`; 1 is Poisson)."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be > 0, got {request_rate} and {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def count_tokens(records: Sequence[RequestRecord], requests: Sequence[BenchRequest], tokenizer: Any | None) -> str:
    """Fills in the token counts of successful requests whose server sent no `usage`: the
    prompt's from the workload, the output's with the tokenizer (or one per text chunk
    without one). Returns how the tokens were counted, for the report."""
    counted: Counter[str] = Counter()
    for record, request in zip(records, requests):
        if not record.ok:
            continue
        if record.output_tokens is not None:
            counted["usage"] += 1
            continue
        record.usage = False
        record.prompt_tokens = request.prompt_len
        if tokenizer is not None:
            record.output_tokens = len(tokenizer.encode(record.text, add_special_tokens=False))
            counted["tokenizer"] += 1
        else:
            record.output_tokens = len(record.chunk_times)
            counted["chunks"] += 1
    notes = {"usage": "the server's usage", "tokenizer": "the tokenizer (no usage from the server)",
             "chunks": "text chunks, one token each (no usage from the server, no tokenizer)"}
    return "; ".join(f"{notes[k]}: {n} requests" for k, n in counted.items()) or "no request completed"


async def run_benchmark(base_url: str, model: str, requests: Sequence[BenchRequest], *, endpoint: str = "completions",
                        path: str | None = None, ignore_eos: bool = True, request_rate: float = math.inf,
                        burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                        api_key: str | None = None, warmup: Sequence[BenchRequest] = (),
                        on_done: Callable[[RequestRecord], None] | None = None,
                        tenant_keys: Mapping[str, str] | None = None,
                        offsets: Sequence[float] | None = None) -> tuple[list[RequestRecord], float]:
    """Sends the requests on a precomputed arrival schedule, at most `max_concurrency` in
    flight; returns the records (in request order) and the wall time from the first send
    to the last answer. `endpoint` says which API the requests speak, `path` where they go
    (default ENDPOINTS[endpoint]). `warmup` requests go first, all at once (within the
    concurrency limit), on the same connection pool, and are left out.

    The schedule is `offsets` (seconds from the start, one per request; bench/tenants.py's
    `interleave` merges one schedule per tenant) or else drawn from `request_rate`,
    `burstiness` and `seed`. A request with a `tenant` is sent with that tenant's key from
    `tenant_keys`, the others with `api_key`."""
    url = base_url.rstrip("/") + (path or ENDPOINTS[endpoint])
    keys = dict(tenant_keys or {})
    missing = sorted({r.tenant for r in (*warmup, *requests) if r.tenant is not None and r.tenant not in keys})
    if missing:
        raise ValueError(f"no API key for tenant {missing[0]!r} (tenant_keys has {', '.join(sorted(keys)) or 'none'})")
    if offsets is None:
        offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    elif len(offsets) != len(requests):
        raise ValueError(f"offsets: one send time per request, got {len(offsets)} for {len(requests)} requests")

    def headers_for(request: BenchRequest) -> dict[str, str] | None:
        key = keys[request.tenant] if request.tenant is not None else api_key
        return {"Authorization": f"Bearer {key}"} if key else None

    payloads = [request_payload(model, r, endpoint, ignore_eos) for r in requests]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trace_configs=[_trace_config()]) as session:
        async def one(request: BenchRequest, payload: dict, at: float, measured: bool = True) -> RequestRecord:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is not None:
                async with limit:
                    record = await stream_request(session, url, payload, headers_for(request))
            else:
                record = await stream_request(session, url, payload, headers_for(request))
            record.scheduled = start + at
            record.tenant = request.tenant
            if on_done is not None and measured:
                on_done(record)
            return record

        start = time.perf_counter()
        await asyncio.gather(*(one(r, request_payload(model, r, endpoint, ignore_eos), 0.0, measured=False)
                               for r in warmup))
        start = time.perf_counter()
        records = await asyncio.gather(*(one(r, p, at) for r, p, at in zip(requests, payloads, offsets)))
        return list(records), max(r.end for r in records) - start
