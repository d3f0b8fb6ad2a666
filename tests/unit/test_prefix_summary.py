"""The prefix-cache summary and the standalone router's pure parts (no model, no server):
the log a server keeps from its cores' events, its incremental reads, what a router parses
from it, the --backend check, the load read from /metrics, the prompt a router routes by."""

from __future__ import annotations

import json
import random

import pytest

from tokenmill.config import DEFAULT_MODEL_DIR
from tokenmill.engine.detokenizer import load_tokenizer
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.router.backends import _queued_requests, backend_url
from tokenmill.router.prefix import PrefixRouter, prompt_block_hashes
from tokenmill.router.server import prompt_of
from tokenmill.router.summary import PrefixCacheLog, Summary, pack_hashes
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.chat import chat_prompt_ids
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import ChatCompletionRequest

BS = 16


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 8000) for _ in range(n)]


def _cache_prompt(kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
    """A prompt allocated and registered in the cache, then freed (its blocks stay cached)."""
    request = Request(rid, tokens, SamplingParams(max_tokens=1))
    assert kv.allocate_slots(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    kv.free(request)


def test_the_log_holds_what_the_cache_holds_and_reads_incrementally():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    kv.pool.events = []
    log = PrefixCacheLog(BS)
    a, b = _prompt(1, 5 * BS), _prompt(2, 5 * BS)
    _cache_prompt(kv, "a", a)
    log.apply(0, kv.pool.take_events())
    first = log.summary()
    assert first["reset"] and first["num_blocks"] == 5 and first["block_size"] == BS
    assert Summary.parse(first).stored == prompt_block_hashes(a, BS)
    _cache_prompt(kv, "b", b)  # 8 blocks: b's 5 evict 2 of a's (its tail first)
    log.apply(0, kv.pool.take_events())
    held = {k[0] for k in kv.pool.cached}
    assert log.held == held and len(held) == 8
    changes = Summary.parse(log.summary(first["cursor"]))
    assert not changes.reset
    assert set(changes.stored) == set(prompt_block_hashes(b, BS))
    assert set(changes.removed) == set(prompt_block_hashes(a, BS)) - held
    mirror = PrefixRouter(1, BS)  # a router's mirror, kept from the two reads, equals the cache
    mirror.apply_events(0, Summary.parse(first).events())
    mirror.apply_events(0, changes.events())
    assert set(mirror.held[0]) == held
    nothing = Summary.parse(log.summary(changes.cursor))
    assert not nothing.reset and nothing.stored == nothing.removed == []


def test_a_foreign_or_stale_cursor_gets_a_snapshot():
    log = PrefixCacheLog(BS, max_changes=4)
    hashes = prompt_block_hashes(_prompt(3, 8 * BS), BS)
    cursor = log.summary()["cursor"]
    log.apply(0, [(True, h) for h in hashes[:3]])
    assert not log.summary(cursor)["reset"]
    log.apply(0, [(True, h) for h in hashes[3:]])  # 8 changes since the cursor, 4 kept
    stale = Summary.parse(log.summary(cursor))
    assert stale.reset and set(stale.stored) == set(hashes)
    other = PrefixCacheLog(BS)  # a restarted server: another epoch
    assert Summary.parse(other.summary(stale.cursor)).reset
    for bad in ("", "nonsense", f"{log.epoch}:x", f"{log.epoch}:999"):
        assert log.summary(bad)["reset"]


def test_replicas_are_a_union_and_a_dead_one_takes_only_its_own():
    log = PrefixCacheLog(BS)
    shared, own0, own1 = (prompt_block_hashes(_prompt(s, 2 * BS), BS) for s in (4, 5, 6))
    log.apply(0, [(True, h) for h in shared + own0])
    log.apply(1, [(True, h) for h in shared + own1])
    assert log.held == set(shared + own0 + own1)
    cursor = log.summary()["cursor"]
    log.apply(0, None)  # replica 0 died
    assert log.held == set(shared + own1)
    changes = Summary.parse(log.summary(cursor))
    assert set(changes.removed) == set(own0) and changes.stored == []
    log.apply(1, [(False, shared[0]), (False, shared[0])])  # a repeated removal changes nothing more
    assert log.held == set(shared[1:] + own1)


def test_malformed_summaries_are_refused():
    good = PrefixCacheLog(BS).summary()
    with pytest.raises(ValueError, match="multiple of 16"):
        Summary.parse({**good, "stored": pack_hashes([b"x" * 8])})
    with pytest.raises(ValueError, match="malformed"):
        Summary.parse({k: v for k, v in good.items() if k != "cursor"})
    with pytest.raises(ValueError):
        Summary.parse({**good, "removed": "not base64!"})
    with pytest.raises(ValueError, match="hashes of 8 bytes"):
        Summary.parse({**good, "hash_bytes": 8})


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://h:1", "http://", "http://h:99999", "http://h:x",
                                 "http://h:1/?a=1", "h"])
def test_backend_urls_are_checked(url):
    with pytest.raises(ValueError, match="--backend: expected"):
        backend_url(url)


def test_backend_urls_lose_a_trailing_slash():
    assert backend_url("http://10.0.0.2:8000/") == "http://10.0.0.2:8000"
    assert backend_url("https://host/prefix") == "https://host/prefix"


def test_load_is_read_from_a_servers_metrics():
    metrics = ServerMetrics("m")
    metrics.running.set(3)
    metrics.waiting.set(4)
    assert _queued_requests(metrics.render().decode()) == 7


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL_DIR)


def test_the_router_tokenizes_as_the_server_does(tokenizer):
    ids = tokenizer.encode("def f(x):", add_special_tokens=True)
    assert prompt_of(tokenizer, "/v1/completions", b'{"prompt": "def f(x):", "stream": true}') == (ids, True)
    assert prompt_of(tokenizer, "/v1/completions", b'{"prompt": ["def f(x):", "b"]}') == (ids, False)
    assert prompt_of(tokenizer, "/v1/completions", b'{"prompt": [[5, 6], [7]]}') == ([5, 6], False)
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "stream": True}
    expected = chat_prompt_ids(tokenizer, ChatCompletionRequest.model_validate(chat))
    assert prompt_of(tokenizer, "/v1/chat/completions", json.dumps(chat).encode()) == (expected, True)
    # what a server would refuse is routed by load alone (the server answers the error)
    for path, body in (("/v1/completions", b"{not json"), ("/v1/completions", b'{"prompt": 5}'),
                       ("/v1/completions", b"[1, 2]"), ("/v1/chat/completions", b'{"messages": []}'),
                       ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image"}]}]}')):
        assert prompt_of(tokenizer, path, body)[0] == []
