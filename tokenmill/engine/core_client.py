"""EngineCoreClient: the server's side of an engine core that runs in a process of its own
(core_proc.py), so the HTTP loop and the engine no longer share a GIL (vLLM V1's layout).

    event loop                      output thread                  engine-core process
    ----------                      -------------                  -------------------
    make_request (validate, tokenize: InputProcessor, here)
    generate(): add  -- one ZMQ message per loop turn ---------->  steps
    streams, metrics <- call_soon_threadsafe <- recv, unpickle <-  one message per step
                                    process sentinel: the core died
                                      -> open streams fail, 503s, /health fails;
                                         restart=True starts a new core

Each core gets fresh ZMQ addresses, so nothing meant for a dead core reaches the next one.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from collections.abc import Callable
from typing import Any

import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import EngineClient, StepObserver
from tokenmill.engine.detokenizer import load_tokenizer
from tokenmill.engine.grammar import Grammars
from tokenmill.engine.input_processor import EngineLimits, InputProcessor
from tokenmill.engine.outputs import failed_output
from tokenmill.engine.ray_core import RayCoreProcess, import_ray
from tokenmill.engine.request import Request, RequestOutput
from tokenmill.executor.huge_pages import huge_page_env
from tokenmill.executor.loader import resolve_model_path

logger = logging.getLogger("tokenmill")

DEATH_POLL_MS = 100  # how soon a dead engine core is noticed (503s, /health) at the latest
STOP_GRACE_S = 10.0  # a core told to stop that has not exited by then is killed
# what the metrics see of a core that never reported a step
ZERO_STATS = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "prefix_cache_hit_rate": 0.0,
              "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0}


class EngineCoreError(RuntimeError):
    """The engine core could not be started."""


class _Core:
    """One engine-core process and the sockets to it. The output socket belongs to the output
    thread, the input socket to the event loop (zmq sockets are not thread-safe). `ray_cpus`:
    the core runs as a Ray actor (ray_core.py) that reserves this many CPUs, over TCP on the
    nodes' addresses; None: a subprocess of this one, over Unix sockets."""

    def __init__(self, config: EngineConfig, ctx: zmq.Context, directory: str, generation: int,
                 check_integrity: bool, ready_timeout: float, cpus: list[int] | None, kv_events: bool,
                 ray_cpus: int | None = None) -> None:
        self.ready_timeout = ready_timeout
        self.limits: EngineLimits | None = None
        self.process: subprocess.Popen | RayCoreProcess | None = None
        self.outputs = ctx.socket(zmq.PULL)
        self.inputs = ctx.socket(zmq.PUSH)  # connected once the core says where it listens
        try:
            if ray_cpus is None:
                input_addr = f"ipc://{directory}/in-{generation}"
                output_addr = f"ipc://{directory}/out-{generation}"
                self.outputs.bind(output_addr)
            else:
                input_addr = ""  # the actor binds on its node
                ip = import_ray().util.get_node_ip_address()
                output_addr = f"tcp://{ip}:{self.outputs.bind_to_random_port(f'tcp://{ip}')}"
            self.inputs.setsockopt(zmq.SNDHWM, 0)
            self.inputs.setsockopt(zmq.LINGER, 0)
            args = dict(config=config, input_addr=input_addr, output_addr=output_addr,
                        check_integrity=check_integrity, cpus=cpus, kv_events=kv_events,
                        log_level=logging.getLogger("tokenmill").getEffectiveLevel())
            if ray_cpus is not None:
                self.process = RayCoreProcess(args, ray_cpus, ready_timeout)
            else:
                # a plain subprocess (not multiprocessing's spawn, which re-runs the caller's main module)
                self.process = subprocess.Popen([sys.executable, "-m", "tokenmill.engine.core_proc"],
                                                stdin=subprocess.PIPE, env=huge_page_env())
                assert self.process.stdin is not None
                self.process.stdin.write(pickle.dumps(args))
                self.process.stdin.close()
        except BaseException:
            self.kill()
            self.close()
            raise

    def wait_ready(self, stopping: Callable[[], bool] = lambda: False) -> EngineLimits:
        """Waits for the engine to be built; raises EngineCoreError (killing the process) if it
        fails, exits, takes too long or `stopping()` turns true."""
        try:
            return self._wait_ready(self.ready_timeout, stopping)
        except BaseException:
            self.kill()
            self.close()
            raise

    def _wait_ready(self, timeout: float, stopping: Callable[[], bool]) -> EngineLimits:
        deadline = time.monotonic() + timeout
        while not self.outputs.poll(100):
            if not self.is_alive():
                raise EngineCoreError(f"the engine core exited with code {self.returncode} while starting")
            if time.monotonic() > deadline:
                raise EngineCoreError(f"the engine core was not ready after {timeout:g} s")
            if stopping():
                raise EngineCoreError("the server stopped while the engine core was starting")
        kind, payload = pickle.loads(self.outputs.recv())
        if kind == "error":
            raise EngineCoreError(payload)
        self.limits, input_endpoint = payload
        self.inputs.connect(input_endpoint)
        return self.limits

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.returncode

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        if self.process is None:
            return
        if self.is_alive():
            self.process.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:  # a Ray actor's end is asynchronous; it is on its way
            logger.warning("engine core %s had not ended 5 s after it was killed", self.process.pid)

    def close(self) -> None:
        self.inputs.close(linger=0)
        self.outputs.close(linger=0)


