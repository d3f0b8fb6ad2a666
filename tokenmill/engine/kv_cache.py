"""Paged KV cache bookkeeping: a block pool with reference counts, per-request
block tables, and prefix caching keyed by chained block hashes.

Pure Python: this module never touches tensors. The model runner owns the
tensors; a block id here is an index into them.

Prefix caching: a *full* block is keyed by (sha256(parent hash, token ids), token
ids), so a key names the whole prefix up to and including that block. The hash is
the same in every process and on every machine (Python's `hash()` of a tuple holding
None is not, before 3.12), so replicas can compare the prefixes they hold. A block
whose ref count drops to zero keeps its key and stays findable until the pool
hands it out again; the free queue is in LRU order, so the least recently
freed cached block is evicted first.

    request tokens:  [t0 .. t15][t16 .. t31][t32 .. t39 ....]
    block table:     [   b7    ][   b2     ][   b9          ]
    keys:            [   k0    ][ k1(k0)   ]  (partial: no key)

Parallel sampling forks a request after its prefill: the sequences share every block
by reference count, and the first one to write into a shared partial last block gets
its own copy (copy on write: `take_copies` hands the runner the (source, destination)
block pairs to copy before the step's forward). Full blocks are never written again,
so they are never copied.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tokenmill.engine.block_table import BlockTableRows
from tokenmill.engine.request import Request

BlockKey = tuple[bytes, tuple[int, ...]]  # (chained hash, token ids of the block)


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "key")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: BlockKey | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.key is not None})"


def chain_block_keys(parent: BlockKey | None, token_ids: Sequence[int], block_size: int,
                     start: int, num_blocks: int) -> list[BlockKey]:
    """Keys of the full blocks [start, start + num_blocks) of `token_ids`, chained from `parent`."""
    keys = []
    parent_hash = b"" if parent is None else parent[0]
    for i in range(start, start + num_blocks):
        tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent_hash = block_hash(parent_hash, tokens)
        keys.append((parent_hash, tokens))
    return keys


def block_hash(parent_hash: bytes, tokens: Sequence[int]) -> bytes:
    """The chained hash of a full block: 16 bytes of sha256 over the parent's hash (b"" for
    the first block) and the block's token ids as int32. Stable across processes and
    machines; about 4 us a block on the CPU here (Python's hash: 0.6 us)."""
    return hashlib.sha256(parent_hash + array("i", tokens).tobytes()).digest()[:16]


class BlockPool:
    """All KV blocks, their ref counts, the LRU free queue and the prefix-cache map."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> block, least recently freed first
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockKey, KVBlock] = {}
        # a list to collect (stored?, hash) as blocks become findable or stop being so, for a
        # data-parallel router that sends requests where their prefix is; None: not collected
        self.events: list[tuple[bool, bytes]] | None = None

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def take(self, n: int) -> list[KVBlock]:
        """Hands out n free blocks, evicting the least recently used cached ones."""
        assert n <= len(self.free_queue), (n, len(self.free_queue))
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self.unregister(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Adds a reference to blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference; blocks reaching zero join the free queue.

        Cached blocks go to the back (evicted last); blocks with no key hold
        nothing reusable and go to the front, to be handed out first.
        """
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.key is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def unregister(self, block: KVBlock) -> None:
        if block.key is not None:
            del self.cached[block.key]
            if self.events is not None:
                self.events.append((False, block.key[0]))
            block.key = None

    def register(self, block: KVBlock, key: BlockKey) -> None:
        """Makes a full block findable by its key (first writer wins on duplicates)."""
        if block.key is None and key not in self.cached:
            block.key = key
            self.cached[key] = block
            if self.events is not None:
                self.events.append((True, key[0]))

    def take_events(self) -> list[tuple[bool, bytes]]:
        """The events collected since the last call, oldest first."""
        events, self.events = self.events or [], [] if self.events is not None else None
        return events


class KVCacheManager:
    """Block tables of the running requests over one BlockPool.

    The scheduler asks `get_computed_blocks` (prefix hit) and `can_allocate`,
    then acts with `allocate_slots` and `free`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the same, as ids: each step's block tables
        self.tables = BlockTableRows()  # and again, as rows of one array
        self.req_keys: dict[str, list[BlockKey]] = {}  # keys of the request's full blocks so far
        self.req_num_registered: dict[str, int] = {}  # how many of its blocks are in the cache map
        self.pending_copies: list[tuple[int, int]] = []  # copy on write, for the next step
        # prefix-cache statistics, in tokens
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- questions ---------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a request that has nothing computed yet.

        At least one token is always left to compute: its logits give the next token.
        """
        if not self.enable_prefix_caching:
            return [], 0
        keys = self._keys(request)
        max_hit = (request.num_tokens - 1) // self.block_size
        hits = []
        for key in keys[:max_hit]:
            block = self.pool.cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          new_computed_blocks: Sequence[KVBlock] = ()) -> int:
        """Free blocks that allocate_slots would take from the pool."""
        held = len(self.req_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        new = max(0, -(-(num_computed + num_new_tokens) // self.block_size) - held)
        # hits with no holder sit in the free queue: touching them takes them out of it
        return new + sum(1 for b in new_computed_blocks if b.ref_cnt == 0) + self._needs_copy(request)

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: Sequence[KVBlock] = ()) -> bool:
        return self.num_blocks_needed(request, num_new_tokens, new_computed_blocks) <= self.pool.num_free

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table: a copy of the ids kept as blocks come and go (a list copy,
        not a pass over its blocks each step)."""
        return list(self.req_block_ids.get(request_id, ()))

    # -- actions -----------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = ()) -> bool:
        """Gives the request room for `num_new_tokens` more tokens, after taking
        `new_computed_blocks` (a prefix hit) into its table. False if it does not fit;
        then nothing changed."""
        blocks = self.req_blocks.get(request.request_id)
        if blocks and not new_computed_blocks:  # most decode steps: the blocks it holds have room
            computed, bs = request.num_computed_tokens, self.block_size
            end = computed + num_new_tokens
            # (_needs_copy, written out: this runs for every request in every step)
            if end <= len(blocks) * bs and not (computed % bs and blocks[computed // bs].ref_cnt > 1):
                known = min(end, len(request.all_token_ids))
                if self.enable_prefix_caching and known // bs > self.req_num_registered.get(request.request_id, 0):
                    self._register_full_blocks(request, known)
                return True
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks):
            return False
        if self.enable_prefix_caching and request.request_id not in self.req_blocks:
            # admission: count the lookup once, not at every peek of a request that then waited
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(new_computed_blocks) * self.block_size
        if self._needs_copy(request):
            self._copy_on_write(request)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        ids = self.req_block_ids.setdefault(request.request_id, [])
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = -(-(num_computed + num_new_tokens) // self.block_size)
        if total > len(blocks):
            blocks.extend(self.pool.take(total - len(blocks)))
        start = len(ids)
        ids.extend(b.block_id for b in blocks[start:])
        self.tables.write(request.request_id, start, ids[start:])
        if self.enable_prefix_caching:
            # Tokens scheduled this step are known already, so their full blocks can be
            # registered now: the runner writes K/V before any attention reads it.
            self._register_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return True

    def register_known(self, request: Request) -> None:
        """Makes findable the full blocks of tokens computed (or scheduled) before they were
        known: async scheduling computes a token sampled by the step before, so its block could
        not be keyed when it was scheduled."""
        num_tokens = min(request.num_computed_tokens, len(request.all_token_ids))
        rid = request.request_id
        # most steps fill no block: one lookup, then nothing
        if self.enable_prefix_caching and num_tokens // self.block_size > self.req_num_registered.get(rid, 0) \
                and rid in self.req_blocks:
            self._register_full_blocks(request, num_tokens)

    def free(self, request: Request, finished: bool = True) -> None:
        """Releases a request's blocks (last block first, so a prompt's tail is evicted
        before its shared head). A preempted request keeps its block keys."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, [])
        self.req_block_ids.pop(rid, None)
        self.tables.drop(rid)
        # Blocks registered for tokens that were scheduled but never computed (a request
        # preempted in the very step that scheduled it) must not stay findable: their
        # K/V was never written. Only this request can hold them, as they are past its
        # computed prefix and lookups happen only at admission.
        for block in blocks[request.num_computed_tokens // self.block_size:self.req_num_registered.get(rid, 0)]:
            self.pool.unregister(block)
        self.pool.release(reversed(blocks))
        self.req_num_registered.pop(rid, None)
        if finished:
            self.req_keys.pop(rid, None)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Speculative decoding: releases the request's blocks past its first `num_tokens`
        tokens (those that held only rejected drafts; never registered, as drafts are not
        part of the request's tokens when its blocks are keyed)."""
        blocks = self.req_blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is not None and len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            del self.req_block_ids[request.request_id][keep:]
            self.tables.truncate(request.request_id, keep)
            self.pool.release(reversed(extra))

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares all of the parent's blocks (one more reference each)."""
        blocks = self.req_blocks[parent.request_id]
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = list(blocks)
        self.req_block_ids[child.request_id] = list(self.req_block_ids[parent.request_id])
        self.tables.write(child.request_id, 0, self.req_block_ids[child.request_id])
        self.req_keys[child.request_id] = list(self.req_keys.get(parent.request_id, ()))
        self.req_num_registered[child.request_id] = self.req_num_registered.get(parent.request_id, 0)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies the next step must make before it writes."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block that no request holds."""
        for block in self.pool.free_queue.values():
            self.pool.unregister(block)

    # -- internals ---------------------------------------------------------
    def _needs_copy(self, request: Request) -> bool:
        """The request's next token goes into a partial block that other sequences share."""
        blocks = self.req_blocks.get(request.request_id)
        offset = request.num_computed_tokens % self.block_size
        return bool(blocks) and offset != 0 and blocks[request.num_computed_tokens // self.block_size].ref_cnt > 1

    def _copy_on_write(self, request: Request) -> None:
        blocks = self.req_blocks[request.request_id]
        i = request.num_computed_tokens // self.block_size
        shared = blocks[i]
        [own] = self.pool.take(1)
        self.pool.release([shared])
        blocks[i] = own
        self.req_block_ids[request.request_id][i] = own.block_id
        self.tables.write(request.request_id, i, (own.block_id,))
        self.pending_copies.append((shared.block_id, own.block_id))

    def _keys(self, request: Request) -> list[BlockKey]:
        keys = self.req_keys.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        if num_full > len(keys):
            keys.extend(chain_block_keys(keys[-1] if keys else None, request.all_token_ids,
                                         self.block_size, len(keys), num_full - len(keys)))
        return keys

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        start = self.req_num_registered.get(rid, 0)
        num_full = num_tokens // self.block_size
        if num_full <= start:
            return
        keys = self._keys(request)
        blocks = self.req_blocks[rid]
        for i in range(start, num_full):
            self.pool.register(blocks[i], keys[i])
        self.req_num_registered[rid] = num_full

    def check_integrity(self) -> None:
        """Raises AssertionError if the pool and the block tables disagree."""
        holders: dict[int, int] = {}
        assert self.req_block_ids.keys() == self.req_blocks.keys(), "block-id tables and block lists disagree"
        assert self.tables.rows.keys() == self.req_blocks.keys(), "table rows and block lists disagree"
        for rid, blocks in self.req_blocks.items():
            ids = [b.block_id for b in blocks]
            assert self.req_block_ids[rid] == ids, f"request {rid}'s block-id table is stale"
            row = self.tables.array[self.tables.rows[rid]]
            assert row[:len(ids)].tolist() == ids and not row[len(ids):].any(), f"request {rid}'s table row is stale"
            assert len(ids) == len(set(ids)), f"request {rid} holds a block twice: {ids}"
            for i in ids:
                holders[i] = holders.get(i, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), \
                f"{block} is held by {holders.get(block.block_id, 0)} requests"
            in_free = block.block_id in self.pool.free_queue
            assert in_free == (block.ref_cnt == 0), f"{block} free-queue membership is wrong"
            if block.key is not None:
                assert self.pool.cached.get(block.key) is block, f"{block} has a key the cache map lacks"
        for key, block in self.pool.cached.items():
            assert block.key == key, f"cache map entry points at {block} with another key"
        assert len(self.pool.free_queue) + len(holders) == self.num_blocks
