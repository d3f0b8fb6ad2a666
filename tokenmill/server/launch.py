"""`tokenmill serve`: load the engine, then run the app under uvicorn until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.api import build_app
from tokenmill.server.metrics import ServerMetrics

logger = logging.getLogger("tokenmill.server")


class _Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn re-raises the signal once it has shut down, so the process dies of it; a
        # graceful stop asked for with SIGTERM should exit 0 instead. A second SIGINT forces.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          api_key: str | None = None, max_waiting_requests: int = 1024, shutdown_timeout: float = 30.0,
          log_level: str = "info", access_log: bool = True) -> int:
    """Serves until stopped. SIGTERM: stop accepting, let in-flight requests finish (at most
    `shutdown_timeout` seconds), exit 0."""
    name = served_model_name or config.model or "tokenmill-default"
    metrics = ServerMetrics(name)
    engine = AsyncEngine(config, max_waiting_requests=max_waiting_requests, observer=metrics)
    app = build_app(engine, [name], metrics, api_key=api_key)
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                               timeout_graceful_shutdown=shutdown_timeout, timeout_keep_alive=30)
    server = _Server(uv_config)
    logger.info("serving %s on http://%s:%d (OpenAI API under /v1)", name, host, port)
    server.run()
    return 0 if server.started else 1
