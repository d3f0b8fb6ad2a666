"""The pairs (token, the target's hidden state) that an EAGLE head's cache does not hold yet
(executor/spec/eagle.py): a request's, while it does not draft (Waiting), and a resting step's,
logged whole (Rest)."""

from __future__ import annotations

import operator
from array import array
from collections import deque

import torch

from tokenmill.engine.request import Request

# pairs kept for a request that does not draft (EagleProposer._keep): one hidden-size vector
# each, outside the KV budget (for 256 requests of an 8B Llama in bf16, up to 1 GiB)
MAX_WAITING = 512


class Waiting:
    """A request's pairs at positions start..end - 1, not yet in the head's cache: their
    tokens, and in the pieces the steps gave, each piece's length and where its hidden states
    are (a copy and the first row in it).

    Nothing a step adds here is a new object the garbage collector walks: the tokens go into
    one array, the lengths and rows are ints, and a step's pieces share its slab. (Appending
    a tuple that holds a tensor to a long deque took 6.6 us in the collector's passes, against
    0.15 us. With a list of tokens a request and step, kept while the request did not draft,
    an engine of 64 EAGLE requests that drafted nothing ran 199 collections in 18 s, 0.23 s,
    against 12 without EAGLE; with the array, 30 and 0.03 s.)"""

    __slots__ = ("end", "firsts", "ids", "lengths", "sources", "start")

    def __init__(self, start: int) -> None:
        self.start = self.end = start
        self.ids = array("q")
        self.lengths: deque[int] = deque()
        self.sources: deque[torch.Tensor] = deque()
        self.firsts: deque[int] = deque()

    def add(self, ids: list[int], source: torch.Tensor, first: int) -> None:
        self.ids.extend(ids)
        self.lengths.append(len(ids))
        self.sources.append(source)
        self.firsts.append(first)
        self.end += len(ids)
        while self.end - self.start > MAX_WAITING and len(self.lengths) > 1:  # whole pieces, oldest first
            n = self.lengths.popleft()
            del self.ids[:n]
            self.start += n
            self.sources.popleft()
            self.firsts.popleft()


class Rest:
    """A resting step's pairs (EagleProposer._log_rest): its requests and their positions, in
    row order, and where in which slab its hidden states begin."""

    __slots__ = ("base", "positions", "requests", "slab")

    def __init__(self, requests: list[Request], positions: list[int], slab: torch.Tensor, base: int) -> None:
        self.requests, self.positions, self.slab, self.base = requests, positions, slab, base

    def continues(self, first: Rest, steps: int) -> bool:
        """Whether this step is `steps` after `first` in one run: the same requests, each
        `steps` positions further, its rows right after the steps' between in the same slab."""
        n = len(first.requests)
        return (self.slab is first.slab and self.base == first.base + steps * n and len(self.requests) == n
                and all(map(operator.is_, self.requests, first.requests))
                and all(p == q + steps for p, q in zip(self.positions, first.positions)))
