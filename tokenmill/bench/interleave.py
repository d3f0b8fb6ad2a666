"""Engines compared in one run, taking turns: each steps for a turn of a fraction of a
second, then the next, until all are done; each is timed on its own clock, the sum of its
turns.

Comparing engines by whole runs, one after another, a moment's load on a shared machine
falls on one side only. On the 2-core development VM one plain engine's runs of the same
workload went from 531 to 698 tok/s round to round, and two identical plain engines'
medians over 5-10 rounds were 0.92-1.12x apart; taking turns of 0.25 s in one run, they
came out 0.975-1.010x apart over 5 rounds (concurrency 16, the built-in model). Each turn
begins with the engine's weights out of the CPU's caches (the others ran meanwhile); with
turns of many steps that is a small share of its steps, and the same for every engine.
"""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Sequence

from tokenmill.engine.request import RequestOutput
from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams


class GcTime:
    """A gc.callbacks entry: the garbage collector's passes and their seconds while it is
    registered (an EAGLE engine's bookkeeping once made it collect 16 times as often as a
    plain one)."""

    def __init__(self) -> None:
        self.count, self.seconds, self._start = 0, 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._start


class Turns:
    """One engine's part of an interleaved run: its requests (queued at construction), their
    outputs, its own clock (`seconds`, its turns' time), onto which the wall-clock times of
    its tokens map (`own`), and the garbage collector's passes during its turns (`collecting`)."""

    def __init__(self, llm: LLM, prompts: Sequence[list[int]], params: SamplingParams) -> None:
        self.llm, self.engine = llm, llm.engine
        self.request_ids = []
        for prompt in prompts:
            request, text = self.engine.make_request(list(prompt), params)
            self.engine.add_request(request, text, final_only=True)
            self.request_ids.append(request.request_id)
        self.final: dict[str, RequestOutput] = {}
        self.seconds = 0.0  # its own clock
        self.turns: list[tuple[float, float]] = []  # (wall time a turn began, own clock then)
        self.collecting = GcTime()  # the collector's passes during its turns

    def turn(self, seconds: float) -> bool:
        """Steps the engine for `seconds` (one step at least, each whole); whether it has
        requests left."""
        self.turns.append((time.time(), self.seconds))
        gc.callbacks.append(self.collecting)
        start = time.perf_counter()
        try:
            while True:
                for out in self.engine.step():
                    if out.finished:
                        self.final[out.request_id] = out
                if not self.engine.has_unfinished_requests() or time.perf_counter() - start >= seconds:
                    break
        finally:
            self.seconds += time.perf_counter() - start
            gc.callbacks.remove(self.collecting)
        return self.engine.has_unfinished_requests()

    def own(self, wall: float) -> float:
        """A wall-clock time (time.time(), as the outputs' metrics) during one of the engine's
        turns, on its own clock."""
        began, clock = self.turns[max(0, bisect.bisect_right(self.turns, (wall, float("inf"))) - 1)]
        return clock + wall - began

    @property
    def outputs(self) -> list[RequestOutput]:
        """The final outputs, in the order the prompts were given."""
        return [self.final[i] for i in self.request_ids]

    def time_per_output_token(self) -> list[float]:
        """Each request's (last token - first token) / (tokens - 1) on the engine's own clock
        (requests with one token left out)."""
        return [(self.own(o.metrics.last_token_time) - self.own(o.metrics.first_token_time))
                / (len(o.outputs[0].token_ids) - 1) for o in self.outputs if len(o.outputs[0].token_ids) > 1]


def run_interleaved(llms: dict[str, LLM], prompts: Sequence[list[int]], params: SamplingParams,
                    turn: float = 0.5) -> dict[str, Turns]:
    """The prompts (token ids) through every engine at once: they take turns of `turn`
    seconds in the order given until all are done. 0: one step a turn."""
    if turn < 0:
        raise ValueError(f"turn: must be >= 0 seconds, got {turn}")
    turns = {name: Turns(llm, prompts, params) for name, llm in llms.items()}
    live = list(turns)
    while live:
        live = [name for name in live if turns[name].turn(turn)]
    return turns
