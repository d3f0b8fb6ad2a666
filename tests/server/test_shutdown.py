"""`tokenmill serve` as a process: SIGTERM lets in-flight streams finish, then exits 0."""

from __future__ import annotations

import json
import signal
import threading

import httpx2 as httpx

from tests.server.conftest import launch_serve


def test_sigterm_during_streaming_is_graceful(tmp_path):
    proc, url = launch_serve(tmp_path / "server.log", "--max-model-len", "512", "--kv-cache-memory", "16MiB",
                             "--served-model-name", "m", "--shutdown-timeout", "60", "--disable-access-log")
    try:
        results: dict[int, tuple[int, bool]] = {}
        started = threading.Barrier(5)

        def stream(i: int) -> None:
            body = {"model": "m", "prompt": f"x = {i}", "max_tokens": 400, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            tokens, done = 0, False
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for n, line in enumerate(r.iter_lines()):
                    if n == 2:
                        started.wait()
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: ") and json.loads(line[6:]).get("usage"):
                        tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            results[i] = (tokens, done)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        started.wait()  # every stream is under way
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=120)
        assert results == {i: (400, True) for i in range(4)}
        assert proc.wait(timeout=60) == 0, (tmp_path / "server.log").read_text()
        try:  # and it no longer accepts connections
            httpx.get(f"{url}/health", timeout=2)
            raise AssertionError("the server still answers after SIGTERM")
        except httpx.TransportError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
