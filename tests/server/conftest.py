"""A real tokenmill server on a free loopback port, in a thread of the test process
(so tests can also check the engine's KV cache), serving the built-in model."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx2 as httpx
import pytest
import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.api import build_app
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.tenancy import make_tenancy

MODEL_NAME = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    url: str
    engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics (parsed by prometheus_client), keyed `name{label=value,...}`."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Waits until the engine has no requests; returns the metrics then."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = self.metrics()
            if (m["tokenmill:num_requests_running"] == 0 and m["tokenmill:num_requests_waiting"] == 0
                    and not self.engine.engine.has_unfinished_requests()):
                return self.metrics()
            time.sleep(0.05)
        raise TimeoutError("the engine did not go idle")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(api_key: str | None = None, max_waiting_requests: int = 1024, tenancy: dict | None = None,
                 access_log: bool = False, **engine_args) -> RunningServer:
    """`tenancy`: make_tenancy's arguments (tenants_file, admin_key, limits_db, limits_store, ...)."""
    # float32: a CPU with bfloat16 would pick it, and tests compare with float32 references
    engine_args = {"max_model_len": 256, "kv_cache_memory": "16MiB", "max_num_seqs": 64, "dtype": "float32",
                   **engine_args}
    metrics = ServerMetrics(MODEL_NAME)
    tenants = None if tenancy is None else make_tenancy(metrics, **tenancy)
    engine = AsyncEngine(EngineConfig(**engine_args), max_waiting_requests=max_waiting_requests, observer=metrics)
    app = build_app(engine, [MODEL_NAME], metrics, api_key=api_key, tenancy=tenants, access_log=access_log)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", engine, server, thread)


@pytest.fixture(scope="module")
def server():
    srv = start_server()
    yield srv
    srv.stop()
