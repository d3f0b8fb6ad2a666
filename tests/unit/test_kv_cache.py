"""KVCacheManager / BlockPool: allocation, ref counts, prefix caching, LRU reuse.

Every test plays the scheduler by hand: `get_computed_blocks` then `allocate_slots`,
then advances `num_computed_tokens` as a step would, and calls `check_integrity()`
after every operation on the cache.
"""

from __future__ import annotations

import pytest

from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=16, ignore_eos=True))


def admit(kv: KVCacheManager, request: Request) -> int:
    """Admits a waiting request whole (prefix hit + the rest); returns the number of cached tokens."""
    hits, num_cached = kv.get_computed_blocks(request)
    kv.check_integrity()
    assert kv.allocate_slots(request, request.num_tokens - num_cached, hits)
    request.num_computed_tokens = request.num_tokens
    kv.check_integrity()
    return num_cached


def decode(kv: KVCacheManager, request: Request, token: int) -> None:
    """Appends a sampled token and gives it a slot, as one decode step does."""
    request.all_token_ids.append(token)
    assert kv.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    kv.check_integrity()


def free(kv: KVCacheManager, request: Request, finished: bool = True) -> None:
    kv.free(request, finished=finished)
    kv.check_integrity()


def hit_tokens(kv: KVCacheManager, tokens: list[int]) -> int:
    """Tokens of `tokens` a fresh request would find in the prefix cache (no state change)."""
    probe = make_request("probe", tokens)
    _, num_cached = kv.get_computed_blocks(probe)
    kv.free(probe)  # drops the probe's key memo
    kv.check_integrity()
    return num_cached


def snapshot(kv: KVCacheManager) -> tuple:
    pool = kv.pool
    return ([(b.block_id, b.ref_cnt, b.key) for b in pool.blocks], list(pool.free_queue),
            {k: b.block_id for k, b in pool.cached.items()},
            {rid: [b.block_id for b in blocks] for rid, blocks in kv.req_blocks.items()},
            dict(kv.req_num_registered))


def blocks_of(n: int, start: int) -> list[int]:
    """n full blocks of distinct tokens starting at `start`."""
    return list(range(start, start + n * BS))


# -- allocation and ref counts ---------------------------------------------------

def test_allocate_takes_ceil_blocks_and_free_returns_them():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(10)))
    assert admit(kv, a) == 0
    ids = kv.get_block_ids("a")
    assert len(ids) == 3 and len(set(ids)) == 3
    assert kv.num_free_blocks == 5
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in ids)
    assert kv.usage == pytest.approx(3 / 8)
    free(kv, a)
    assert kv.num_free_blocks == 8
    assert all(kv.pool.blocks[i].ref_cnt == 0 for i in ids)
    assert kv.get_block_ids("a") == []
    assert kv.usage == 0.0


def test_decode_takes_a_new_block_only_at_a_block_boundary():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(4)))
    admit(kv, a)
    assert len(kv.get_block_ids("a")) == 1
    decode(kv, a, 50)  # position 4 starts block 1
    assert len(kv.get_block_ids("a")) == 2
    for t in (51, 52, 53):  # positions 5..7 fill block 1
        decode(kv, a, t)
        assert len(kv.get_block_ids("a")) == 2
    decode(kv, a, 54)
    assert len(kv.get_block_ids("a")) == 3
    assert kv.num_free_blocks == 5


def test_chunked_allocation_grows_the_table_and_keeps_earlier_blocks():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(10)))
    assert kv.allocate_slots(a, 6)
    first = kv.get_block_ids("a")
    assert len(first) == 2
    a.num_computed_tokens = 6
    kv.check_integrity()
    assert kv.allocate_slots(a, 4)
    a.num_computed_tokens = 10
    kv.check_integrity()
    ids = kv.get_block_ids("a")
    assert ids[:2] == first and len(ids) == 3


