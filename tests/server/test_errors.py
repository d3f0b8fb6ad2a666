"""Bad input answers 4xx with an OpenAI error body and never disturbs other requests;
auth; back-pressure; a schemathesis fuzz of the whole API finds no 5xx."""

from __future__ import annotations

import json
import threading

import httpx2 as httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.server.conftest import start_server

CHAT = [{"role": "user", "content": "hi"}]
# (path, body, status, param): body None = malformed JSON
BAD = [
    ("/v1/completions", None, 400, None),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x " * 400}, 400, "prompt"),
    ("/v1/completions", {"prompt": [], "max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": -3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 150}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "bad_words": [" "]}, 400, "bad_words"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "n": 1, "best_of": 2, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "echo": True}, 400, "echo"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://x/y.png"}}]}]}, 400, "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 5000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 400}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "nope"}, 404, "model"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    # structured outputs: a malformed or unsupported schema, regex or grammar names its field
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "structural_tag"}}, 400,
     "response_format.type"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"properties": {"a": {"$ref": "#/nowhere"}}}}}}, 400, "response_format"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "(abc"}, 400, "guided_regex"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": "start: nothing_here"}, 400, "guided_grammar"),
    ("/v1/completions", {"prompt": "x", "guided_choice": []}, 400, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "guided_json": "{oops"}, 400, "guided_json"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400,
     "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"structural_tag": "{}"}}, 400,
     "structured_outputs.structural_tag"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a"},
     400, "guided_regex"),
    # only the tokenizer can tell: a token id past the vocabulary (compiled before anything is queued)
    ("/v1/completions", {"prompt": "x", "guided_grammar": 'start: <[99999]> "a"'}, 400, "guided_grammar"),
    ("/v1/completions", {"prompt": "x", "guided_json": {"type": "object"}, "guided_whitespace_pattern": "(("}, 400,
     "guided_whitespace_pattern"),
]


def post(url: str, body) -> httpx.Response:
    data = b'{"prompt": "x", ' if body is None else json.dumps(body).encode()
    return httpx.post(url, content=data, headers={"Content-Type": "application/json"}, timeout=30)


def test_bad_input_is_4xx_and_disturbs_nobody(server):
    # a long request runs while the bad ones come in: it must finish untouched
    result = {}

    def long_request():
        result["r"] = post(f"{server.url}/v1/completions",
                           {"prompt": "import sys", "max_tokens": 120, "ignore_eos": True, "temperature": 0})

    t = threading.Thread(target=long_request)
    t.start()
    for path, body, status, param in BAD:
        r = post(f"{server.url}{path}", body)
        assert r.status_code == status, (path, body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], r.text
        assert error["param"] == param, (body, error)
    t.join()
    assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 120
    # the lengths are named in the context errors
    msg = post(f"{server.url}/v1/completions", {"prompt": "x " * 400}).json()["error"]["message"]
    assert "max_model_len 256" in msg and "tokens" in msg
    assert httpx.get(f"{server.url}/v1/nothing").status_code == 404
    assert httpx.get(f"{server.url}/v1/completions").json()["error"]["type"] == "invalid_request_error"


