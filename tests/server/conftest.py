"""A real tokenmill server on a free loopback port, in a thread of the test process, serving
the built-in model. Its engine runs on a thread (tests can check its KV cache) or, with
engine_process=True, in a process of its own as under `tokenmill serve` (checking the KV
cache's integrity after every step)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import pytest
import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine, EngineClient
from tokenmill.engine.core_client import EngineCoreClient
from tokenmill.engine.dp_client import DataParallelClient
from tokenmill.router.summary import PrefixCacheLog
from tokenmill.server.api import build_app
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.tenancy import make_tenancy

MODEL_NAME = "tiny"


def launch_serve(log_path: Path, *flags: str, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """`tokenmill serve FLAGS` on `port` (default: a free one) as a process of its own, logging
    to `log_path`; returns it and its URL once /health answers."""
    port = port or free_port()
    with open(log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), *flags],
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.time() < deadline, log_path.read_text()
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    url: str
    engine: EngineClient
    server: uvicorn.Server
    thread: threading.Thread
    prefix_cache: PrefixCacheLog

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
                    and self.idle()):
                return self.metrics()
            time.sleep(0.05)
        raise TimeoutError("the engine did not go idle")

    def idle(self) -> bool:
        if isinstance(self.engine, AsyncEngine):
            return not self.engine.engine.has_unfinished_requests()
        stats = self.engine.stats  # as of the cores' last steps
        return self.engine.num_waiting == 0 and stats.get("num_running", 0) == 0

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(api_key: str | None = None, max_waiting_requests: int = 1024, tenancy: dict | None = None,
                 access_log: bool = False, engine_process: bool = False, restart_engine: bool = False,
                 data_parallel_size: int = 1, ray: bool = False, **engine_args) -> RunningServer:
    """`tenancy`: make_tenancy's arguments (tenants_file, admin_key, limits_db, limits_store, ...);
    `ray`: the data-parallel replicas are actors of the Ray cluster this process is connected to."""
    # float32: a CPU with bfloat16 would pick it, and tests compare with float32 references
    engine_args = {"max_model_len": 256, "kv_cache_memory": "16MiB", "max_num_seqs": 64, "dtype": "float32",
                   **engine_args}
    metrics = ServerMetrics(MODEL_NAME)
    tenants = None if tenancy is None else make_tenancy(metrics, **tenancy)
    config = EngineConfig(**engine_args)
    prefix_cache = PrefixCacheLog(config.block_size, config.enable_prefix_caching)  # as `tokenmill serve` keeps it
    if data_parallel_size > 1:
        engine: EngineClient = DataParallelClient(config, data_parallel_size, max_waiting_requests, observer=metrics,
                                                  restart=restart_engine, check_integrity=True,
                                                  on_kv_events=prefix_cache.apply, ray=ray)
    elif engine_process:
        engine = EngineCoreClient(config, max_waiting_requests=max_waiting_requests, observer=metrics,
                                  restart=restart_engine, check_integrity=True,
                                  on_kv_events=lambda events: prefix_cache.apply(0, events))
    else:
        engine = AsyncEngine(config, max_waiting_requests=max_waiting_requests, observer=metrics,
                             on_kv_events=lambda events: prefix_cache.apply(0, events))
    app = build_app(engine, [MODEL_NAME], metrics, api_key=api_key, tenancy=tenants, access_log=access_log,
                    prefix_cache=prefix_cache)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", engine, server, thread, prefix_cache)


@pytest.fixture(scope="module")
def server():
    srv = start_server()
    yield srv
    srv.stop()