def test_only_full_blocks_of_scheduled_tokens_become_findable():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(10)))
    assert kv.allocate_slots(a, 6)  # tokens 0..5: block 0 full, block 1 partial
    a.num_computed_tokens = 6
    kv.check_integrity()
    assert hit_tokens(kv, list(range(10))) == 4
    assert kv.allocate_slots(a, 4)  # tokens 6..9: block 1 full, block 2 partial
    a.num_computed_tokens = 10
    kv.check_integrity()
    assert hit_tokens(kv, list(range(10))) == 8
    assert hit_tokens(kv, list(range(20))) == 8  # the partial block 2 is never a hit


def test_two_requests_sharing_blocks_have_ref_cnt_two():
    kv = KVCacheManager(8, BS)
    prefix = blocks_of(2, 0)
    a = make_request("a", prefix + [100])
    b = make_request("b", prefix + [200, 201])
    admit(kv, a)
    assert admit(kv, b) == 8
    a_ids, b_ids = kv.get_block_ids("a"), kv.get_block_ids("b")
    assert b_ids[:2] == a_ids[:2] and b_ids[2] != a_ids[2]
    assert [kv.pool.blocks[i].ref_cnt for i in a_ids[:2]] == [2, 2]
    assert kv.num_free_blocks == 8 - 4
    free(kv, a)
    assert [kv.pool.blocks[i].ref_cnt for i in a_ids[:2]] == [1, 1]
    assert not any(i in kv.pool.free_queue for i in a_ids[:2])
    assert a_ids[2] in kv.pool.free_queue
    free(kv, b)
    assert kv.num_free_blocks == 8
    assert hit_tokens(kv, prefix + [7]) == 8  # still cached after both left


# -- prefix caching --------------------------------------------------------------

def test_prefix_hit_is_the_longest_cached_prefix():
    kv = KVCacheManager(16, BS)
    x, y, z = blocks_of(1, 0), blocks_of(1, 10), blocks_of(1, 20)
    a = make_request("a", x + y + z + [99])
    admit(kv, a)
    free(kv, a)
    assert hit_tokens(kv, x + y + z + [5]) == 12
    assert hit_tokens(kv, x + y + blocks_of(1, 30) + [5]) == 8
    assert hit_tokens(kv, x + [5, 6]) == 4
    assert hit_tokens(kv, blocks_of(1, 40) + y + z + [5]) == 0


def test_block_keys_are_chained_so_same_tokens_after_another_prefix_miss():
    kv = KVCacheManager(16, BS)
    x, y, z = blocks_of(1, 0), blocks_of(1, 10), blocks_of(1, 20)
    a = make_request("a", x + y + [99])
    admit(kv, a)
    # block 1 of b holds exactly the tokens of a's block 1, but after a different block 0
    b = make_request("b", z + y + [99])
    assert admit(kv, b) == 0
    assert set(kv.get_block_ids("a")).isdisjoint(kv.get_block_ids("b"))


def test_a_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(16, BS)
    prompt = blocks_of(2, 0)  # exactly two full blocks
    a = make_request("a", prompt)
    admit(kv, a)
    free(kv, a)
    b = make_request("b", list(prompt))
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 4 and len(hits) == 1  # block 1 would leave nothing to compute
    assert num_cached < b.num_tokens
    assert kv.allocate_slots(b, b.num_tokens - num_cached, hits)
    kv.check_integrity()
    c = make_request("c", prompt + [1])  # one more token: both blocks are hits
    hits, num_cached = kv.get_computed_blocks(c)
    assert num_cached == 8 and c.num_tokens - num_cached == 1


def test_single_token_prompt_has_no_hit():
    kv = KVCacheManager(4, 1)
    a = make_request("a", [3, 4])
    admit(kv, a)
    free(kv, a)
    assert hit_tokens(kv, [3]) == 0
    assert hit_tokens(kv, [3, 4]) == 1
    assert hit_tokens(kv, [3, 4, 5]) == 2