def test_api_key():
    srv = start_server(api_key="sekret")
    try:
        body = {"prompt": "x", "max_tokens": 2}
        r = httpx.post(f"{srv.url}/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(f"{srv.url}/v1/completions", json=body,
                          headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401
        ok = httpx.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert httpx.get(f"{srv.url}/metrics").status_code == 200
    finally:
        srv.stop()


def test_back_pressure_503():
    srv = start_server(max_waiting_requests=2, max_num_seqs=1)
    try:
        with httpx.Client(timeout=60) as client:
            body = {"prompt": "x = 1", "max_tokens": 200, "ignore_eos": True, "stream": True}
            streams = [client.stream("POST", f"{srv.url}/v1/completions", json=body) for _ in range(3)]
            responses = [s.__enter__() for s in streams]  # one running, two waiting
            assert all(r.status_code == 200 for r in responses)
            r = client.post(f"{srv.url}/v1/completions", json={"prompt": "y", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "overloaded"
            # a single request that could never fit is a 400, not a 503
            r = client.post(f"{srv.url}/v1/completions", json={"prompt": "y", "max_tokens": 2, "n": 3})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n"
            for s in streams:
                s.__exit__(None, None, None)
        srv.wait_idle()
        assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "y", "max_tokens": 2}).status_code == 200
    finally:
        srv.stop()


def test_fuzz_no_server_errors():
    """Requests generated from the server's own OpenAPI schema (valid and invalid) never get a 5xx.
    Drives schemathesis directly with hypothesis (not through its pytest plugin)."""
    # short contexts keep every generated request cheap; n x prompts is capped by the queue bound
    srv = start_server(max_model_len=24, max_waiting_requests=32)
    try:
        schema = schemathesis.openapi.from_url(f"{srv.url}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
        for operation in operations:
            @given(case=operation.as_strategy())
            @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def call(case):
                case.call_and_validate(checks=[not_a_server_error], timeout=60)

            call()
    finally:
        srv.stop()


def test_failed_step_fails_its_requests_not_the_server():
    srv = start_server()
    try:
        runner = srv.engine.engine.runner
        real_launch = runner.launch

        def broken(*args, **kwargs):
            runner.launch = real_launch  # only the next step fails
            raise RuntimeError("injected fault")

        runner.launch = broken
        prompt = " ".join(f"x{i}" for i in range(40))  # full blocks: registered when the step was scheduled
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=30)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        srv.wait_idle()
        assert not srv.engine.engine.kv_cache.pool.cached  # their K/V was never written: not findable
        runner.launch = broken
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=30,
                          json={"prompt": "x", "max_tokens": 4, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert "injected fault" in json.loads(lines[-2][6:])["error"]["message"] and lines[-1] == "data: [DONE]"
        # the loop goes on
        ok = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 4, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert srv.wait_idle()["tokenmill:request_finished_total{finished_reason=error}"] == 2
        srv.engine.engine.kv_cache.check_integrity()
        assert srv.engine.engine.kv_cache.usage == 0.0
    finally:
        srv.stop()


def test_skip_tokenizer_init_server_takes_and_returns_token_ids(server, tmp_path):
    """A checkpoint without tokenizer files, served with --skip-tokenizer-init: token-id prompts
    give the token ids the normal server gives; text and chat are 400s naming their parameter."""
    import shutil

    from tokenmill.executor.loader import resolve_model_path

    for f in resolve_model_path(None).iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp_path / f.name)
    bare = start_server(model=str(tmp_path), skip_tokenizer_init=True)
    try:
        body = {"prompt": [[5, 6, 7], [40, 41]], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "logprobs": 1}
        normal = post(f"{server.url}/v1/completions", {**body, "return_token_ids": True}).json()
        r = post(f"{bare.url}/v1/completions", body)
        assert r.status_code == 200, r.text
        for ours, theirs in zip(r.json()["choices"], normal["choices"]):
            assert ours["token_ids"] == theirs["token_ids"] and len(ours["token_ids"]) == 6
            assert ours["text"] == "" and ours["logprobs"]["tokens"][0] == f"token_id:{ours['token_ids'][0]}"
        streamed = []
        with httpx.stream("POST", f"{bare.url}/v1/completions", json={**body, "stream": True}, timeout=30) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: "):])
                    streamed += [(c["index"], t) for c in chunk["choices"] for t in c.get("token_ids", [])]
        assert [t for i, t in streamed if i == 0] == r.json()["choices"][0]["token_ids"]
        for path, bad, param in (("/v1/completions", {"prompt": "hello"}, "prompt"),
                                 ("/v1/completions", {"prompt": [5], "stop": ["x"]}, "stop"),
                                 ("/v1/chat/completions", {"messages": CHAT}, "messages")):
            r = post(f"{bare.url}{path}", bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        bare.stop()
