"""Engine cores as Ray actors (`--distributed-executor-backend ray`): the data-parallel
replicas, or the one engine core, placed by Ray on any machine of a cluster.

    API process                                   Ray actor (any node)
    -----------                                   --------------------
    binds its output socket on its node's IP      run_engine_core(): binds its input socket on
    RayCoreProcess(args)  -- actor.run(args) -->  its node's IP, any port; sends ("ready",
    connects the input socket it was told   <--   (limits, that endpoint)); then steps
    poll(): has run() ended (died, killed)?

The actor stands where core_client.py otherwise starts a subprocess (RayCoreProcess has the
part of subprocess.Popen's interface that it uses), so everything else is the same: the ZMQ
messages, the death watch, restarts, the router. The sockets carry pickles: the ports must
be reachable only from the cluster's trusted network, as with vLLM's multi-node setups.
Tensor parallelism inside a Ray actor is not supported yet (a start-up error): its workers'
core pinning and rendezvous assume a machine of their own.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'tokenmill[ray]'") from e
    return ray


def connect_ray(address: str | None):
    """Joins the cluster at `address` ("auto": the one this machine is part of), or starts a
    local one when None; a process already connected keeps its connection."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    return ray


def cpus_per_core(num_threads: int | None, num_cores: int, flag: str) -> int:
    """The CPUs each of `num_cores` engine cores reserves: its share of `num_threads`, or of
    the cluster's CPUs (at most a node's worth); ValueError naming the flag when a share is
    zero or, asked for with --num-threads, fits on no node."""
    ray = import_ray()
    nodes = [int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]
    largest = max(nodes, default=0)
    share = (num_threads or sum(nodes)) // num_cores
    if share < 1:
        raise ValueError(f"{flag} {num_cores} exceeds the {num_threads or sum(nodes)} CPUs of the Ray cluster "
                         f"(or --num-threads) to split between engine cores")
    if share > largest:
        if num_threads:
            raise ValueError(f"--num-threads {num_threads} gives each engine core {share} CPUs, more than any Ray "
                             f"node has ({largest})")
        share = largest
    return share


class EngineCoreActor:
    """One engine core in a Ray worker process; run() returns when the core stops."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, args: dict[str, Any]) -> None:
        import ray

        from tokenmill.engine.core_proc import run_engine_core
        run_engine_core(**{**args, "input_addr": f"tcp://{ray.util.get_node_ip_address()}:*"})


class RayCoreProcess:
    """An engine core running in an EngineCoreActor, seen as a process: poll, kill, wait."""

    def __init__(self, args: dict[str, Any], num_cpus: int, start_timeout: float) -> None:
        from tokenmill.executor.huge_pages import huge_page_env
        ray = import_ray()
        self._ray = ray
        actor_cls = ray.remote(EngineCoreActor)
        # a GPU each when the engine runs on CUDA (Ray hides the devices an actor did not ask for)
        num_gpus = 1 if args["config"].device == "cuda" or (args["config"].device == "auto"
                                                            and _cuda_available()) else 0
        # glibc's huge-page malloc tunable as for a core started as a subprocess (Ray starts a
        # worker process for an actor with its own env_vars, so glibc reads it at start-up)
        tunables = huge_page_env().get("GLIBC_TUNABLES")
        runtime_env = {"env_vars": {"GLIBC_TUNABLES": tunables}} if tunables else None
        # two threads: run() keeps one, pid() and the like answer on the other
        self.actor = actor_cls.options(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=2,
                                       runtime_env=runtime_env).remote()
        self.pid: int = ray.get(self.actor.pid.remote(), timeout=start_timeout)
        self._run = self.actor.run.remote(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, _ = self._ray.wait([self._run], timeout=0)
            if done:
                try:
                    self._ray.get(self._run)
                    self.returncode = 0
                except self._ray.exceptions.RayActorError:  # killed, or its node or process died
                    self.returncode = -9
                    self.kill()  # one only unreachable for now is ended too: it is gone for us
                except Exception:  # noqa: BLE001 - the core raised (it reported why on its socket)
                    self.returncode = 1
        return self.returncode

    def kill(self) -> None:
        self._ray.kill(self.actor, no_restart=True)

    def wait(self, timeout: float | None = None) -> int:
        self._ray.wait([self._run], timeout=timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired("ray actor", timeout or 0)
        return self.returncode
