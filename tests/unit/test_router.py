"""PrefixRouter (no model): its hashes are the KV cache's, requests sharing a prefix go where
it is held, load breaks ties and overrides a cache match when replicas drift apart, events
keep the mirrors true, a dead replica is routed around."""

from __future__ import annotations

import random

import pytest

from tokenmill.engine.kv_cache import BlockPool, chain_block_keys
from tokenmill.router.prefix import PrefixRouter, prompt_block_hashes

BS = 16


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 8000) for _ in range(n)]


def test_hashes_are_the_kv_cache_keys():
    tokens = _prompt(0, 16 * 5 + 7)
    keys = chain_block_keys(None, tokens, BS, 0, 5)
    assert prompt_block_hashes(tokens, BS) == [k[0] for k in keys]


def test_shared_prefixes_stick_to_one_replica_and_spread_by_load():
    router = PrefixRouter(2, BS)
    prefixes = [_prompt(p, 256) for p in range(4)]
    loads = [0, 0]
    placed: dict[int, set[int]] = {p: set() for p in range(4)}
    for i in range(40):
        p = i % 4
        replica = router.route(prefixes[p] + _prompt(100 + i, 20), loads, [True, True])
        loads[replica] += 1
        placed[p].add(replica)
    assert all(len(where) == 1 for where in placed.values()), placed  # each prefix in one place
    assert {next(iter(w)) for w in placed.values()} == {0, 1}  # and the prefixes spread over both
    assert router.num_routed == [20, 20]
    assert router.num_matched_blocks == 36 * 16  # all but each prefix's first request matched 16 blocks


def test_imbalance_overrides_the_cache_match():
    router = PrefixRouter(2, BS, balance_abs=4, balance_rel=1.5)
    prefix = _prompt(1, 128)
    assert router.route(prefix + [1], [0, 0], [True, True]) == 0
    assert router.route(prefix + [2], [4, 0], [True, True]) == 0  # 4 above: within balance_abs
    assert router.route(prefix + [3], [5, 0], [True, True]) == 1  # too far apart: the idle one


def test_events_keep_the_mirror_true():
    router = PrefixRouter(2, BS)
    prefix = _prompt(2, 64)
    hashes = prompt_block_hashes(prefix, BS)
    router.apply_events(1, [(True, h) for h in hashes])
    assert router.route(prefix, [3, 3], [True, True]) == 1  # found in replica 1's reported cache
    router.apply_events(1, [(False, hashes[0])])  # evicted: the chain is broken at its head
    router.apply_events(0, [(True, h) for h in hashes[:2]])
    assert router.route(prefix, [0, 0], [True, True]) == 0
    router.apply_events(0, None)  # replica 0 died
    assert not router.held[0]


def test_dead_replicas_are_skipped_and_round_robin():
    rr = PrefixRouter(3, BS, policy="round_robin")
    assert [rr.route([1] * 20, [0, 0, 0], [True, False, True]) for _ in range(4)] == [0, 2, 0, 2]
    router = PrefixRouter(2, BS)
    prefix = _prompt(3, 64)
    router.apply_events(0, [(True, h) for h in prompt_block_hashes(prefix, BS)])
    assert router.route(prefix, [0, 0], [False, True]) == 1
    with pytest.raises(RuntimeError, match="no replica"):
        router.route(prefix, [0, 0], [False, False])
    with pytest.raises(ValueError, match="routing policy"):
        PrefixRouter(2, BS, policy="random")


def test_mirror_capacity_is_bounded():
    router = PrefixRouter(1, BS, capacity=10)
    router.route(_prompt(4, 16 * 30), [0], [True])
    assert len(router.held[0]) == 10


def test_block_pool_reports_stored_and_evicted_hashes():
    pool = BlockPool(2)
    assert pool.take_events() == []  # not collecting
    pool.events = []
    a, b = pool.take(2)
    pool.register(a, (b"h1", (1,)))
    pool.register(b, (b"h1", (1,)))  # a duplicate key: not stored twice
    pool.release([a, b])
    pool.take(2)  # reuses both blocks: a's cached prefix is evicted
    assert pool.take_events() == [(True, b"h1"), (False, b"h1")]
    assert pool.take_events() == []
