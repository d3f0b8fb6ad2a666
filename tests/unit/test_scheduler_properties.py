"""Property tests: random add / step / abort sequences against small KV pools.

Prompts come from a few shared heads plus tails over a tiny alphabet, so prefix
hits are common; pools are small, so preemption is common. After every
operation the cache and the scheduler must agree (check_integrity and the
checks of test_scheduler), every step must respect the budget and max_num_seqs,
the shadow-KV FakeRunner must read only correct K/V, and in the end every
request finishes, no block leaks, and every output equals the output of an
unconstrained run (an aborted request's output is a prefix of it).
"""

from __future__ import annotations

import math

from hypothesis import event, given, settings
from hypothesis import strategies as st

from tokenmill.engine.kv_cache import KVCacheManager, chain_block_keys
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams

from .test_scheduler import FakeRunner, check_between_steps, check_output, next_token

VOCAB = 8  # the fake runner's tokens: small, so eos (token 0) comes up
EOS = 0
MAX_PROMPT = 12
MAX_OUTPUT = 6
HEADS = [[], [1, 2, 3, 1, 2, 3, 1, 2], [1, 2, 3, 1, 4, 4], [2, 2, 2, 2], [3]]


def continued(tokens: list[int], n: int) -> list[int]:
    """`tokens` followed by what the fake runner generates after them: a prompt that
    hits blocks holding another request's generated tokens."""
    tokens = list(tokens)
    for _ in range(n):
        tokens.append(next_token(tokens, VOCAB))
    return tokens


prompts = st.builds(lambda head, tail: (head + tail)[:MAX_PROMPT] or [1],
                    st.builds(continued, st.sampled_from(HEADS), st.sampled_from([0, 0, 2, 5])),
                    st.lists(st.integers(1, 4), max_size=6))


@st.composite
def request_specs(draw):
    max_tokens = draw(st.integers(1, MAX_OUTPUT))
    return {"prompt": draw(prompts), "max_tokens": max_tokens,
            "ignore_eos": draw(st.booleans()), "min_tokens": draw(st.integers(0, min(2, max_tokens))),
            "priority": draw(st.integers(0, 2))}


@st.composite
def configs(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    # every request fits the pool alone (the engine rejects those that do not)
    min_blocks = math.ceil((MAX_PROMPT + MAX_OUTPUT) / block_size)
    chunked = draw(st.booleans())
    max_len = MAX_PROMPT + MAX_OUTPUT
    return {
        "num_blocks": draw(st.integers(min_blocks, min_blocks + 4)),
        "block_size": block_size,
        "max_num_seqs": draw(st.integers(1, 6)),
        # without chunking a resumed request recomputes prompt + output in one step
        "max_num_batched_tokens": draw(st.integers(2, 40) if chunked else st.integers(max_len, 48)),
        "max_model_len": draw(st.sampled_from([MAX_PROMPT + 3, 1024])),
        "policy": draw(st.sampled_from(["continuous", "static"])),
        "scheduling_policy": draw(st.sampled_from(["fcfs", "priority"])),
        "enable_prefix_caching": draw(st.booleans()),
        "enable_chunked_prefill": chunked,
    }


_add = st.tuples(st.just("add"), request_specs())
_step = st.tuples(st.just("step"), st.integers(1, 4))
_abort = st.tuples(st.just("abort"), st.integers(0, 100))
ops = st.lists(st.one_of(_add, _add, _step, _step, _abort), min_size=4, max_size=40)


def build(cfg: dict) -> Scheduler:
    kv = KVCacheManager(cfg["num_blocks"], cfg["block_size"], cfg["enable_prefix_caching"])
    return Scheduler(kv, cfg["max_num_seqs"], cfg["max_num_batched_tokens"], cfg["max_model_len"],
                     policy=cfg["policy"], scheduling_policy=cfg["scheduling_policy"],
                     enable_chunked_prefill=cfg["enable_chunked_prefill"])


def make_request(rid: str, spec: dict, arrival: float) -> Request:
    sp = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=spec["ignore_eos"],
                        min_tokens=spec["min_tokens"])
    return Request(rid, spec["prompt"], sp, eos_token_ids=(EOS,), priority=spec["priority"],
                   arrival_time=arrival)


def check_sharing(sched: Scheduler) -> None:
    """A block in two tables must be a cached full block (shared only by a prefix hit)."""
    holders: dict[int, int] = {}
    for rid in sched.kv.req_blocks:
        for b in sched.kv.get_block_ids(rid):
            holders[b] = holders.get(b, 0) + 1
    for b, n in holders.items():
        block = sched.kv.pool.blocks[b]
        assert block.ref_cnt == n
        if n > 1:
            assert sched.kv.enable_prefix_caching and block.key is not None, block
    if not sched.kv.enable_prefix_caching:
        assert not sched.kv.pool.cached


