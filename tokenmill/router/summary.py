"""The prefix-cache summary: which blocks a server's caches hold, served as
`GET /v1/prefix_cache?since=CURSOR` for a router on another host (router/server.py).

The server keeps it from the events its engine cores report with each step (the same
(stored?, hash) events a data-parallel front mirrors), so it is what the caches really
hold, a step late at most. A router polls it incrementally:

    GET /v1/prefix_cache                 -> reset: true,  stored: every hash held,  cursor c1
    GET /v1/prefix_cache?since=c1        -> reset: false, stored: added since c1 and held now,
                                            removed: dropped since c1 and not held now, cursor c2

A cursor names the server's life (a random epoch) and how many changes it has seen; one
from another life (the server restarted) or too far behind (its changes no longer kept)
gets a full snapshot (reset: true) instead. Hashes are the 16-byte chained block hashes
(kv_cache.block_hash), concatenated and base64-encoded: about 21 bytes a block.
With several engine cores (data parallel) the summary is their union: a router sends the
request to this server, whose own front then picks the replica.
"""

from __future__ import annotations

import base64
import secrets
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Any

HASH_BYTES = 16  # kv_cache.block_hash's digest length


class PrefixCacheLog:
    """The union of what a server's engine cores hold, and the order in which it changed.
    `max_changes`: how many changes are kept for incremental reads (older cursors get a
    snapshot). Fed and read on the event loop."""

    def __init__(self, block_size: int, enabled: bool = True, max_changes: int = 1 << 16) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self.epoch = secrets.token_hex(6)
        self._count: dict[bytes, int] = {}  # hash -> how many cores hold it
        self._replicas: dict[int, set[bytes]] = {}
        self._changes: deque[bytes] = deque(maxlen=max_changes)  # hashes that came or went, oldest first
        self._num_changes = 0

    @property
    def held(self) -> set[bytes]:
        return set(self._count)

    def apply(self, replica: int, events: list[tuple[bool, bytes]] | None) -> None:
        """An engine core's (stored?, hash) events; None: the core is gone with all it held."""
        held = self._replicas.setdefault(replica, set())
        if events is None:
            events = [(False, h) for h in held]
        for stored, h in events:
            if stored and h not in held:
                held.add(h)
                self._count[h] = self._count.get(h, 0) + 1
                if self._count[h] == 1:
                    self._changed(h)
            elif not stored and h in held:
                held.discard(h)
                self._count[h] -= 1
                if not self._count[h]:
                    del self._count[h]
                    self._changed(h)

    def _changed(self, h: bytes) -> None:
        self._changes.append(h)
        self._num_changes += 1

    def summary(self, since: str | None = None) -> dict[str, Any]:
        """The JSON body of GET /v1/prefix_cache: what changed since the cursor `since`, or
        everything held when `since` is None, unknown or too old."""
        behind = self._behind(since)
        if behind is None:
            stored, removed = list(self._count), []
        else:
            touched = set(islice(reversed(self._changes), behind))
            stored = [h for h in touched if h in self._count]
            removed = [h for h in touched if h not in self._count]
        return {"object": "prefix_cache", "block_size": self.block_size, "enabled": self.enabled,
                "hash_bytes": HASH_BYTES, "num_blocks": len(self._count), "reset": behind is None,
                "cursor": f"{self.epoch}:{self._num_changes}", "stored": pack_hashes(stored),
                "removed": pack_hashes(removed)}

    def _behind(self, since: str | None) -> int | None:
        """How many changes the cursor has not seen; None when only a snapshot will do."""
        epoch, _, seen = (since or "").partition(":")
        if epoch != self.epoch or not seen.isdigit():
            return None
        behind = self._num_changes - int(seen)
        return behind if 0 <= behind <= len(self._changes) else None


def pack_hashes(hashes: list[bytes]) -> str:
    return base64.b64encode(b"".join(hashes)).decode("ascii")


def unpack_hashes(text: str) -> list[bytes]:
    """The hashes of a summary's `stored` or `removed`; raises ValueError if malformed."""
    raw = base64.b64decode(text, validate=True)
    if len(raw) % HASH_BYTES:
        raise ValueError(f"prefix-cache summary: {len(raw)} bytes of hashes is not a multiple of {HASH_BYTES}")
    return [raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]


@dataclass(frozen=True, slots=True)
class Summary:
    """A summary as a router reads it."""

    block_size: int
    reset: bool
    cursor: str
    stored: list[bytes]
    removed: list[bytes]

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Summary:
        """Raises ValueError (KeyError, TypeError included) when `body` is not a summary."""
        try:
            if body["hash_bytes"] != HASH_BYTES:
                raise ValueError(f"prefix-cache summary: hashes of {body['hash_bytes']} bytes, expected {HASH_BYTES}")
            return cls(int(body["block_size"]), bool(body["reset"]), str(body["cursor"]),
                       unpack_hashes(body["stored"]), unpack_hashes(body["removed"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"prefix-cache summary: malformed body ({type(e).__name__}: {e})") from e

    def events(self) -> list[tuple[bool, bytes]]:
        """As PrefixRouter.apply_events takes them (after a clear, when `reset`)."""
        return [(False, h) for h in self.removed] + [(True, h) for h in self.stored]
