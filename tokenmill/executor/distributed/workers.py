"""The tensor-parallel worker processes: rank 0 is the engine's own model runner (the driver);
ranks 1..N-1 are `python -m tokenmill.executor.distributed.worker_proc` processes.

    driver                                   worker r
    spawn, arguments pickled on stdin  --->  cores and threads; joins the TCPStore
    torch.distributed group (gloo on the CPU, NCCL on CUDA), rendezvous through the store
    ModelRunner(rank 0)                      ModelRunner(rank r): load its part, size the KV
                                             cache (the ranks agree on the smallest)
    each step: StepInput on stdin      --->  the same forward and logits calls, in step
    shutdown: None, or stdin closes    --->  exits

A worker never sees a Request: a step reaches it as a few numpy arrays (StepInput). The
forward's collectives keep the ranks in step; a worker that dies makes the driver's next
collective fail, and a driver that dies closes the workers' stdin, so nothing waits forever.
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tokenmill.executor.distributed.parallel import TensorParallel, split_cpus
from tokenmill.executor.huge_pages import huge_page_env

logger = logging.getLogger("tokenmill")

JOIN_TIMEOUT_S = 120.0  # for every worker to start and reach the store
COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # a collective waits this long for a rank (loading included)


class WorkerGroupError(RuntimeError):
    """A tensor-parallel worker died or a collective failed: the engine cannot step any more."""


class TensorParallelWorkers:
    """The driver's side: starts ranks 1..N-1, joins the group as rank 0, sends them each step."""

    def __init__(self, size: int, device: torch.device, num_threads: int | None, runner_args: dict[str, Any]) -> None:
        self.size = size
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size > 1: this process already runs a tensor-parallel engine "
                             "(one per process); shut it down first (LLM.shutdown())")
        cpus = split_cpus(size, num_threads, "tensor_parallel_size") if device.type == "cpu" else [None] * size
        self.driver_cpus = cpus[0]
        backend = "nccl" if device.type == "cuda" else "gloo"
        # port 0: the store binds a free one itself (no window for another process to take it)
        self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                   timeout=COLLECTIVE_TIMEOUT)
        port = self.store.port
        self.procs: list[subprocess.Popen] = []
        # an engine dropped without shutdown() still stops its workers and leaves the group
        self._finalizer = weakref.finalize(self, _end, self.procs)
        for rank in range(1, size):
            proc = subprocess.Popen([sys.executable, "-m", "tokenmill.executor.distributed.worker_proc"],
                                    stdin=subprocess.PIPE, env=huge_page_env())
            pickle.dump(dict(rank=rank, size=size, port=port, backend=backend, cpus=cpus[rank],
                             log_level=logging.getLogger("tokenmill").getEffectiveLevel(),
                             runner_args=runner_args), proc.stdin)
            proc.stdin.flush()
            self.procs.append(proc)
        try:
            self._wait_joined()
            dist.init_process_group(backend, store=self.store, rank=0, world_size=size, timeout=COLLECTIVE_TIMEOUT)
        except BaseException:
            self.kill()
            raise
        self.tp = TensorParallel(0, size, device)

    def _wait_joined(self) -> None:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        keys = [f"joined{r}" for r in range(1, self.size)]
        while not self.store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                raise WorkerGroupError(f"tensor-parallel workers did not start within {JOIN_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def check_alive(self) -> None:
        """Raises WorkerGroupError if a worker has exited, with the error it left in the store."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                key = f"error{rank}"
                why = self.store.get(key).decode() if self.store.check([key]) else f"exit code {proc.returncode}"
                raise WorkerGroupError(f"tensor-parallel worker {rank} failed: {why}")

    def fail(self, error: BaseException) -> WorkerGroupError:
        """A collective failed: the worker's own error when one left it (their deaths come first)."""
        time.sleep(0.2)  # a dying worker's exit reaches the driver just after its closed sockets do
        try:
            self.check_alive()
        except WorkerGroupError as e:
            return e
        return WorkerGroupError(f"tensor-parallel group failed: {error}")

    def send(self, step: Any) -> None:
        """One step's input (or None: stop) to every worker."""
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        for proc in self.procs:
            try:
                proc.stdin.write(data)
                proc.stdin.flush()
            except (BrokenPipeError, ValueError) as e:
                self.check_alive()
                raise WorkerGroupError(f"tensor-parallel worker unreachable: {e}") from e

    def stop(self, timeout: float = 10.0) -> None:
        if not self.procs:
            return
        try:
            self.send(None)
        except (OSError, ValueError, RuntimeError):
            pass
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.kill()

    def kill(self) -> None:
        self._finalizer()


def _end(procs: list[subprocess.Popen]) -> None:
    """Kills the workers that are left and leaves the process group (once; also when the
    driver's TensorParallelWorkers is garbage-collected)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
    procs.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
