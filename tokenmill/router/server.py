"""`tokenmill router`: one OpenAI-compatible front for tokenmill servers on other hosts,
sending each request to the one holding the longest cached prefix of its prompt.

    POST /v1/completions, /v1/chat/completions
        body read once; its prompt tokenized as the servers do it (chat: their template)
        -> Backends.choose: PrefixRouter over the healthy backends (cached prefix, then load)
        -> that server; its answer passed back unchanged: status, body, SSE chunks as they come
    GET /v1/models   a healthy backend's answer
    GET /health      200 while a backend is healthy, else 503
    GET /metrics     the router's own (router/metrics.py)

The Authorization header and the body go through unchanged: each server authenticates and
limits its own clients. A request that cannot reach its backend before the first byte of
an answer (connection refused or reset, timed out) marks that backend unhealthy and goes
to the next healthy one; once an answer has begun, a failure is the client's: a 502, or in
a stream an error event and then [DONE], never a hang.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill.router.backends import TRANSPORT_ERRORS, Backend, Backends
from tokenmill.server.api import ReleasedStream, install_error_handlers, unless_disconnected
from tokenmill.server.chat import chat_prompt_ids
from tokenmill.server.protocol import APIError, ChatCompletionRequest
from tokenmill.server.serving import SSE_DONE, sse

logger = logging.getLogger("tokenmill.router")

CONNECT_TIMEOUT_S = 5.0  # a backend that does not accept the connection by then is unhealthy
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authorization", "proxy-connection", "te", "trailer",
               "transfer-encoding", "upgrade"}
_DROP_REQUEST = _HOP_BY_HOP | {"host", "content-length", "accept-encoding"}
_DROP_RESPONSE = _HOP_BY_HOP | {"content-length", "content-encoding", "date", "server"}


def prompt_of(tokenizer: Any, path: str, body: bytes) -> tuple[list[int], bool]:
    """The token ids of the request's (first) prompt as the servers will compute them, and
    whether it streams. A body they would refuse gives no tokens: it is routed by load, and
    the server it reaches answers it with the error."""
    try:
        data = json.loads(body)
        stream = data.get("stream") is True
    except (ValueError, AttributeError):
        return [], False
    try:
        if path == "/v1/chat/completions":
            return chat_prompt_ids(tokenizer, ChatCompletionRequest.model_validate(data)), stream
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # several prompts: they go to one server, routed by the first
        if isinstance(prompt, str):
            return tokenizer.encode(prompt, add_special_tokens=True), stream
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return prompt, stream
    except (ValueError, APIError):  # pydantic's ValidationError is a ValueError
        pass
    return [], stream


class Proxy:
    """Sends requests to the backends Backends picks and passes their answers back."""

    def __init__(self, backends: Backends, tokenizer: Any, request_timeout: float = 600.0) -> None:
        self.backends = backends
        self.metrics = backends.metrics
        self.tokenizer = tokenizer
        # sock_read: a backend silent this long (no head of a whole answer, no chunk of a stream) has failed
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=request_timeout)
        # one thread: a Hugging Face tokenizer used from two threads at once can raise "Already borrowed"
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-router-tokenize")
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))  # no cap on connections

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()
        self._tokenizing.shutdown(wait=False)

    async def forward(self, request: Request, path: str) -> Response:
        """A POST of a completion or a chat completion, streamed or not."""
        body = await request.body()
        loop = asyncio.get_running_loop()
        token_ids, stream = await loop.run_in_executor(self._tokenizing, prompt_of, self.tokenizer, path, body)
        if not stream:
            return await unless_disconnected(request, self.whole(request, "POST", path, body, token_ids))
        backend, resp = await self.open(request, "POST", path, body, token_ids)
        if resp.status != 200 or resp.content_type != "text/event-stream":  # an error answer: whole
            return await self._read(backend, resp)
        finished = False

        def finish() -> None:  # however the stream ends, once; closing drops the backend's request too
            nonlocal finished
            if not finished:
                finished = True
                resp.close()
                backend.in_flight -= 1

        return ReleasedStream(self._relay(backend, resp), finish)

    async def whole(self, request: Request, method: str, path: str, body: bytes | None,
                    token_ids: Sequence[int] | None) -> Response:
        """A request whose answer comes back whole (not streamed)."""
        backend, resp = await self.open(request, method, path, body, token_ids)
        return await self._read(backend, resp)

    async def open(self, request: Request, method: str, path: str, body: bytes | None,
                   token_ids: Sequence[int] | None) -> tuple[Backend, aiohttp.ClientResponse]:
        """Sends the request to a chosen backend and returns its answer's head (that backend's
        in_flight raised: the caller lowers it when the answer ends); one that cannot be
        reached is marked unhealthy and the next is tried. 503 when none is left."""
        assert self.session is not None
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST]
        tried: set[int] = set()
        while True:
            backend = self.backends.choose(token_ids, tried)
            if backend is None:
                self.metrics.unavailable.inc()
                raise APIError(503, f"no healthy backend ({len(tried)} tried, of {len(self.backends.backends)}); "
                               "retry later", type="server_error", code="no_backend", headers={"Retry-After": "1"})
            tried.add(backend.index)
            backend.in_flight += 1
            try:
                resp = await self.session.request(method, backend.url + path, data=body, headers=headers,
                                                  timeout=self.timeout, allow_redirects=False)
            except TRANSPORT_ERRORS as e:  # nothing of an answer came: another backend may serve it
                backend.in_flight -= 1
                self.backends.mark_unhealthy(backend, f"{method} {path}: {type(e).__name__}: {e}")
                self.metrics.retries.labels(backend=backend.url).inc()
                continue
            except BaseException:
                backend.in_flight -= 1
                raise
            return backend, resp

    async def _read(self, backend: Backend, resp: aiohttp.ClientResponse) -> Response:
        """A whole answer, with the backend's status and headers."""
        try:
            data = await resp.read()
        except TRANSPORT_ERRORS as e:
            resp.close()
            self._failed(backend, e)
            raise APIError(502, f"backend {backend.url} failed while answering: {type(e).__name__}: {e}",
                           type="server_error", code="backend_failed") from e
        except BaseException:  # the client left: dropping the connection aborts the backend's request
            resp.close()
            raise
        finally:
            backend.in_flight -= 1
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_RESPONSE}
        return Response(data, status_code=resp.status, headers=headers)

    async def _relay(self, backend: Backend, resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The backend's SSE events as they come, whole events only, so that an error event
        after a failure never lands inside a half-sent one."""
        pending = b""
        try:
            async for data in resp.content.iter_any():
                pending += data
                end = pending.rfind(b"\n\n") + 2
                if end > 1:
                    yield pending[:end]
                    pending = pending[end:]
        except TRANSPORT_ERRORS as e:
            self._failed(backend, e)
            error = {"message": f"backend {backend.url} failed in the stream: {type(e).__name__}: {e}",
                     "type": "server_error", "param": None, "code": "backend_failed"}
            yield (sse({"error": error}) + SSE_DONE).encode()
            return
        if pending:
            yield pending

    def _failed(self, backend: Backend, e: BaseException) -> None:
        """An answer cut off: the backend is likely gone; the poller recovers it if not."""
        self.metrics.failed.labels(backend=backend.url).inc()
        self.backends.mark_unhealthy(backend, f"an answer was cut off: {type(e).__name__}: {e}")


def build_router_app(backends: Backends, proxy: Proxy) -> FastAPI:
    """The app; starting it polls the backends once and starts the poller, stopping it stops both."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        await backends.start()
        try:
            yield
        finally:
            await backends.stop()
            await proxy.stop()

    app = FastAPI(title="tokenmill router", description="OpenAI-compatible front for tokenmill servers",
                  lifespan=lifespan)
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.whole(request, "GET", "/v1/models", None, None)

    @app.get("/health")
    async def health() -> Response:
        state = [{"url": b.url, "healthy": b.healthy, "load": b.load} for b in backends.backends]
        if backends.any_healthy:
            return JSONResponse({"backends": state})
        raise APIError(503, "no healthy backend: " + ", ".join(b.url for b in backends.backends),
                       type="server_error", code="no_backend")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(backends.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def run_router(urls: Sequence[str], host: str = "127.0.0.1", port: int = 8000, policy: str = "prefix",
               poll_interval: float = 1.0, tokenizer: str | None = None, api_key: str | None = None,
               request_timeout: float = 600.0, log_level: str = "info") -> int:
    """Serves until SIGTERM/SIGINT; raises ValueError naming the flag on bad input, before
    the tokenizer loads. `tokenizer`: a directory or hub id (default: the built-in model's)."""
    from tokenmill.config import DEFAULT_MODEL_DIR
    from tokenmill.engine.detokenizer import load_tokenizer
    from tokenmill.router.backends import backend_url
    from tokenmill.server.launch import GracefulServer

    if not 0 < port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {port}")
    if not request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0 seconds, got {request_timeout}")
    backends = Backends([backend_url(u) for u in urls], policy, poll_interval, api_key)
    proxy = Proxy(backends, load_tokenizer(tokenizer or DEFAULT_MODEL_DIR), request_timeout)
    app = build_router_app(backends, proxy)
    server = GracefulServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30))
    logger.info("routing (%s) on http://%s:%d to %s", policy, host, port, ", ".join(b.url for b in backends.backends))
    server.run()
    return 0 if server.started else 1
