"""EngineClient: what the server talks to, one asyncio stream per request; AsyncEngine: the
engine loop on a thread of this process (EngineCoreClient, core_client.py: in its own process).

    event loop (HTTP)                         engine thread
    ----------------                          -------------
    make_request()  (validate, tokenize)
    generate() ---- inbox: add ------------>  drain inbox -> Engine.add_request
        ^                                     Engine.step()  (torch releases the GIL)
        +---- call_soon_threadsafe(outputs) --  one hand-over per step
    consumer gone -> inbox: abort -------->   Engine.abort_request (blocks freed before the next step)

Only the engine thread touches the Engine's state; the event loop only reads
a few counters. A consumer that falls behind gets its pending deltas merged
into one output, so a slow client costs one chunk, not one per step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Protocol

from tokenmill.config import EngineConfig
from tokenmill.engine.core_proc import EngineCore
from tokenmill.engine.engine import Engine
from tokenmill.engine.grammar import Grammars
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.outputs import failed_output
from tokenmill.engine.request import Request, RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_waiting_requests` allows."""


class StepObserver(Protocol):
    """Called on the event loop with every step's outputs and the engine's stats as of that
    step (metrics)."""

    def observe_step(self, outputs: Sequence[RequestOutput], stats: dict[str, float], now: float) -> None: ...


class EngineClient:
    """What the server talks to: validates requests, keeps one asyncio stream per request and
    hands each step's outputs to them. AsyncEngine runs the engine on a thread of this process;
    EngineCoreClient (core_client.py) runs it in a process of its own."""

    tokenizer: object
    max_model_len: int
    processor: InputProcessor
    grammars: Grammars | None  # the server compiles grammars ahead, in its own process (cached)

    def __init__(self, max_waiting_requests: int, observer: StepObserver | None) -> None:
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.max_waiting_requests = max_waiting_requests
        self.observer = observer
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- what a client implements ------------------------------------------------
    def start(self) -> None:
        """Starts stepping; call from the event loop that will consume the outputs."""
        raise NotImplementedError

    async def stop(self) -> None:
        """Fails what is left and stops the engine."""
        raise NotImplementedError

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: queued in the engine plus those still on their way to it."""
        raise NotImplementedError

    def _add(self, request: Request, prompt: str | None) -> None:
        raise NotImplementedError

    def _abort(self, request_id: str) -> None:
        raise NotImplementedError

    # -- requests -------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                     priority: int = 0, tenant: str | None = None,
                     tenant_weight: float = 1.0) -> tuple[Request, str | None]:
        """Validates and tokenizes on the caller's thread; raises ValueError naming the limit.
        `priority`, `tenant` and `tenant_weight` are what the scheduler's queue policy sees."""
        return self.processor.make_request(prompt, params, request_id=request_id, priority=priority,
                                           tenant=tenant, tenant_weight=tenant_weight)

    def check_capacity(self, num_new: int) -> None:
        """Raises QueueFullError when `num_new` more waiting requests would pass the bound."""
        if self.num_waiting + num_new > self.max_waiting_requests:
            raise QueueFullError(f"{self.num_waiting} requests are waiting (max_waiting_requests "
                                 f"{self.max_waiting_requests}); retry later")

    async def generate(self, request: Request, prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queues the request and yields its outputs (deltas) until it finishes. Closing the
        iterator early (client gone, task cancelled) aborts the request."""
        if not self.is_running:
            yield failed_output(request, "the engine is not running")
            return
        rid = request.request_id
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[rid] = stream
        self._add(request, prompt)
        finished = False
        try:
            while not finished:
                out = await stream.get()
                # outputs queued meanwhile: consecutive ones of the same sequence become one
                while not out.finished and not stream.empty():
                    following = stream.get_nowait()
                    if following.outputs[0].index == out.outputs[0].index:
                        out = _merge(out, following)
                    else:
                        yield out
                        out = following
                finished = out.finished
                yield out
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._abort(rid)

    def _dispatch(self, outputs: list[RequestOutput], stats: dict[str, float] | None, now: float) -> None:
        """On the event loop: one step's outputs to the observer and to their streams."""
        if self.observer is not None and stats is not None:
            try:
                self.observer.observe_step(outputs, stats, now)
            except Exception:  # noqa: BLE001 - metrics never stop the engine or the streams
                logger.exception("step observer failed")
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)