class Driver:
    def __init__(self, cfg: dict) -> None:
        self.sched = build(cfg)
        self.runner = FakeRunner(cfg["block_size"], vocab=VOCAB)

    def step(self) -> None:
        sched = self.sched
        busy = sched.has_unfinished()
        out = sched.schedule()
        sched.kv.check_integrity()
        check_output(sched, out)
        if out.preempted:
            event("preempted")
        if any(r.num_cached_tokens > 0 for r in out.requests):
            event("prefix hit")
        sched.update(out, self.runner.execute(out))
        check_between_steps(sched)
        check_sharing(sched)
        # liveness: every request fits the pool alone, so a step with work left is never empty
        assert out.requests or not busy, "the scheduler idled with work left"

    def finish(self, max_steps: int = 3000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps: {list(self.sched.requests.values())}")


def reference(cfg: dict, specs: dict[str, dict]) -> dict[str, list[int]]:
    """Outputs with ample blocks, budget and seqs (same max_model_len)."""
    kv = KVCacheManager(4096, cfg["block_size"], True)
    sched = Scheduler(kv, 4096, 1 << 20, cfg["max_model_len"])
    reqs = [make_request(rid, spec, 0.0) for rid, spec in specs.items()]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(cfg["block_size"], vocab=VOCAB)
    while sched.has_unfinished():
        out = sched.schedule()
        assert not out.preempted
        sched.update(out, runner.execute(out))
    return {r.request_id: r.output_token_ids for r in reqs}


def play(cfg: dict, operations: list) -> None:
    d = Driver(cfg)
    sched = d.sched
    specs: dict[str, dict] = {}
    reqs: dict[str, Request] = {}
    for op, arg in operations:
        if op == "add":
            rid = f"r{len(specs)}"
            specs[rid] = arg
            reqs[rid] = make_request(rid, arg, float(len(specs)))
            sched.add_request(reqs[rid])
        elif op == "step":
            for _ in range(arg):
                d.step()
        elif reqs:
            victim = reqs[list(reqs)[arg % len(reqs)]]
            was = victim.status
            got = sched.finish_request(victim.request_id, RequestStatus.FINISHED_ABORTED)
            assert (got is None) == was.finished
            if got is not None:
                event(f"abort {was.name}")
                assert victim.status == RequestStatus.FINISHED_ABORTED
                assert sched.kv.get_block_ids(victim.request_id) == []
        sched.kv.check_integrity()
        check_between_steps(sched)
        check_sharing(sched)
    d.finish()
    kv = sched.kv
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    assert not kv.req_blocks and not kv.req_keys and not kv.req_num_registered
    assert not sched.running and not sched.waiting and not sched.requests
    ref = reference(cfg, specs)
    for rid, r in reqs.items():
        assert r.is_finished
        if r.status == RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == ref[rid][:r.num_output_tokens]
        else:
            assert r.output_token_ids == ref[rid], rid
            assert r.finish_reason in ("stop", "length")


@settings(max_examples=300, deadline=None)
@given(cfg=configs(), operations=ops)
def test_random_workloads_keep_the_cache_consistent_and_outputs_exact(cfg, operations):
    play(cfg, operations)


@settings(max_examples=200, deadline=None)
@given(cfg=configs(), specs=st.lists(request_specs(), min_size=2, max_size=8))
def test_tight_pool_all_requests_at_once(cfg, specs):
    # the least room every request needs: preemption is the rule, not the exception
    cfg = dict(cfg, num_blocks=math.ceil((MAX_PROMPT + MAX_OUTPUT) / cfg["block_size"]))
    play(cfg, [("add", s) for s in specs] + [("step", 1)])


@settings(max_examples=200, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4]), caching=st.booleans(),
       actions=st.lists(st.tuples(st.sampled_from(["admit", "decode", "free", "preempt"]),
                                  st.integers(0, 5), prompts), max_size=40))
def test_kv_cache_random_admit_decode_free(block_size, caching, actions):
    """KVCacheManager alone: hits always name the right tokens and chain; no leak."""
    kv = KVCacheManager(64 // block_size, block_size, caching)
    live: dict[int, Request] = {}
    for action, slot, tokens in actions:
        req = live.get(slot)
        if action == "admit" and req is None:
            req = Request(f"q{slot}", tokens, SamplingParams(max_tokens=8, ignore_eos=True))
            hits, num_cached = kv.get_computed_blocks(req)
            assert num_cached == len(hits) * block_size < req.num_tokens
            want = chain_block_keys(None, req.all_token_ids, block_size, 0, len(hits))
            assert [b.key for b in hits] == want
            if not caching:
                assert not hits
            if kv.allocate_slots(req, req.num_tokens - num_cached, hits):
                req.num_computed_tokens = req.num_tokens
                live[slot] = req
            else:
                kv.free(req)
        elif action == "decode" and req is not None:
            req.all_token_ids.append(len(req.all_token_ids) % 5)
            if kv.allocate_slots(req, 1):
                req.num_computed_tokens += 1
            else:
                req.all_token_ids.pop()
        elif action in ("free", "preempt") and req is not None:
            kv.free(req, finished=action == "free")
            del live[slot]
            if action == "preempt":
                kv.free(req)  # forget its keys too: it is not coming back here
        kv.check_integrity()
        for r in live.values():
            assert len(kv.get_block_ids(r.request_id)) == math.ceil(r.num_computed_tokens / block_size)
    for r in live.values():
        kv.free(r)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_blocks and not kv.req_keys
