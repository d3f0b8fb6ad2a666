"""The FastAPI app: OpenAI-compatible routes, errors as OpenAI bodies, auth, metrics.

    POST /v1/completions        POST /v1/chat/completions      GET /v1/models
    GET /v1/usage               GET /v1/prefix_cache           GET /health
    GET /metrics                GET /openapi.json

With tenants (server/tenancy.py) every /v1 request is authenticated to a tenant,
admitted by its limits before it is queued, and charged what it used when its
answer ends, streamed or not, finished or abandoned.

Every error, including FastAPI's own validation errors, is answered as
`{"error": {"message", "type", "param", "code"}}`; bad input is a 4xx, never a 500.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.async_engine import EngineClient
from tokenmill.router.summary import PrefixCacheLog
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import (APIError, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                       CompletionResponse, ErrorResponse, ModelList)
from tokenmill.server.chat import ChatServing
from tokenmill.server.completions import CompletionServing
from tokenmill.server.serving import Choice
from tokenmill.server.tenancy import Tenancy, make_tenancy
from tokenmill.server.tenants import Tenant

logger = logging.getLogger("tokenmill.server")
access_logger = logging.getLogger("tokenmill.access")
T = TypeVar("T")
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 503)}
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "null"}
_STREAMED: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {}}}}


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def build_app(engine: EngineClient, served_model_names: list[str], metrics: ServerMetrics,
              api_key: str | None = None, tenancy: Tenancy | None = None, access_log: bool = False,
              prefix_cache: PrefixCacheLog | None = None) -> FastAPI:
    """The app; starting it (lifespan) starts the engine client, stopping it stops the engine.
    `api_key` alone is one tenant with no limits; `tenancy` brings tenants and their limits.
    `access_log`: a line per HTTP request naming its tenant (never its key). `prefix_cache`:
    what the engine's prefix cache holds, fed by the engine client's events, for
    GET /v1/prefix_cache (router/summary.py)."""
    if tenancy is None:
        tenancy = make_tenancy(metrics, api_key=api_key)
    completion_serving = CompletionServing(engine, served_model_names)
    chat_serving = ChatServing(engine, served_model_names)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.stop()
            if tenancy.limits is not None:
                tenancy.limits.close()

    app = FastAPI(title="tokenmill", description="OpenAI-compatible LLM inference server", lifespan=lifespan)
    install_error_handlers(app)
    if access_log:
        app.add_middleware(AccessLog)

    async def authenticate(request: Request) -> None:
        tenant = tenancy.authenticate(request.headers.get("authorization", ""))
        request.state.tenant = tenant

    async def admitted(request: Request, rid: str, choices: list[Choice], n: int,
                       stream: Callable[[], AsyncIterator[str]] | None,
                       whole: Callable[[], Awaitable[dict[str, Any]]]) -> Response:
        """Runs an answer under its tenant's limits: admitted (or 429) before anything is queued,
        released with the tokens it used when it ends, however it ends."""
        grant = await off_loop(tenancy.admit, request.state.tenant, rid, choices, n)

        def release() -> None:
            if tenancy.blocking:  # a network store: on a thread, never holding up the event loop
                asyncio.get_running_loop().run_in_executor(None, tenancy.release, grant, choices, n)
            else:
                tenancy.release(grant, choices, n)

        if stream is not None:
            return ReleasedStream(stream(), release)
        try:
            return JSONResponse(await unless_disconnected(request, whole()))
        finally:
            release()

    async def off_loop(fn: Callable[..., T], *args: Any) -> T:
        """Calls into the limits store: on a thread when it goes over the network (Redis), so a
        slow or lost Redis delays only the requests that wait on it."""
        return await asyncio.to_thread(fn, *args) if tenancy.blocking else fn(*args)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)], responses=_ERRORS)

    @v1.get("/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": started,
                                            "owned_by": "tokenmill", "max_model_len": engine.max_model_len}
                                           for name in served_model_names]}

    @v1.post("/completions", response_model=CompletionResponse, responses=_STREAMED)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        origin = tenancy.origin(request.state.tenant, body.priority, completion_serving.model_name(body.model))
        rid, choices = completion_serving.prepare_completion(body, origin)
        await completion_serving.compile_grammar(body, choices)
        stream = (lambda: completion_serving.completion_stream(body, rid, choices)) if body.stream else None
        return await admitted(request, rid, choices, body.n, stream,
                              lambda: completion_serving.completion(body, rid, choices))

    @v1.post("/chat/completions", response_model=ChatCompletionResponse, responses=_STREAMED)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        origin = tenancy.origin(request.state.tenant, body.priority, chat_serving.model_name(body.model))
        rid, choices = chat_serving.prepare_chat(body, origin)
        await chat_serving.compile_grammar(body, choices)
        stream = (lambda: chat_serving.chat_stream(body, rid, choices)) if body.stream else None
        return await admitted(request, rid, choices, body.n, stream, lambda: chat_serving.chat(body, rid, choices))

    app.include_router(v1)

    @app.get("/v1/usage", responses=_ERRORS)
    async def usage(request: Request) -> dict[str, Any]:
        """The caller's tenant's usage in its quota period and what is left; every tenant's
        with the admin key."""
        return await off_loop(tenancy.usage, request.headers.get("authorization", ""))

    @app.get("/v1/prefix_cache", responses=_ERRORS)
    async def prefix_cache_summary(request: Request, since: str | None = None) -> dict[str, Any]:
        """The block hashes the prefix cache holds (all, or what changed since the cursor
        `since`), for a router in front of several servers. It needs a key where /v1/* does
        (a tenant's or the admin key): it tells whether a given prompt was served lately."""
        authorization = request.headers.get("authorization", "")
        if not tenancy.is_admin(authorization):
            tenancy.authenticate(authorization)
        if prefix_cache is None:
            raise APIError(404, "this server keeps no prefix-cache summary", code="not_found")
        return prefix_cache.summary(since)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        raise APIError(503, "the engine is not running", type="server_error", code="engine_unavailable")

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class AccessLog:
    """One log line per HTTP request, naming its tenant (set on request.state by the
    authentication), never its key; replaces uvicorn's access log."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 0

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            tenant: Tenant | None = scope.get("state", {}).get("tenant")
            client = scope.get("client") or ("-", 0)
            access_logger.info('%s:%s tenant=%s "%s %s HTTP/%s" %d %.1fms', client[0], client[1],
                               tenant.name if tenant is not None else "-", scope["method"], scope["path"],
                               scope.get("http_version", "1.1"), status or 499, (time.perf_counter() - start) * 1e3)


class ReleasedStream(StreamingResponse):
    """A streamed answer (SSE) that, when the response ends however it ends (finished, the
    client gone, cancelled before its body ever started), closes its body (which aborts its
    engine requests) and then calls `release` (the tenant's grant: idempotent). Starlette
    itself neither closes a body it stopped iterating nor runs one it never started."""

    def __init__(self, chunks: AsyncIterator[str], release: Callable[[], None]) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._chunks, self._release = chunks, release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._chunks.aclose()  # type: ignore[attr-defined]
            finally:
                self._release()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Runs `work` until it is done or the client disconnects; on a disconnect the work is
    cancelled (which aborts its engine requests) and ClientGone is raised."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # cancel() only asks: wait until the task has unwound (its engine requests aborted),
            # so that its outcome is set and read below, never left for asyncio to report
            await asyncio.wait((task,))
    if task.cancelled():
        raise ClientGone()
    return task.result()  # also when it finished as the client left: its result (or its error)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_error(e.errors()).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        error = APIError(e.status_code, str(e.detail), type="invalid_request_error" if e.status_code < 500
                         else "server_error")
        return JSONResponse(error.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the nginx convention for a closed client

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        error = APIError(500, f"internal error: {type(e).__name__}", type="server_error")
        return JSONResponse(error.body(), status_code=500)


def _validation_error(errors: list[dict[str, Any]]) -> APIError:
    """FastAPI's 422 list as one OpenAI-style 400 naming the first offending field."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
    param = ""
    for x in first.get("loc", ())[1:]:  # [0] is "body"
        if isinstance(x, int):
            param += f"[{x}]"
        elif "[" not in x and x not in _TYPE_TAGS:  # unions add the alternative's type to the path
            param += f".{x}" if param else x
    param = param or None
    message = first.get("msg", "invalid request")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return APIError(400, f"{param or 'body'}: {message}{more}", param=param)
