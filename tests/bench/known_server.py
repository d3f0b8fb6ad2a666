"""An OpenAI-style streaming server whose timing is known: the first token 50 ms after the
request, then one token every 10 ms. Model "broken" answers 500. Run: python known_server.py PORT"""

from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web

FIRST_TOKEN_S = 0.050
TOKEN_GAP_S = 0.010


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body.get("model") == "broken":
        return web.json_response({"error": {"message": "broken on purpose", "type": "server_error", "param": None,
                                            "code": None}}, status=500)
    n, prompt = body["max_tokens"], body["prompt"]
    loop = asyncio.get_running_loop()
    start = loop.time()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(n):
        # sleep to an absolute deadline so that delays do not accumulate
        await asyncio.sleep(max(0.0, start + FIRST_TOKEN_S + i * TOKEN_GAP_S - loop.time()))
        chunk = {"choices": [{"index": 0, "text": "t", "finish_reason": "length" if i == n - 1 else None}],
                 "usage": None}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
    await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
    return resp


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "known", "object": "model"}]})


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)


if __name__ == "__main__":
    main()
