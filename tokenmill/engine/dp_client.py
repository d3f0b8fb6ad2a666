"""DataParallelClient: N engine-core processes behind one API front (`--data-parallel-size N`).

    make_request (validate, tokenize)          once, in the API process
    generate()  -> PrefixRouter.route(prompt, loads, alive)
                -> replica i's EngineCoreClient.generate()  (its own core, cores and KV cache)
    each replica's step  -> its prefix-cache events -> the router's mirror of replica i
                         -> metrics, with the stats of all replicas summed

On the CPU each replica gets its own slice of the cores (threads split, affinity set); a
replica that dies is routed around while the others serve (`restart` brings it back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import EngineClient, StepObserver
from tokenmill.engine.core_client import EngineCoreClient
from tokenmill.engine.detokenizer import load_tokenizer
from tokenmill.engine.outputs import failed_output
from tokenmill.engine.ray_core import cpus_per_core
from tokenmill.engine.request import Request, RequestOutput
from tokenmill.executor.distributed.parallel import split_cpus
from tokenmill.executor.loader import resolve_model_path
from tokenmill.router.prefix import PrefixRouter

logger = logging.getLogger("tokenmill")

# running totals of one engine core's life: a restarted replica's start again from zero
_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_prompt_tokens_computed",
             "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_unspeculated_steps")
_SUMMED = ("num_running", "num_waiting", *_COUNTERS)


class _ReplicaObserver:
    """A replica's step, seen by the front: its stats kept, the metrics given the sum."""

    def __init__(self, front: DataParallelClient, index: int) -> None:
        self.front, self.index = front, index

    def observe_step(self, outputs: Sequence[RequestOutput], stats: dict[str, float], now: float) -> None:
        self.front._observe(self.index, outputs, stats, now)


class DataParallelClient(EngineClient):
    def __init__(self, config: EngineConfig, size: int, max_waiting_requests: int = 1024,
                 observer: StepObserver | None = None, restart: bool = False, routing: str = "prefix",
                 check_integrity: bool = False,
                 on_kv_events: Callable[[int, list[tuple[bool, bytes]] | None], None] | None = None,
                 ray: bool = False) -> None:
        """`ray`: the replicas are Ray actors (connect to the cluster first: ray_core.connect_ray),
        each reserving its share of `num_threads` (default: the cluster's CPUs)."""
        super().__init__(max_waiting_requests, observer)
        self.on_kv_events = on_kv_events  # (replica, its events), after the router's mirror took them
        if size < 2:
            raise ValueError(f"--data-parallel-size must be >= 2 here (1 is a single engine core), got {size}")
        if ray:  # how many CPUs each replica reserves, not which: Ray picks the node
            cpus: list[list[int] | None] = [None] * size
            threads = [cpus_per_core(config.num_threads, size, "--data-parallel-size")] * size
        else:
            cpus = split_cpus(size, config.num_threads, "--data-parallel-size")
            threads = [len(c) for c in cpus]
        model_path = resolve_model_path(config.model)  # once, here: the replicas start on threads
        if config.model is not None:
            config = replace(config, model=str(model_path))
        tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or model_path)
        self.router = PrefixRouter(size, config.block_size, routing)
        self._replica_stats: list[dict[str, Any]] = [{} for _ in range(size)]
        # what each replica's earlier cores counted, so the sums never go down after a restart
        self._counted_before: list[dict[str, int]] = [dict.fromkeys(_COUNTERS, 0) for _ in range(size)]
        self._loads = [0] * size  # requests each replica has in flight, as routed here

        def build(i: int) -> EngineCoreClient:
            return EngineCoreClient(replace(config, num_threads=threads[i]), max_waiting_requests,
                                    observer=_ReplicaObserver(self, i), restart=restart,
                                    check_integrity=check_integrity, cpus=cpus[i],
                                    on_kv_events=lambda events, i=i: self._kv_events(i, events),
                                    tokenizer=tokenizer, ray_cpus=threads[i] if ray else None)

        with ThreadPoolExecutor(size) as pool:  # the replicas load at once
            futures = [pool.submit(build, i) for i in range(size)]
        errors = [f.exception() for f in futures if f.exception() is not None]
        self.replicas = [f.result() for f in futures if f.exception() is None]
        if errors:
            for replica in self.replicas:
                replica.close()
            raise errors[0]
        first = self.replicas[0]
        self.tokenizer, self.max_model_len = first.tokenizer, first.max_model_len
        self.processor, self.grammars = first.processor, first.grammars
        if ray:
            logger.info("data parallel: %d engine cores as Ray actors of %d CPUs each, routing %s", size,
                        threads[0], routing)
        else:
            logger.info("data parallel: %d engine cores on cores %s, routing %s", size,
                        " | ".join(",".join(map(str, c)) for c in cpus), routing)

    # -- life cycle -------------------------------------------------------------
    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    async def stop(self) -> None:
        await asyncio.gather(*(replica.stop() for replica in self.replicas), return_exceptions=True)

    @property
    def is_running(self) -> bool:
        """While one replica runs, the front serves (routing around the others)."""
        return any(r.is_running for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    @property
    def pids(self) -> list[int | None]:
        return [r.pid for r in self.replicas]

    @property
    def stats(self) -> dict[str, Any]:
        return _sum_stats([{**s, **{n: s.get(n, 0) + before[n] for n in _COUNTERS}} if s else s
                           for s, before in zip(self._replica_stats, self._counted_before)])

    # -- requests ---------------------------------------------------------------
    async def generate(self, request: Request, prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        alive = [r.is_running for r in self.replicas]
        if not any(alive):
            yield failed_output(request, "the engine is not running")
            return
        i = self.router.route(request.prompt_token_ids, self._loads, alive)
        self._loads[i] += 1
        try:
            async with contextlib.aclosing(self.replicas[i].generate(request, prompt)) as outputs:
                async for out in outputs:  # closed early: the replica aborts the request
                    yield out
        finally:
            self._loads[i] -= 1

    def _kv_events(self, index: int, events: list[tuple[bool, bytes]] | None) -> None:
        self.router.apply_events(index, events)
        if self.on_kv_events is not None:
            self.on_kv_events(index, events)

    def _observe(self, index: int, outputs: Sequence[RequestOutput], stats: dict[str, Any], now: float) -> None:
        last, before = self._replica_stats[index], self._counted_before[index]
        for name in _COUNTERS:
            if stats.get(name, 0) < last.get(name, 0):  # a new core: what the old one counted stays
                before[name] += last[name]
        self._replica_stats[index] = stats
        if self.observer is not None:
            self.observer.observe_step(outputs, self.stats, now)


def _sum_stats(per_replica: list[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' stats as one engine's: counts summed, KV usage averaged."""
    known = [s for s in per_replica if s]
    if not known:
        return {}
    out: dict[str, Any] = {name: sum(s.get(name, 0) for s in known) for name in _SUMMED}
    out["kv_cache_usage"] = sum(s.get("kv_cache_usage", 0.0) for s in per_replica) / len(per_replica)
    queries = out["prefix_cache_queries"]
    out["prefix_cache_hit_rate"] = out["prefix_cache_hits"] / queries if queries else 0.0
    for name in ("spec_decode_num_accepted_tokens_per_pos", "spec_decode_num_steps_by_k"):
        lists = [s.get(name, []) for s in known]
        out[name] = [sum(v[j] for v in lists if j < len(v)) for j in range(max(map(len, lists), default=0))]
    return out
