"""The engine core: the Engine and what runs around each step, driven by a thread of the
server (AsyncEngine) or, for `tokenmill serve`, by a process of its own (run_engine_core).

    API process (EngineCoreClient)               engine-core process
    ------------------------------               -------------------
    adds / aborts of one loop turn  -- ZMQ -->   drain inbox -> add / abort
                                                 Engine.step()
    streams, metrics  <-- ZMQ, one message --    (outputs, stats, adds taken, time, error,
                          per step               prefix-cache events)

Messages are pickled lists. Each step's message carries the engine's stats, so the API
process's metrics and queue bound need nothing else from the core. Outputs travel without
their prompt's token ids, which the client puts back from the request it sent.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
from typing import Any

import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.engine.request import RequestOutput
from tokenmill.executor.distributed.workers import WorkerGroupError

logger = logging.getLogger("tokenmill")

IDLE_POLL_MS = 500  # an idle core checks this often that its API process is still there


class EngineCore:
    """Takes adds and aborts, runs steps; a failed step fails the requests in it, not the loop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.num_taken = 0  # adds taken from the inbox, so the client knows which are still in transit

    def handle(self, kind: str, payload: Any) -> RequestOutput | None:
        """An add or an abort; returns an output when it ends a request."""
        if kind == "add":
            request, prompt = payload
            self.num_taken += 1
            try:
                self.engine.add_request(request, prompt)
            except Exception as e:  # noqa: BLE001 - e.g. a duplicate id: fails that request only
                return self.engine.fail_request(request, f"{type(e).__name__}: {e}")
            return None
        if kind == "abort":
            return self.engine.abort_request(payload)
        raise ValueError(f"unknown engine-core message {kind!r}")

    def step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except WorkerGroupError:  # no step can run any more: the core ends, as if it had died
            raise
        except Exception as e:  # noqa: BLE001 - a failed step fails the requests in it, not the server
            logger.exception("engine step failed; failing the requests in flight")
            outputs = self.fail_in_flight(f"{type(e).__name__}: {e}")
            # the step's blocks were made findable when it was scheduled, and their K/V may never
            # have been written: nothing holds a block now, so forget every cached one
            self.engine.kv_cache.reset_prefix_cache()
            return outputs

    def fail_in_flight(self, message: str) -> list[RequestOutput]:
        # one per request as its caller knows it (not one per forked sequence), compiling or not
        return [self.engine.fail_request(r, message) for r in self.engine.unfinished_requests()]

    def fail_adds(self, messages: list[tuple[str, Any]], message: str) -> list[RequestOutput]:
        """Adds that will never run (the core is stopping) end with an error."""
        out = []
        for kind, payload in messages:
            if kind == "add":
                self.num_taken += 1
                out.append(self.engine.fail_request(payload[0], message))
        return out


def main() -> None:
    """`python -m tokenmill.engine.core_proc`, started by EngineCoreClient: its arguments come
    pickled on stdin (a plain subprocess, so nothing of the server's main module is re-run)."""
    args = pickle.loads(sys.stdin.buffer.read())
    run_engine_core(**args)


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, log_level: int,
                    check_integrity: bool = False, cpus: list[int] | None = None, kv_events: bool = False) -> None:
    """Builds the Engine, sends ("ready", (EngineLimits, the input socket's endpoint)) or
    ("error", message) as its first message, then steps until told to stop or its parent is
    gone. `input_addr`: where it binds its input socket (a TCP port of "*" takes a free one:
    the endpoint sent with "ready" says which); `cpus`: the cores it may run on (data
    parallel: each replica its own); `kv_events`: each step message carries the block hashes
    stored in and removed from the prefix cache since the last one."""
    if threading.current_thread() is threading.main_thread():  # not in a Ray actor's thread
        # Ctrl-C, or a SIGTERM to the whole process group (systemd), reaches the core too: the API
        # process stops it in order after its requests drained (or the core sees its parent gone)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if cpus:  # before torch starts its thread pool
        os.sched_setaffinity(0, cpus)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s (engine core): %(message)s")
    parent = os.getppid()
    ctx = zmq.Context(1)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)
    outbox.connect(output_addr)
    try:
        engine = Engine(config)
    except BaseException as e:  # noqa: BLE001 - reported to the API process, which raises it
        outbox.send(pickle.dumps(("error", f"{type(e).__name__}: {e}")))
        outbox.close(linger=2000)
        ctx.term()
        sys.exit(1)
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(input_addr)
    outbox.send(pickle.dumps(("ready", (engine.limits, inbox.getsockopt_string(zmq.LAST_ENDPOINT)))))
    pool = engine.kv_cache.pool
    if kv_events:
        pool.events = []
    core = EngineCore(engine)
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    error: str | None = None

    def send(outputs: list[RequestOutput], error: str | None = None) -> None:
        for out in outputs:  # the client has every prompt: half the bytes of a step's message
            out.prompt_token_ids = None  # type: ignore[assignment]
        message = (outputs, engine.stats(), core.num_taken, time.time(), error, pool.take_events())
        outbox.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), copy=False)

    try:
        while True:
            if not engine.has_unfinished_requests() and not poller.poll(IDLE_POLL_MS):
                if os.getppid() != parent:
                    break
                continue
            outputs: list[RequestOutput] = []
            stop = False
            while not stop:
                try:
                    messages = pickle.loads(inbox.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                for i, (kind, payload) in enumerate(messages):
                    if kind == "shutdown":
                        stop = True
                        outputs += core.fail_adds(messages[i + 1:], "the engine stopped")
                        break
                    out = core.handle(kind, payload)
                    if out is not None:
                        outputs.append(out)
            if stop:
                if outputs:
                    send(outputs)
                break
            if engine.has_unfinished_requests():
                outputs += core.step()
                if check_integrity:  # tests: the pool and the block tables agree after every step
                    engine.kv_cache.check_integrity()
            if outputs or pool.events:
                send(outputs)
            if os.getppid() != parent:
                break
    except BaseException as e:  # noqa: BLE001 - reported to the API process with the last outputs
        logger.exception("engine core died")
        error = f"{type(e).__name__}: {e}"
    finally:
        try:
            send(core.fail_in_flight("the engine stopped" if error is None else f"engine error: {error}"), error)
        except Exception:  # noqa: BLE001 - the API process fails its streams itself when the core exits
            logger.exception("engine core could not send its last outputs")
        outbox.close(linger=2000)
        inbox.close(linger=0)
        ctx.term()
        engine.shutdown()


if __name__ == "__main__":
    main()
