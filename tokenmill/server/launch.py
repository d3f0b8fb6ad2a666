"""`tokenmill serve`: load the engine, then run the app under uvicorn until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import signal
from types import FrameType
from typing import Any

import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine, EngineClient
from tokenmill.engine.core_client import EngineCoreClient
from tokenmill.engine.dp_client import DataParallelClient
from tokenmill.engine.ray_core import connect_ray, cpus_per_core
from tokenmill.router.summary import PrefixCacheLog
from tokenmill.server.api import build_app
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.tenancy import Tenancy, make_tenancy

logger = logging.getLogger("tokenmill.server")


class GracefulServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM is a graceful stop that exits 0 (`serve` and `router`)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn re-raises the signal once it has shut down, so the process dies of it; a
        # graceful stop asked for with SIGTERM should exit 0 instead. A second SIGINT forces.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          api_key: str | None = None, max_waiting_requests: int = 1024, shutdown_timeout: float = 30.0,
          log_level: str = "info", access_log: bool = True, tenancy: dict[str, Any] | None = None,
          engine_process: bool = True, restart_engine: bool = False, data_parallel_size: int = 1,
          data_parallel_routing: str = "prefix", distributed_executor_backend: str = "mp",
          ray_address: str | None = None) -> int:
    """Serves until stopped. SIGTERM: stop accepting, let in-flight requests finish (at most
    `shutdown_timeout` seconds), exit 0. `tenancy`: make_tenancy's arguments (tenants, keys,
    limits store), checked before the model loads. `engine_process`: the engine core runs in a
    process of its own (else on a thread of this one); `restart_engine`: one that dies is
    replaced. `data_parallel_size` > 1: that many engine cores behind one front, each request
    routed by `data_parallel_routing` (prefix: to the replica holding its longest cached prefix).
    `distributed_executor_backend` "ray": the engine cores are Ray actors on the cluster at
    `ray_address` (None: a local one), else ("mp") processes of this machine."""
    name = served_model_name or config.model or "tokenmill-default"
    metrics = ServerMetrics(name)
    tenants = make_tenancy(metrics, **(tenancy or {"api_key": api_key}))
    if tenants.limits is not None:
        _log_tenants(tenants, config)
    if data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {data_parallel_size}")
    if data_parallel_size > 1 and not engine_process:
        raise ValueError("--data-parallel-size runs engine cores in processes of their own: drop --engine-in-thread")
    if distributed_executor_backend not in ("mp", "ray"):
        raise ValueError(f"--distributed-executor-backend must be mp or ray, got {distributed_executor_backend!r}")
    ray = distributed_executor_backend == "ray"
    if ray and not engine_process:
        raise ValueError("--distributed-executor-backend ray places engine cores as Ray actors: drop "
                         "--engine-in-thread")
    if ray_address is not None and not ray:
        raise ValueError("--ray-address is for --distributed-executor-backend ray")
    if ray:
        if config.tensor_parallel_size > 1:
            raise ValueError("--distributed-executor-backend ray with --tensor-parallel-size > 1 is not supported "
                             "yet (Ray places engine cores; their tensor-parallel workers need a machine of their own)")
        connect_ray(ray_address)
    # what the prefix cache holds, for a router in front of several servers (GET /v1/prefix_cache)
    prefix_cache = PrefixCacheLog(config.block_size, config.enable_prefix_caching)
    if data_parallel_size > 1:
        engine: EngineClient = DataParallelClient(config, data_parallel_size, max_waiting_requests, observer=metrics,
                                                  restart=restart_engine, routing=data_parallel_routing,
                                                  on_kv_events=prefix_cache.apply, ray=ray)
    elif engine_process:
        engine = EngineCoreClient(config, max_waiting_requests=max_waiting_requests, observer=metrics,
                                  restart=restart_engine, on_kv_events=lambda events: prefix_cache.apply(0, events),
                                  ray_cpus=cpus_per_core(config.num_threads, 1, "--num-threads") if ray else None)
    else:
        engine = AsyncEngine(config, max_waiting_requests=max_waiting_requests, observer=metrics,
                             on_kv_events=lambda events: prefix_cache.apply(0, events))
    app = build_app(engine, [name], metrics, tenancy=tenants, access_log=access_log, prefix_cache=prefix_cache)
    # our access log names the tenant; uvicorn's would only repeat it without
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                               timeout_graceful_shutdown=shutdown_timeout, timeout_keep_alive=30)
    server = GracefulServer(uv_config)
    logger.info("serving %s on http://%s:%d (OpenAI API under /v1)", name, host, port)
    server.run()
    return 0 if server.started else 1


def _log_tenants(tenancy: Tenancy, config: EngineConfig) -> None:
    assert tenancy.limits is not None
    tenants = tenancy.limits.tenants.tenants
    logger.info("%d tenants (%s); limits store: %s; scheduling policy: %s", len(tenants),
                ", ".join(t.name for t in tenants), type(tenancy.limits.store).__name__, config.scheduling_policy)
    if config.scheduling_policy == "fcfs" and len({(t.priority, t.weight) for t in tenants}) > 1:
        logger.warning("tenants have priorities or weights, which --scheduling-policy fcfs ignores: use "
                       "priority (lanes) or fair (weighted fair shares within lanes)")
