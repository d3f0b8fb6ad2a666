"""An OpenAI-style streaming server whose timing is known: the first token 50 ms after the
request, then one token every 10 ms, on /v1/completions and /v1/chat/completions.

Models: "known" as above; "no-usage" the same without the usage chunk; "shared" makes the
token gap grow with load, 10 ms x max(1, streams in flight / 4), like a server of fixed
capacity; "flood" sends every chunk in a write of its own without waiting, "burst" all
of them in one write (both to measure the client); "eos" meets its end of sequence after
3 tokens unless the request says `ignore_eos`; "broken" answers 500.

Every request's Authorization header is counted (GET /auth-counts: header -> requests, "" for
none); a key that ends in "-429" is answered 429, as a rate-limited tenant is. Run:
python known_server.py PORT
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter

from aiohttp import web

FIRST_TOKEN_S = 0.050
TOKEN_GAP_S = 0.010
SHARED_CAPACITY = 4
EOS_AFTER = 3

in_flight = 0
auth_counts: Counter[str] = Counter()


def chunk(text: str, last: bool, chat: bool) -> bytes:
    finish = "length" if last else None
    choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
              else {"index": 0, "text": text, "finish_reason": finish})
    return f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n".encode()


async def generate(request: web.Request) -> web.StreamResponse:
    global in_flight
    auth = request.headers.get("Authorization", "")
    auth_counts[auth] += 1
    if auth.endswith("-429"):
        return web.json_response({"error": {"message": "rate limited on purpose", "type": "rate_limit_exceeded",
                                            "param": None, "code": "rate_limit_exceeded"}}, status=429)
    body = await request.json()
    model, n = body.get("model"), body["max_tokens"]
    if model == "eos" and not body.get("ignore_eos"):
        n = min(n, EOS_AFTER)
    if model == "broken":
        return web.json_response({"error": {"message": "broken on purpose", "type": "server_error", "param": None,
                                            "code": None}}, status=500)
    chat = "messages" in body
    prompt = body["messages"][0]["content"] if chat else body["prompt"]
    prompt_tokens = len(prompt.split()) if isinstance(prompt, str) else len(prompt)  # words: one token each
    loop = asyncio.get_running_loop()
    start = loop.time()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if model == "burst":
        await resp.write(b"".join(chunk(" t", i == n - 1, chat) for i in range(n)))
    elif model == "flood":
        for i in range(n):
            await resp.write(chunk(" t", i == n - 1, chat))
            await asyncio.sleep(0)  # let the other streams write: one chunk per send, interleaved
    else:
        in_flight += 1
        try:
            due = start + FIRST_TOKEN_S
            for i in range(n):
                # sleep to an absolute deadline so that delays do not accumulate
                await asyncio.sleep(max(0.0, due - loop.time()))
                await resp.write(chunk(" t", i == n - 1, chat))
                load = max(1.0, in_flight / SHARED_CAPACITY) if model == "shared" else 1.0
                due += TOKEN_GAP_S * load
        finally:
            in_flight -= 1
    if model != "no-usage":
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "known", "object": "model"}]})


async def auth(request: web.Request) -> web.Response:
    return web.json_response(dict(auth_counts))


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/auth-counts", auth)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)


if __name__ == "__main__":
    main()
