"""The FastAPI app: OpenAI-compatible routes, errors as OpenAI bodies, auth, metrics.

    POST /v1/completions        POST /v1/chat/completions      GET /v1/models
    GET /health                 GET /metrics                   GET /openapi.json

Every error, including FastAPI's own validation errors, is answered as
`{"error": {"message", "type", "param", "code"}}`; bad input is a 4xx, never a 500.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import (APIError, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                       CompletionResponse, ErrorResponse, ModelList)
from tokenmill.server.chat import ChatServing
from tokenmill.server.completions import CompletionServing

logger = logging.getLogger("tokenmill.server")
T = TypeVar("T")
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 503)}
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "null"}
_STREAMED: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {}}}}


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def build_app(engine: AsyncEngine, served_model_names: list[str], metrics: ServerMetrics,
              api_key: str | None = None) -> FastAPI:
    """The app; starting it (lifespan) starts the engine thread, stopping it stops the thread."""
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

    app = FastAPI(title="tokenmill", description="OpenAI-compatible LLM inference server", lifespan=lifespan)
    _install_error_handlers(app)

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)], responses=_ERRORS)

    @v1.get("/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": started,
                                            "owned_by": "tokenmill", "max_model_len": engine.max_model_len}
                                           for name in served_model_names]}

    @v1.post("/completions", response_model=CompletionResponse, responses=_STREAMED)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        completion_serving.model_name(body.model)
        rid, choices = completion_serving.prepare_completion(body)
        await completion_serving.compile_grammar(body, choices)
        if body.stream:
            return _sse(completion_serving.completion_stream(body, rid, choices))
        return JSONResponse(await _unless_disconnected(request, completion_serving.completion(body, rid, choices)))

    @v1.post("/chat/completions", response_model=ChatCompletionResponse, responses=_STREAMED)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        chat_serving.model_name(body.model)
        rid, choices = chat_serving.prepare_chat(body)
        await chat_serving.compile_grammar(body, choices)
        if body.stream:
            return _sse(chat_serving.chat_stream(body, rid, choices))
        return JSONResponse(await _unless_disconnected(request, chat_serving.chat(body, rid, choices)))

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        raise APIError(503, "the engine is not running", type="server_error", code="engine_unavailable")

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
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
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled():
        raise ClientGone()
    return task.result()


def _install_error_handlers(app: FastAPI) -> None:
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
