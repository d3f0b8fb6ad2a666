"""Structured outputs: grammars compiled off the engine thread, one matcher per sequence,
one token bitmask per step (llguidance).

    Engine.add_request -> Grammars.compile(spec): a Future, one compilation per distinct
                          spec (cached); the request waits outside the scheduler meanwhile
    every step         -> Grammars.bitmask(sampling requests): each constrained row's
                          allowed tokens, 32 a word, for the sampler to mask in one call
    after the update   -> Grammars.accept(request): its matcher follows the sampled token

llguidance was picked over xgrammar by measurement (benchmarks/grammar_backends.py, 2
cores): with a 64k vocabulary the masks of 16 rows took 1.0 ms a step against 5.1 ms for a
JSON schema and 0.3 ms against 1.2 ms for any JSON, and a schema compiled in 2 ms against
330 ms; only its one-off tokenizer set-up is slower (1.1 s against 0.35 s).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np

from tokenmill.engine.request import Request
from tokenmill.sampling_params import ParamError, StructuredOutputsParams

logger = logging.getLogger("tokenmill")

CACHE_SIZE = 256  # compiled grammars kept (least recently used go first)


class Grammars:
    """Compiles structured-output specs against the engine's tokenizer and fills masks.

    The tokenizer's llguidance form is built on the compile thread at the first use
    (about 1 s for a 128k vocabulary), so engines that never see a grammar never pay it.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.words = (vocab_size + 31) // 32  # int32 words in one row of the mask
        self._ll_tokenizer = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()  # the cache is read by the engine thread, filled by compile()
        self.pending: dict[str, tuple[Request, Future]] = {}  # requests waiting for their grammar

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """A Future of the compiled grammar (a matcher in its start state, to copy per sequence)."""
        key = spec.compiled_form
        with self._lock:
            future = self._cache.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._pool.submit(self._compile, key)
                self._cache[key] = future
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            return future

    def _compile(self, grammar: str):
        import llguidance
        import llguidance.hf

        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                              eos_token=self.eos_token_ids)
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ParamError("structured_outputs", "structured_outputs: does not compile against the tokenizer: "
                             f"{matcher.get_error().strip()}")
        return matcher

    def add(self, request: Request) -> None:
        """The request waits here (outside the scheduler) until its grammar is compiled."""
        self.pending[request.request_id] = (request, self.compile(request.sampling_params.structured_outputs))

    def ready(self) -> tuple[list[Request], list[tuple[Request, BaseException]]]:
        """The waiting requests whose grammar is done: those that compiled, each with its own
        matcher, and those that failed, with the error."""
        started, failed = [], []
        for request_id, (request, future) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[request_id]
            error = future.exception()
            if error is not None:
                failed.append((request, error))
            else:
                request.grammar = future.result().deep_copy()
                started.append(request)
        return started, failed

    def wait(self, timeout: float) -> None:
        """Until one waiting grammar is done, or `timeout` seconds."""
        wait([future for _, future in self.pending.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def bitmask(self, requests: list[Request]) -> tuple[list[int], np.ndarray] | None:
        """(rows, mask) for the constrained ones among a step's sampling requests: bit t of
        row k says whether token t is allowed for requests[rows[k]]. None if none is."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return None
        mask = np.empty((len(rows), self.words), dtype=np.int32)
        nbytes = self.words * 4
        for k, i in enumerate(rows):  # llguidance drops the GIL while it fills a row
            requests[i].grammar.unsafe_compute_mask_ptr(mask[k].ctypes.data, nbytes)
        return rows, mask

    def advance(self, changed: list[Request]) -> list[tuple[Request, str]]:
        """Each constrained sequence that got a token this step advances its matcher; returns
        those that must end, with accept()'s verdict."""
        ended = []
        for request in changed:
            if request.grammar is not None and not request.is_finished:
                verdict = self.accept(request)
                if verdict is not None:
                    ended.append((request, verdict))
        return ended

    @staticmethod
    def accept(request: Request) -> str | None:
        """Advances the request's matcher by its last token. Returns "stop" when the grammar
        can go no further (the output is complete), an error message when the token was not
        allowed (the mask was overridden: e.g. min_tokens banning the only way to end)."""
        matcher = request.grammar
        if not matcher.consume_token(request.all_token_ids[-1]):
            why = (matcher.get_error().strip().splitlines() or [""])[0]
            return f"structured_outputs: the sampled token does not fit the grammar ({why})"
        return "stop" if matcher.is_stopped() else None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
