"""Which replica gets a request: the one that holds the longest cached prefix of its prompt,
unless the replicas' loads are too far apart (SGLang's cache-aware policy).

Each replica's prefix cache is mirrored here as the set of its blocks' chained hashes
(kv_cache.block_hash: the same in every process), kept up to date from the events the
replica reports with each step. A request routed to a replica adds its own prompt's hashes
to that replica's mirror at once, so the requests that follow it, sent before its prefill
runs, go to the same place.

    prompt tokens  [b0][b1][b2][b3][..]     hashes h0 h1(h0) h2(h1) h3(h2)
    replica 0      {h0, h1, h2, ...}         matched 3 blocks
    replica 1      {h0, ...}                 matched 1 block     -> replica 0
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tokenmill.engine.kv_cache import chain_block_keys

POLICIES = ("prefix", "round_robin")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hashes of the prompt's full blocks, as the replicas' caches key them."""
    return [h for h, _ in chain_block_keys(None, token_ids, block_size, 0, len(token_ids) // block_size)]


class PrefixRouter:
    """`policy` "prefix" (longest cached prefix, ties and imbalance by load) or "round_robin".
    `balance_abs` / `balance_rel`: when the busiest replica has more than `balance_abs`
    requests above the idlest and more than `balance_rel` times its load, the idlest gets
    the request whatever it holds. Each mirror keeps at most `capacity` hashes (least
    recently used go first), so hashes whose removal was missed cannot pile up."""

    def __init__(self, num_replicas: int, block_size: int, policy: str = "prefix", balance_abs: int = 16,
                 balance_rel: float = 1.5, capacity: int = 1 << 20) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.block_size = block_size
        self.policy = policy
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.capacity = capacity
        self.held: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._next = 0
        self.num_routed = [0] * num_replicas
        self.num_matched_blocks = 0  # blocks of routed prompts found in the chosen replica's mirror
        self.num_prompt_blocks = 0

    def route(self, token_ids: Sequence[int], loads: Sequence[int], alive: Sequence[bool]) -> int:
        """The replica for a prompt; `loads`: requests each has in flight; only `alive` ones count."""
        candidates = [i for i, ok in enumerate(alive) if ok]
        if not candidates:
            raise RuntimeError("no replica is running")
        if self.policy == "round_robin":
            n = len(self.held)
            while not alive[self._next % n]:
                self._next += 1
            choice = self._next % n
            self._next += 1
            self.num_routed[choice] += 1
            return choice
        hashes = prompt_block_hashes(token_ids, self.block_size)
        matched = {i: self._matched(i, hashes) for i in candidates}
        lo = min(loads[i] for i in candidates)
        hi = max(loads[i] for i in candidates)
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            choice = min(candidates, key=lambda i: (loads[i], -matched[i]))
        else:  # most blocks held; then the least loaded; then the one holding the least
            choice = min(candidates, key=lambda i: (-matched[i], loads[i], len(self.held[i])))
        self.num_routed[choice] += 1
        self.num_matched_blocks += matched[choice]
        self.num_prompt_blocks += len(hashes)
        self._hold(choice, hashes)
        return choice

    def _matched(self, replica: int, hashes: list[bytes]) -> int:
        held = self.held[replica]
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def _hold(self, replica: int, hashes: list[bytes]) -> None:
        held = self.held[replica]
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def apply_events(self, replica: int, events: list[tuple[bool, bytes]] | None) -> None:
        """A replica's prefix-cache events: (True, hash) stored, (False, hash) removed; None:
        the replica is gone, and with it everything it held."""
        held = self.held[replica]
        if events is None:
            held.clear()
            return
        for stored, h in events:
            if stored:
                held[h] = None
                held.move_to_end(h)
            else:
                held.pop(h, None)
        while len(held) > self.capacity:
            held.popitem(last=False)