def test_freed_cached_blocks_are_reused_by_a_later_request():
    kv = KVCacheManager(8, BS)
    prefix = blocks_of(2, 0)
    a = make_request("a", prefix + [1, 2])
    admit(kv, a)
    a_ids = kv.get_block_ids("a")
    free(kv, a)
    b = make_request("b", prefix + [3])
    assert admit(kv, b) == 8
    assert b.num_computed_tokens == b.num_tokens
    assert kv.get_block_ids("b")[:2] == a_ids[:2]
    assert [kv.pool.blocks[i].ref_cnt for i in a_ids[:2]] == [1, 1]
    assert kv.num_free_blocks == 8 - 3
    assert kv.prefix_hits == 8


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    prompt = blocks_of(2, 0) + [1]
    a = make_request("a", prompt)
    assert admit(kv, a) == 0
    b = make_request("b", list(prompt))
    assert admit(kv, b) == 0
    assert set(kv.get_block_ids("a")).isdisjoint(kv.get_block_ids("b"))
    free(kv, a)
    free(kv, b)
    assert admit(kv, make_request("c", list(prompt))) == 0
    assert not kv.pool.cached
    assert all(b.key is None for b in kv.pool.blocks)
    assert kv.prefix_hits == 0


def test_prefix_hit_statistics_count_tokens():
    kv = KVCacheManager(8, BS)
    admit(kv, make_request("a", blocks_of(2, 0) + [1]))  # 9 tokens, no hit
    admit(kv, make_request("b", blocks_of(2, 0) + [2, 3, 4]))  # 11 tokens, 8 hit
    assert (kv.prefix_queries, kv.prefix_hits) == (20, 8)


def test_preempted_request_finds_its_own_blocks_again():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(6)))
    admit(kv, a)
    for t in (50, 51, 52):
        decode(kv, a, t)  # 9 tokens computed: blocks 0, 1 full
    free(kv, a, finished=False)
    a.num_computed_tokens = 0
    a.all_token_ids.append(53)  # the token sampled at the last step
    assert admit(kv, a) == 8


def test_blocks_registered_for_a_step_that_never_ran_are_forgotten_on_free():
    # allocate_slots registers the full blocks of the tokens scheduled this step; if the
    # request is preempted before the step runs (num_computed_tokens not yet advanced),
    # their K/V is never written and they must not be prefix hits afterwards
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(13)))
    assert kv.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    kv.check_integrity()
    assert kv.allocate_slots(a, 8)  # blocks 1, 2 registered; the step is then dropped
    assert hit_tokens(kv, list(range(13))) == 12
    free(kv, a, finished=False)
    assert hit_tokens(kv, list(range(13))) == 4
    assert kv.num_free_blocks == 8


def test_reset_prefix_cache_forgets_only_free_blocks():
    kv = KVCacheManager(8, BS)
    a = make_request("a", blocks_of(1, 0) + [1])
    b = make_request("b", blocks_of(1, 10) + [1])
    admit(kv, a)
    admit(kv, b)
    free(kv, a)
    kv.reset_prefix_cache()
    kv.check_integrity()
    assert hit_tokens(kv, blocks_of(1, 0) + [1]) == 0
    assert hit_tokens(kv, blocks_of(1, 10) + [1]) == 4


# -- LRU reuse of free blocks ----------------------------------------------------

@pytest.mark.parametrize("first_freed", ["a", "b"])
def test_eviction_is_least_recently_freed_first_after_blocks_with_no_key(first_freed):
    kv = KVCacheManager(6, BS)
    pa, pb = blocks_of(2, 0), blocks_of(2, 100)
    reqs = {"a": make_request("a", pa), "b": make_request("b", pb)}
    admit(kv, reqs["a"])
    admit(kv, reqs["b"])
    second = "b" if first_freed == "a" else "a"
    free(kv, reqs[first_freed])
    free(kv, reqs[second])
    # 2 never-used blocks, then the first-freed request's tail block are handed out
    c = make_request("c", blocks_of(3, 200))
    admit(kv, c)
    c_ids = set(kv.get_block_ids("c"))
    assert len(c_ids) == 3
    prompts = {"a": pa, "b": pb}
    assert hit_tokens(kv, prompts[first_freed] + [0]) == 4  # its head survives, its tail is gone
    assert hit_tokens(kv, prompts[second] + [0]) == 8
    # the next block goes to the first-freed request's head, still before the other's blocks
    admit(kv, make_request("d", [7]))
    assert hit_tokens(kv, prompts[first_freed] + [0]) == 0
    assert hit_tokens(kv, prompts[second] + [0]) == 8


