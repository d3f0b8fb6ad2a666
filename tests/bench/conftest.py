"""The known-timing server (known_server.py) in a subprocess, and `run_bench`, for the bench tests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.server.conftest import free_port
from tokenmill.cli import main
from tokenmill.config import DEFAULT_MODEL_DIR


@pytest.fixture(scope="session")
def known_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("known_server.py")), str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            httpx.get(f"{url}/v1/models", timeout=1)
            break
        except httpx.TransportError:
            assert time.time() < deadline
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait()


def run_bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "result.json"
    assert main(["bench", "serve", "--tokenizer", str(DEFAULT_MODEL_DIR), "--no-progress", "--output-json", str(out),
                 *args]) == 0
    return json.loads(out.read_text())