_LOAD = object()  # EngineCoreClient's tokenizer: load the checkpoint's


class EngineCoreClient(EngineClient):
    """The engine in its own process. `restart`: a core that dies is replaced by a new one
    (the requests it held fail); without it the server answers 503 from then on. `tokenizer`:
    one already loaded (data parallel: one for all replicas). `ray_cpus`: the core is a Ray
    actor reserving that many CPUs on a node Ray chooses (connect to the cluster first:
    ray_core.connect_ray); None: a subprocess of this process."""

    def __init__(self, config: EngineConfig, max_waiting_requests: int = 1024,
                 observer: StepObserver | None = None, restart: bool = False, check_integrity: bool = False,
                 ready_timeout: float = 900.0, cpus: list[int] | None = None,
                 on_kv_events: Callable[[list[tuple[bool, bytes]] | None], None] | None = None,
                 tokenizer: Any = _LOAD, ray_cpus: int | None = None) -> None:
        super().__init__(max_waiting_requests, observer)
        self.cpus = cpus
        self.ray_cpus = ray_cpus
        # on the event loop: each step's (stored?, block hash) events; None when the core died,
        # taking everything it held with it
        self.on_kv_events = on_kv_events
        self.config = config
        self.restart = restart
        self.check_integrity = check_integrity
        self.ready_timeout = ready_timeout
        self.num_restarts = 0
        self.error: str | None = None  # why the last core ended, if it did not stop when told
        model_path = resolve_model_path(config.model)  # once (a hub id downloads here), for both processes
        if config.model is not None:
            config = self.config = replace(config, model=str(model_path))
        self._ctx = zmq.Context(1)
        self._dir = tempfile.mkdtemp(prefix="tokenmill-core-")
        self._generation = 0
        # the requests sent to the core and not finished: their prompts, and what fails if it dies
        self._requests: dict[str, Request] = {}
        self._pending: list[tuple[str, Any]] = []  # adds and aborts of this loop turn, sent as one message
        self._num_adds = 0  # adds sent to the current core
        self._num_taken = 0  # ... of which it had taken as of its last message
        self._stats: dict[str, Any] = {}
        self._stopping = False
        self._alive = False
        self._core: _Core | None = None
        self._stop_time = 0.0
        try:
            core = _Core(config, self._ctx, self._dir, self._next_generation(), check_integrity, ready_timeout, cpus,
                         on_kv_events is not None, ray_cpus)
            self._core = core
            if tokenizer is _LOAD:  # while the core loads the model
                tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or model_path)
            self.tokenizer = tokenizer
            limits = core.wait_ready()
        except BaseException:
            self.close()
            raise
        self.limits = limits
        self.max_model_len = limits.max_model_len
        self.processor = InputProcessor(self.tokenizer, limits)
        # compiled here ahead of queueing (a bad grammar is a 400); the core compiles its own copy
        self.grammars = Grammars(self.tokenizer, limits.vocab_size, limits.eos_token_ids) \
            if self.tokenizer is not None else None
        self._watcher: threading.Thread | None = None

    # -- life cycle -------------------------------------------------------------
    def _next_generation(self) -> int:
        self._generation += 1
        return self._generation

    def _launch(self) -> _Core:
        core = _Core(self.config, self._ctx, self._dir, self._next_generation(), self.check_integrity,
                     self.ready_timeout, self.cpus, self.on_kv_events is not None, self.ray_cpus)
        core.wait_ready(stopping=lambda: self._stopping)
        return core

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._alive = True
        self._watcher = threading.Thread(target=self._watch, args=(self._core,), name="tokenmill-core-outputs",
                                         daemon=True)
        self._watcher.start()

    async def stop(self) -> None:
        """Tells the core to stop (it fails what it holds) and waits for it; the output thread
        kills it after STOP_GRACE_S."""
        self._stopping = True
        self._stop_time = time.monotonic()
        self._pending.append(("shutdown", None))
        self._flush()
        if self._watcher is not None:
            await asyncio.to_thread(self._watcher.join)
        self._fail_streams("the engine stopped")
        self.close()

    def close(self) -> None:
        """Ends the core (if any), closes every socket and removes the sockets' directory: after
        stop(), or for a client that was never started."""
        if self._core is not None:
            self._core.kill()
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def is_running(self) -> bool:
        return self._alive and not self._stopping

    @property
    def pid(self) -> int | None:
        """The engine core's process id (tests kill it)."""
        return self._core.process.pid if self._core is not None else None

    @property
    def num_waiting(self) -> int:
        return int(self._stats.get("num_waiting", 0)) + max(0, self._num_adds - self._num_taken)

    @property
    def stats(self) -> dict[str, Any]:
        """The engine's stats as of its last step message (kv_cache_usage, num_running, ...)."""
        return self._stats

    # -- requests ---------------------------------------------------------------
    def _add(self, request: Request, prompt: str | None) -> None:
        self._requests[request.request_id] = request
        self._num_adds += 1
        self._send("add", (request, prompt))

    def _abort(self, request_id: str) -> None:
        # the request stays in _requests until its final output (abort) comes back
        if self._alive:
            self._send("abort", request_id)

    def _send(self, kind: str, payload: Any) -> None:
        if not self._pending:
            assert self._loop is not None
            self._loop.call_soon(self._flush)
        self._pending.append((kind, payload))

    def _flush(self) -> None:
        messages, self._pending = self._pending, []
        if messages and self._alive and self._core is not None:
            self._core.inputs.send(pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL), copy=False)

    # -- outputs (output thread) --------------------------------------------------
    def _watch(self, core: _Core) -> None:
        """Receives the core's step messages; when its process ends, or it sends the error it
        ends with (its exit can take seconds on a loaded machine), reports that and, with
        `restart`, starts the next core once the last has exited. Once the client stops, it waits STOP_GRACE_S for the
        core to exit and kills it then; a core it started meanwhile it kills at once."""
        while True:
            error: str | None = None
            while core.is_alive():
                if core.outputs.poll(DEATH_POLL_MS):
                    error = self._receive(core) or error
                    if error is not None:  # its last message: it is ending, however long its exit takes
                        break
                if self._stopping and time.monotonic() - self._stop_time > STOP_GRACE_S:
                    core.kill()
            while core.outputs.poll(100):  # what it sent before it ended is read first
                error = self._receive(core) or error
            core.outputs.close(linger=0)
            if self._stopping:
                return
            reason = error or f"the engine core exited with code {core.returncode}"
            logger.error("engine core died (%s)%s", reason, "; starting a new one" if self.restart else "")
            self._call(self._core_died, core, reason)
            if not self.restart:
                return
            deadline = time.monotonic() + STOP_GRACE_S  # the failed core's exit, before the next starts
            while core.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            core.kill()
            try:
                core = self._launch()
            except Exception as e:  # noqa: BLE001 - the server stays up, answering 503
                if not self._stopping:
                    logger.error("could not restart the engine core: %s", e)
                return
            if self._stopping:
                core.kill()
                core.outputs.close(linger=0)
                return
            self._call(self._core_started, core)

    def _receive(self, core: _Core) -> str | None:
        """Reads every message waiting; returns the error the core reported, if any."""
        error = None
        while True:
            try:
                data = core.outputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return error
            outputs, stats, num_taken, now, error, kv_events = pickle.loads(data)
            self._call(self._on_step, outputs, stats, num_taken, now, kv_events)

    def _call(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # -- on the event loop ------------------------------------------------------------
    def _on_step(self, outputs: list[RequestOutput], stats: dict[str, Any], num_taken: int, now: float,
                 kv_events: list[tuple[bool, bytes]]) -> None:
        self._stats, self._num_taken = stats, num_taken
        if kv_events:
            self._kv_events(kv_events)
        requests = self._requests
        for out in outputs:
            request = requests.pop(out.request_id, None) if out.finished else requests.get(out.request_id)
            out.prompt_token_ids = request.prompt_token_ids if request is not None else []
        self._dispatch(outputs, stats, now)

    def _kv_events(self, events: list[tuple[bool, bytes]] | None) -> None:
        if self.on_kv_events is not None:
            try:
                self.on_kv_events(events)
            except Exception:  # noqa: BLE001 - a router's mirror never stops the outputs
                logger.exception("prefix-cache event listener failed")

    def _core_died(self, core: _Core, reason: str) -> None:
        self._alive = False
        self.error = reason
        core.inputs.close(linger=0)  # the event loop's socket, closed on the event loop
        self._kv_events(None)
        self._pending.clear()
        self._fail_streams(f"engine error: {reason}")
        self._stats, self._num_adds, self._num_taken = {}, 0, 0

    def _core_started(self, core: _Core) -> None:
        if self._stopping:  # the output thread kills it
            return
        self._core = core
        self.num_restarts += 1
        self._alive = True
        logger.info("engine core restarted (pid %d)", core.process.pid)

    def _fail_streams(self, message: str) -> None:
        """Every open stream gets a final error output: nothing waits on a core that is gone.
        The metrics count them, and see the engine that held them hold nothing any more."""
        failed = [failed_output(request, message) for request in self._requests.values()]
        self._requests.clear()
        stats = {**ZERO_STATS, **self._stats, "num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
        self._dispatch(failed, stats, time.time())