def test_a_hit_refreshes_a_cached_block_in_lru_order():
    kv = KVCacheManager(4, BS)
    pa, pb = blocks_of(2, 0), blocks_of(2, 100)
    a, b = make_request("a", pa), make_request("b", pb)
    admit(kv, a)
    admit(kv, b)
    free(kv, a)
    free(kv, b)
    a2 = make_request("a2", pa + [1])
    assert kv.num_free_blocks == 4
    hits, num_cached = kv.get_computed_blocks(a2)
    assert num_cached == 8
    # 9 tokens need 3 blocks: a's two cached blocks plus the least recently freed other block
    assert kv.allocate_slots(a2, 1, hits)
    a2.num_computed_tokens = 9
    kv.check_integrity()
    free(kv, a2)
    # b's tail went to a2 and comes back with no key; a's blocks were freed after
    # b's head, so b's head is the next cached block to go
    admit(kv, make_request("e", [7] * 5))
    assert hit_tokens(kv, pb + [0]) == 0
    assert hit_tokens(kv, pa + [0]) == 8


def test_a_partial_block_is_reused_before_any_cached_block():
    kv = KVCacheManager(4, BS)
    a = make_request("a", blocks_of(2, 0))
    p = make_request("p", blocks_of(1, 100) + [1, 2])  # block 1 is partial: no key
    admit(kv, a)
    admit(kv, p)
    partial = kv.get_block_ids("p")[1]
    free(kv, a)
    free(kv, p)  # freed last, yet its partial block is handed out first
    n = make_request("n", [9])
    admit(kv, n)
    assert kv.get_block_ids("n") == [partial]
    assert hit_tokens(kv, blocks_of(2, 0) + [0]) == 8
    assert hit_tokens(kv, blocks_of(1, 100) + [0]) == 4


# -- failing allocations leave state alone ------------------------------------------

def test_can_allocate_false_leaves_state_unchanged():
    kv = KVCacheManager(4, BS)
    a = make_request("a", blocks_of(1, 0) + [1])
    admit(kv, a)  # 2 blocks held
    big = make_request("big", list(range(100, 113)))  # 13 tokens: 4 blocks, 2 are free
    hits, num_cached = kv.get_computed_blocks(big)
    before = snapshot(kv)
    assert kv.num_blocks_needed(big, 13, hits) == 4
    assert not kv.can_allocate(big, 13, hits)
    assert not kv.allocate_slots(big, 13, hits)
    kv.check_integrity()
    assert snapshot(kv) == before
    assert kv.get_block_ids("big") == []
    # a running request that cannot grow is left as it was too
    assert kv.allocate_slots(big, 8)
    big.num_computed_tokens = 8
    kv.check_integrity()
    before = snapshot(kv)
    assert not kv.allocate_slots(big, 5)
    kv.check_integrity()
    assert snapshot(kv) == before


def test_hits_on_free_cached_blocks_count_as_blocks_needed():
    # touching a free cached block takes it out of the free queue
    kv = KVCacheManager(2, BS)
    a = make_request("a", blocks_of(2, 0))
    admit(kv, a)
    free(kv, a)
    b = make_request("b", blocks_of(2, 0) + [1])
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8
    assert kv.num_blocks_needed(b, 1, hits) == 3
    before = snapshot(kv)
    assert not kv.allocate_slots(b, 1, hits)
    kv.check_integrity()
    assert snapshot(kv) == before
    # a hit on blocks that another request holds costs nothing
    kv3 = KVCacheManager(4, BS)
    holder = make_request("h", blocks_of(2, 0) + [5])
    admit(kv3, holder)
    c = make_request("c", blocks_of(2, 0) + [6, 7])
    hits, num_cached = kv3.get_computed_blocks(c)
    assert num_cached == 8 and kv3.num_blocks_needed(c, 2, hits) == 1
    assert kv3.allocate_slots(c, 2, hits)
    kv3.check_integrity()
    assert kv3.num_free_blocks == 0


