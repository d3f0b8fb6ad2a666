"""A client that closes the connection before its non-streamed answer is ready: the request
is aborted and its KV blocks freed, and the server log stays quiet (no 500 handler, no
traceback, no "Task exception was never retrieved")."""

from __future__ import annotations

import gc
import json
import logging
import socket
import time

import pytest

from tests.server.test_load_and_metrics import finished


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "while True:"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "while True:"}]}),
], ids=["completions", "chat"])
def test_non_streamed_disconnect_is_aborted_quietly(server, caplog, path, body):
    before = server.wait_idle()
    payload = json.dumps({**body, "max_tokens": 230, "ignore_eos": True, "stream": False}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    # uvicorn's loggers do not propagate to the root logger, where caplog listens: listen there too
    uvicorn_logger = logging.getLogger("uvicorn")
    uvicorn_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING):
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload))
                deadline = time.time() + 10
                while server.metrics()["tokenmill:num_requests_running"] < 1 and time.time() < deadline:
                    time.sleep(0.01)
                assert server.metrics()["tokenmill:num_requests_running"] == 1
                # generating: the answer is not ready when the connection closes (the built-in model decodes
                # 1,000-1,500 tokens a second alone on a 2-core CPU: 200 tokens were done within 0.2 s)
                time.sleep(0.05)
            after = server.wait_idle(timeout=10)
            time.sleep(0.2)  # the handler finishes after the engine went idle
            gc.collect()  # an unretrieved task exception is reported when the task is collected
    finally:
        uvicorn_logger.removeHandler(caplog.handler)

    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING and
             (r.exc_info or "InvalidStateError" in r.getMessage() or "unhandled error" in r.getMessage()
              or "never retrieved" in r.getMessage() or "Traceback" in r.getMessage())]
    assert not noisy, [f"{r.name}: {r.getMessage()} {r.exc_info and r.exc_info[1]!r}" for r in noisy]
    # the request was aborted, not finished, and every KV block came back
    assert finished(after, "abort") - finished(before, "abort") == 1
    assert after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] < 230
    assert after["tokenmill:kv_cache_usage_perc"] == 0.0
    kv = server.engine.engine.kv_cache
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_a_stream_that_never_started_still_releases_its_tenant_grant():
    """A client gone before its streamed answer began (the first send fails): Starlette never
    iterates the body, so only the response itself can close it and release the grant, once."""
    import asyncio

    from tokenmill.server.api import ReleasedStream

    events: list[str] = []

    async def chunks():
        events.append("started")
        try:
            yield "data: x\n\n"
        finally:
            events.append("closed")

    async def receive():
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    async def gone(message):
        raise OSError("the client has gone")

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    with pytest.raises(Exception):
        asyncio.run(ReleasedStream(chunks(), lambda: events.append("released"))(scope, receive, gone))
    assert events == ["released"]  # never started, released once

    events.clear()
    asyncio.run(ReleasedStream(chunks(), lambda: events.append("released"))(scope, receive, send))
    assert events == ["started", "closed", "released"]
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