class AsyncEngine(EngineClient):
    """The engine on a thread of this process (tests reach into `self.engine`)."""

    def __init__(self, config: EngineConfig, max_waiting_requests: int = 1024,
                 observer: StepObserver | None = None,
                 on_kv_events: Callable[[list[tuple[bool, bytes]]], None] | None = None) -> None:
        super().__init__(max_waiting_requests, observer)
        # on the event loop: the (stored?, block hash) events of the steps since the last call
        self.on_kv_events = on_kv_events
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._num_inbox_adds = 0  # adds sent by the event loop
        self._wakeup = threading.Event()
        self._started = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None
        # The engine is built on its own thread, not only run there: torch's OpenMP pool belongs
        # to the thread that first runs parallel work, and a second pool in the process (one
        # per thread) makes libgomp stop spin-waiting, which slows small CPU ops by ~20%.
        built = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(config, built), name="tokenmill-engine",
                                        daemon=True)
        self._thread.start()
        built.wait()
        if self.error is not None:
            raise self.error
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.processor = self.engine.processor
        self.grammars = self.engine.grammars  # thread-safe: compiled ahead here, cached for the engine

    # -- life cycle -------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._started.set()

    async def stop(self) -> None:
        """Aborts what is left and joins the engine thread."""
        self._stopping = True
        self._started.set()
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join)

    @property
    def is_running(self) -> bool:
        return self._started.is_set() and self._thread.is_alive() and not self._stopping

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + max(0, self._num_inbox_adds - self.core.num_taken)

    def _add(self, request: Request, prompt: str | None) -> None:
        self._num_inbox_adds += 1
        self._send("add", (request, prompt))

    def _abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def _send(self, kind: str, payload: object) -> None:
        self._inbox.put((kind, payload))
        self._wakeup.set()

    # -- engine thread ------------------------------------------------------------
    def _main(self, config: EngineConfig, built: threading.Event) -> None:
        try:
            self.engine = Engine(config)
            self.core = EngineCore(self.engine)
            if self.on_kv_events is not None:
                self.engine.kv_cache.pool.events = []
        except BaseException as e:  # noqa: BLE001 - re-raised by __init__ on the caller's thread
            self.error = e
            return
        finally:
            built.set()
        self._started.wait()
        self._run()

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._wakeup.clear()
                outputs = self._drain_inbox()
                if engine.has_unfinished_requests():
                    outputs += self.core.step()
                if outputs or engine.kv_cache.pool.events:
                    self._publish(outputs)
                if not engine.has_unfinished_requests() and not self._stopping:
                    self._wakeup.wait()
        except BaseException as e:  # noqa: BLE001 - logged and reported to every open stream
            logger.exception("engine loop died")
            self.error = e
        finally:
            self._stopping = True
            outputs = self._drain_inbox()  # requests still on their way in are failed too
            outputs += self.core.fail_in_flight("the engine stopped" if self.error is None else
                                                f"engine error: {self.error}")
            if outputs:
                self._publish(outputs)
            engine.shutdown()

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            out = self.core.handle(kind, payload)
            if out is not None:
                outputs.append(out)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        # the observer runs on the event loop, off the engine's critical path
        stats = self.engine.stats() if self.observer is not None else None
        events = self.engine.kv_cache.pool.take_events()
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._on_step, outputs, stats, time.time(), events)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _on_step(self, outputs: list[RequestOutput], stats: dict[str, float] | None, now: float,
                 events: list[tuple[bool, bytes]]) -> None:
        if events and self.on_kv_events is not None:
            try:
                self.on_kv_events(events)
            except Exception:  # noqa: BLE001 - a prefix-cache mirror never stops the outputs
                logger.exception("prefix-cache event listener failed")
        self._dispatch(outputs, stats, now)


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One output carrying the deltas of two consecutive ones."""
    logprobs = None
    if a.new_logprobs is not None or b.new_logprobs is not None:
        logprobs = (a.new_logprobs or []) + (b.new_logprobs or [])
    return replace(b, new_token_ids=a.new_token_ids + b.new_token_ids, new_text=a.new_text + b.new_text,
                   new_logprobs=logprobs)