# -- the checker itself -------------------------------------------------------------

def test_check_integrity_catches_a_wrong_ref_count():
    kv = KVCacheManager(4, BS)
    a = make_request("a", [1, 2, 3])
    admit(kv, a)
    kv.pool.blocks[kv.get_block_ids("a")[0]].ref_cnt = 2
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_check_integrity_catches_a_held_block_in_the_free_queue():
    kv = KVCacheManager(4, BS)
    a = make_request("a", [1, 2, 3])
    admit(kv, a)
    block = kv.pool.blocks[kv.get_block_ids("a")[0]]
    kv.pool.free_queue[block.block_id] = block
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_forked_sequences_share_blocks_and_copy_the_partial_one_on_write():
    """Parallel sampling: after the prefill (10 tokens: 2 full blocks + 2 tokens) three
    sequences share every block; the first two to write get their own copy of the partial
    block, the last keeps the original; full blocks are never copied."""
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    parent = Request("p", list(range(10)), SamplingParams(max_tokens=8, n=3, seed=1))
    admit(kv, parent)
    children = [parent.fork(i) for i in (1, 2)]
    for child in children:
        kv.fork(parent, child)
        kv.check_integrity()
    assert all(b.ref_cnt == 3 for b in kv.req_blocks["p"]) and kv.num_free_blocks == 12 - 3
    shared = list(kv.req_blocks["p"])
    copies = []
    for seq, token in zip([parent, *children], (50, 51, 52)):
        decode(kv, seq, token)
        copies += kv.take_copies()
    partial = shared[2].block_id
    # two copies of the partial block, into fresh blocks; the third writer owns it by then
    assert [src for src, _ in copies] == [partial, partial]
    assert kv.req_blocks[children[1].request_id][2].block_id == partial
    assert len({kv.req_blocks[s.request_id][2].block_id for s in [parent, *children]}) == 3
    assert all(kv.req_blocks[s.request_id][:2] == shared[:2] for s in [parent, *children])
    for seq in (parent, *children):  # each fills its own block on and frees it
        decode(kv, seq, 60)
        free(kv, seq)
    assert kv.num_free_blocks == 12


def test_a_fork_without_a_free_block_for_its_copy_waits():
    """The copy on write needs a block: with none free, allocation fails and changes nothing."""
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    parent = Request("p", list(range(10)), SamplingParams(max_tokens=8, n=2))
    admit(kv, parent)
    child = parent.fork(1)
    kv.fork(parent, child)
    child.all_token_ids.append(7)
    before = snapshot(kv)
    assert not kv.allocate_slots(child, 1)
    assert snapshot(kv) == before and kv.take_copies() == []


def test_block_hashes_are_the_same_in_every_process():
    """Replicas compare the prefixes they hold by block hash: a key made in another process
    (another address of None, another PYTHONHASHSEED) is the same key."""
    import subprocess
    import sys

    from tokenmill.engine.kv_cache import chain_block_keys

    tokens = list(range(40, 90))
    here = [key[0].hex() for key in chain_block_keys(None, tokens, 16, 0, 3)]
    code = ("from tokenmill.engine.kv_cache import chain_block_keys; "
            f"print(' '.join(k[0].hex() for k in chain_block_keys(None, {tokens}, 16, 0, 3)))")
    for seed in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.split()
        assert out == here
    assert len(set(here)) == 3
    # chained: the same block after another prefix is another key
    assert chain_block_keys(None, [1] + tokens[1:], 16, 0, 3)[2][0].hex() != here[2]
