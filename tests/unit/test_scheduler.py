"""Scheduler: token budget, max_num_seqs, chunked prefill, preemption by recompute,
fcfs | priority, the static baseline, stop conditions and aborts.

No model: `FakeRunner` plays the model runner. It keeps a shadow KV cache (one
fingerprint of the token prefix per slot), writes the scheduled tokens' slots
through the block table, then checks that every slot a request attends to holds
the right prefix. So a block handed out while still in use, a prefix hit on a
block that was never computed, or a block table that does not cover the tokens
fails the test, not just a wrong count. Its next token is a deterministic
function of the request's tokens, so a constrained run (preemption, small
budget) must produce exactly the tokens of an unconstrained one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import pytest

from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput
from tokenmill.sampling_params import SamplingParams


class StaleKVError(AssertionError):
    """FakeRunner read a K/V slot that does not hold the K/V of the request's prefix."""


def next_token(token_ids: list[int], vocab: int = 1000) -> int:
    return (sum(token_ids) * 31 + len(token_ids)) % vocab


class FakeRunner:
    """Plays ModelRunner.execute on a shadow KV cache (see module docstring)."""

    def __init__(self, block_size: int, vocab: int = 1000,
                 next_token_fn: Callable[[Request], int] | None = None) -> None:
        self.block_size = block_size
        self.vocab = vocab
        self.next_token_fn = next_token_fn
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> prefix fingerprint
        self.num_steps = 0
        self.last_samples: list[bool] = []  # out.samples(i) of the last step, taken before update

    @staticmethod
    def fingerprints(token_ids: list[int], n: int) -> list[int]:
        fps, h = [], 0
        for t in token_ids[:n]:
            h = hash((h, t))
            fps.append(h)
        return fps

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        rows = list(zip(out.requests, out.num_computed_tokens, out.num_scheduled_tokens, out.block_tables))
        fps = {}
        # every layer writes K/V of all scheduled tokens (drafts included) before attention reads any
        for (req, computed, n, table), drafts in zip(rows, out.spec_token_ids):
            assert n >= 1, f"{req.request_id} scheduled for {n} tokens"
            assert computed + n <= req.num_tokens + len(drafts), f"{req.request_id} scheduled past its last token"
            assert len(table) == math.ceil((computed + n) / bs), \
                f"{req.request_id}: table of {len(table)} blocks for {computed + n} tokens"
            fps[req.request_id] = self.fingerprints(req.all_token_ids + drafts, computed + n)
            for p in range(computed, computed + n):
                self.slots[(table[p // bs], p % bs)] = fps[req.request_id][p]
        sampled = []
        self.last_samples = [out.samples(i) for i in range(len(rows))]
        for i, (req, computed, n, table) in enumerate(rows):
            for p in range(computed + n):
                if self.slots.get((table[p // bs], p % bs)) != fps[req.request_id][p]:
                    raise StaleKVError(f"step {self.num_steps}: {req.request_id} reads a stale K/V at "
                                       f"position {p} (block {table[p // bs]}; computed {computed}, "
                                       f"scheduled {n})")
            if self.last_samples[i]:  # drafts are accepted while they are what the model would give
                drafts, ids, tokens = out.spec_token_ids[i], list(req.all_token_ids), []
                while True:
                    tok = self.next_token_fn(req) if self.next_token_fn else next_token(ids, self.vocab)
                    tokens.append((tok, None))
                    if len(tokens) > len(drafts) or drafts[len(tokens) - 1] != tok:
                        break
                    ids.append(tok)
                sampled.append(tokens)
        self.num_steps += 1
        return ModelRunnerOutput(sampled)


def make_request(rid: str, prompt: list[int], max_tokens: int = 4, priority: int = 0,
                 arrival_time: float | None = None, eos: tuple[int, ...] = (), **params) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=not eos, **params)
    return Request(rid, prompt, sp, eos_token_ids=eos, priority=priority,
                   arrival_time=0.0 if arrival_time is None else arrival_time)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 64, max_model_len: int = 1024,
                   enable_prefix_caching: bool = True, **kw) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len, **kw)


def check_output(sched: Scheduler, out: SchedulerOutput) -> None:
    """What every SchedulerOutput must satisfy."""
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(out.requests) <= sched.max_num_seqs
    assert len(sched.running) <= sched.max_num_seqs
    ids = [r.request_id for r in out.requests]
    assert len(ids) == len(set(ids))
    assert len(out.requests) == len(out.num_computed_tokens) == len(out.num_scheduled_tokens) \
        == len(out.block_tables)
    for req, computed, n, table, drafts in zip(out.requests, out.num_computed_tokens, out.num_scheduled_tokens,
                                               out.block_tables, out.spec_token_ids, strict=True):
        assert req.status == RequestStatus.RUNNING
        assert req in sched.running
        assert n >= 1 and computed + n <= req.num_tokens + len(drafts)
        assert not drafts or computed + n == req.num_tokens + len(drafts)  # drafts come after the known tokens
        assert req.num_computed_tokens == computed + n
        assert table == sched.kv.get_block_ids(req.request_id)
    if out.total_num_scheduled_tokens < sched.max_num_batched_tokens:
        # running requests are served first: one is left out only when the budget ran out
        assert set(ids) >= {r.request_id for r in sched.running}
    for req in out.preempted:
        assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
        assert sched.kv.get_block_ids(req.request_id) == []
        assert req.request_id not in ids


def check_between_steps(sched: Scheduler) -> None:
    sched.kv.check_integrity()
    bs = sched.kv.block_size
    for req in sched.running:
        assert req.status == RequestStatus.RUNNING
        assert len(sched.kv.get_block_ids(req.request_id)) == math.ceil(req.num_computed_tokens / bs)
    waiting = list(sched.waiting)
    for req in waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert sched.kv.get_block_ids(req.request_id) == []
    assert len(waiting) + len(sched.running) == len(sched.requests)


def step(sched: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    out = sched.schedule()
    sched.kv.check_integrity()
    check_output(sched, out)
    sampled = runner.execute(out)
    sched.update(out, sampled)
    check_between_steps(sched)
    return out


def run_all(sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000,
            on_step: Callable[[int, SchedulerOutput], None] | None = None) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        assert len(outs) < max_steps, f"not finished after {max_steps} steps: {list(sched.requests.values())}"
        outs.append(step(sched, runner))
        if on_step:
            on_step(len(outs) - 1, outs[-1])
    return outs


def reference_outputs(specs: Iterable[tuple], block_size: int = 4, **request_kw) -> dict[str, list[int]]:
    """Outputs of an unconstrained run: ample blocks, budget and seqs."""
    specs = list(specs)
    sched = make_scheduler(num_blocks=4096, block_size=block_size, max_num_seqs=1024,
                           max_num_batched_tokens=1 << 20)
    reqs = [make_request(*spec, **request_kw) for spec in specs]
    for r in reqs:
        sched.add_request(r)
    run_all(sched, FakeRunner(block_size))
    return {r.request_id: r.output_token_ids for r in reqs}


def add_all(sched: Scheduler, reqs: list[Request]) -> list[Request]:
    for r in reqs:
        sched.add_request(r)
    return reqs


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(out.requests, out.num_scheduled_tokens)}


def prompt(n: int, start: int = 0) -> list[int]:
    return [(start + i) % 97 + 1 for i in range(n)]


# -- budget and max_num_seqs -------------------------------------------------------

def test_token_budget_is_respected_and_used():
    sched = make_scheduler(max_num_batched_tokens=10)
    specs = [(f"r{i}", prompt(7 + i, 10 * i), 5) for i in range(6)]
    reqs = add_all(sched, [make_request(*s) for s in specs])
    runner = FakeRunner(4)
    outs = run_all(sched, runner)
    assert all(o.total_num_scheduled_tokens <= 10 for o in outs)
    assert outs[0].total_num_scheduled_tokens == 10  # enough demand: the budget is filled
    assert scheduled(outs[0]) == {"r0": 7, "r1": 3}  # r1's prompt is chunked to fit
    assert {r.request_id: r.output_token_ids for r in reqs} == reference_outputs(specs)


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=2)
    reqs = add_all(sched, [make_request(f"r{i}", prompt(3, i), max_tokens=2 + i) for i in range(5)])
    outs = run_all(sched, FakeRunner(4))
    assert all(len(o.requests) <= 2 for o in outs)
    # r0 (2 tokens) finishes in step 1; r2 takes its seat in step 2, not before
    assert [set(scheduled(o)) for o in outs[:3]] == [{"r0", "r1"}, {"r0", "r1"}, {"r1", "r2"}]
    assert all(r.finish_reason == "length" for r in reqs)


# -- chunked prefill --------------------------------------------------------------

def test_chunked_prefill_splits_a_long_prompt_and_mixes_decodes():
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(4)
    a = make_request("a", prompt(3), max_tokens=10)
    sched.add_request(a)
    step(sched, runner)  # a's prompt
    b = make_request("b", prompt(20, 50), max_tokens=2)
    sched.add_request(b)
    chunks, samples = [], []
    while b.num_computed_tokens < 20:
        out = step(sched, runner)
        n = scheduled(out)
        assert n["a"] == 1  # a decodes in every step of b's prefill
        chunks.append(n["b"])
        sampled_now = runner.last_samples[out.requests.index(b)]
        samples.append(sampled_now)
        assert b.num_tokens == (21 if sampled_now else 20)
    assert chunks == [7, 7, 6]
    assert samples == [False, False, True]
    assert b.output_token_ids == [next_token(prompt(20, 50))]
    run_all(sched, runner)
    assert a.output_token_ids == reference_outputs([("a", prompt(3), 10)])["a"]


def test_a_request_samples_only_when_its_prompt_completes():
    sched = make_scheduler(max_num_batched_tokens=5)
    runner = FakeRunner(4)
    r = make_request("r", prompt(12), max_tokens=3)
    sched.add_request(r)
    samples = []
    outs = run_all(sched, runner, on_step=lambda i, out: samples.append(runner.last_samples[0]))
    assert [o.num_scheduled_tokens[0] for o in outs] == [5, 5, 2, 1, 1]
    assert samples == [False, False, True, True, True]
    assert r.output_token_ids == reference_outputs([("r", prompt(12), 3)])["r"]


def test_without_chunked_prefill_only_whole_prompts_are_admitted():
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    runner = FakeRunner(4)
    a = make_request("a", prompt(3), max_tokens=3)
    sched.add_request(a)
    step(sched, runner)
    b = make_request("b", prompt(8, 30), max_tokens=2)  # 8 tokens > 7 left after a's decode
    c = make_request("c", prompt(2, 60), max_tokens=2)  # fits, but waits behind b (fcfs)
    add_all(sched, [b, c])
    while not a.is_finished:
        out = step(sched, runner)
        assert set(scheduled(out)) == {"a"}
    out = step(sched, runner)
    assert scheduled(out) == {"b": 8}
    assert scheduled(step(sched, runner)) == {"b": 1, "c": 2}
    run_all(sched, runner)


def test_chunked_prefill_admits_the_part_that_fits():
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(4)
    a = make_request("a", prompt(3), max_tokens=3)
    sched.add_request(a)
    step(sched, runner)
    sched.add_request(make_request("b", prompt(8, 30), max_tokens=2))
    assert scheduled(step(sched, runner)) == {"a": 1, "b": 7}


# -- prefix hits -------------------------------------------------------------------

def test_prefix_hit_sets_num_cached_and_num_computed_tokens():
    sched = make_scheduler()
    runner = FakeRunner(4)
    shared = prompt(8, 5)
    a = make_request("a", shared + [90, 91], max_tokens=2)
    sched.add_request(a)
    run_all(sched, runner)
    assert a.num_cached_tokens == 0
    b = make_request("b", shared + [92], max_tokens=2)
    c = make_request("c", prompt(8, 40) + [92], max_tokens=2)
    add_all(sched, [b, c])
    out = step(sched, runner)
    assert b.num_cached_tokens == 8 and c.num_cached_tokens == 0
    i = out.requests.index(b)
    assert out.num_computed_tokens[i] == 8 and out.num_scheduled_tokens[i] == 1
    assert out.block_tables[i][:2] == cached_prefix_blocks(sched, shared)
    run_all(sched, runner)
    assert b.output_token_ids == reference_outputs([("b", shared + [92], 2)])["b"]


def cached_prefix_blocks(sched: Scheduler, tokens: list[int]) -> list[int]:
    probe = make_request("probe", tokens + [0])
    hits, _ = sched.kv.get_computed_blocks(probe)
    sched.kv.free(probe)
    return [b.block_id for b in hits]


def test_identical_prompt_recomputes_only_its_last_token():
    sched = make_scheduler()
    runner = FakeRunner(4)
    p = prompt(9)
    a = make_request("a", p, max_tokens=1)
    sched.add_request(a)
    run_all(sched, runner)
    b = make_request("b", list(p), max_tokens=1)
    sched.add_request(b)
    out = step(sched, runner)
    assert scheduled(out) == {"b": 1} and b.num_cached_tokens == 8
    assert b.output_token_ids == a.output_token_ids


def test_without_prefix_caching_nothing_is_cached():
    sched = make_scheduler(enable_prefix_caching=False)
    runner = FakeRunner(4)
    p = prompt(9)
    sched.add_request(make_request("a", p, max_tokens=1))
    run_all(sched, runner)
    b = make_request("b", list(p), max_tokens=1)
    sched.add_request(b)
    assert scheduled(step(sched, runner)) == {"b": 9} and b.num_cached_tokens == 0


# -- preemption by recompute --------------------------------------------------------

def test_preemption_evicts_the_newest_running_request_to_the_front_of_the_queue():
    # 3 blocks of 4: a, b, c take one each; d waits; a's 5th token needs a block
    sched = make_scheduler(num_blocks=3, block_size=4)
    runner = FakeRunner(4)
    specs = [("a", prompt(4, 0), 6), ("b", prompt(3, 20), 3), ("c", prompt(3, 40), 3), ("d", prompt(3, 60), 3)]
    a, b, c, d = add_all(sched, [make_request(*s) for s in specs])
    out = step(sched, runner)
    assert set(scheduled(out)) == {"a", "b", "c"} and d.status == RequestStatus.WAITING
    c_output = list(c.output_token_ids)
    out = step(sched, runner)
    assert out.preempted == [c]
    assert scheduled(out) == {"a": 1, "b": 1}  # and nothing admitted in a step that preempted
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert c.output_token_ids == c_output  # generated tokens are kept
    assert list(sched.waiting) == [c, d]
    assert c.num_cached_tokens == 0
    run_all(sched, runner)
    assert {r.request_id: r.output_token_ids for r in (a, b, c, d)} == reference_outputs(specs)
    assert sched.kv.num_free_blocks == 3


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=2, block_size=4)
    runner = FakeRunner(4)
    specs = [("a", prompt(3), 3), ("b", prompt(4, 50), 3)]
    a, b = add_all(sched, [make_request(*s) for s in specs])
    step(sched, runner)
    out = step(sched, runner)  # a: position 3 fits; b: position 4 needs a third block
    assert out.preempted == [b] and scheduled(out) == {"a": 1}
    run_all(sched, runner)
    assert {r.request_id: r.output_token_ids for r in (a, b)} == reference_outputs(specs)


def test_a_resumed_request_gets_a_prefix_hit_on_its_own_blocks():
    sched = make_scheduler(num_blocks=5, block_size=2)
    runner = FakeRunner(2)
    specs = [("a", prompt(4), 4), ("b", prompt(3, 30), 4)]
    a, b = add_all(sched, [make_request(*s) for s in specs])
    resumed = []

    def on_step(i, out):
        for r, computed in zip(out.requests, out.num_computed_tokens):
            if r.num_preemptions and computed > 0 and r.request_id not in resumed:
                resumed.append(r.request_id)

    run_all(sched, runner, on_step=on_step)
    assert sched.num_preemptions > 0 and resumed
    assert {r.request_id: r.output_token_ids for r in (a, b)} == reference_outputs(specs, block_size=2)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_gives_the_same_tokens_as_an_unconstrained_run(policy, prefix_caching):
    specs = [(f"r{i}", prompt(5 + 3 * i, 7 * i), 12 - i) for i in range(6)]
    sched = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=16,
                           scheduling_policy=policy, enable_prefix_caching=prefix_caching)
    reqs = add_all(sched, [make_request(*s, priority=i % 3, arrival_time=float(i))
                           for i, s in enumerate(specs)])
    run_all(sched, FakeRunner(4))
    assert sched.num_preemptions > 0
    assert {r.request_id: r.output_token_ids for r in reqs} == reference_outputs(specs)
    assert sched.kv.num_free_blocks == 9


# -- priority ----------------------------------------------------------------------

def test_priority_admits_the_lowest_priority_value_first():
    sched = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    runner = FakeRunner(4)
    add_all(sched, [make_request("low", prompt(3), 1, priority=5, arrival_time=0.0),
                    make_request("high", prompt(3), 1, priority=0, arrival_time=2.0),
                    make_request("mid_late", prompt(3), 1, priority=1, arrival_time=3.0),
                    make_request("mid_early", prompt(3), 1, priority=1, arrival_time=1.0)])
    order = [out.requests[0].request_id for out in run_all(sched, runner)]
    assert order == ["high", "mid_early", "mid_late", "low"]


def test_fcfs_admits_in_arrival_order_whatever_the_priority():
    sched = make_scheduler(max_num_seqs=1)
    add_all(sched, [make_request("x", prompt(3), 1, priority=5),
                    make_request("y", prompt(3), 1, priority=0)])
    order = [out.requests[0].request_id for out in run_all(sched, FakeRunner(4))]
    assert order == ["x", "y"]


@pytest.mark.parametrize("policy, victim", [("fcfs", "y"), ("priority", "x")])
def test_preemption_victim_by_policy(policy, victim):
    # x (priority 2) runs first, y (priority 0) joins later: y is the newest, x the worst.
    # In step 4, x's decode fits its blocks; y's needs a new one and none is free.
    sched = make_scheduler(num_blocks=3, block_size=4, scheduling_policy=policy)
    runner = FakeRunner(4)
    x = make_request("x", prompt(5), max_tokens=6, priority=2, arrival_time=0.0)
    sched.add_request(x)
    step(sched, runner)
    y = make_request("y", prompt(3, 40), max_tokens=3, priority=0, arrival_time=1.0)
    sched.add_request(y)
    step(sched, runner)
    step(sched, runner)
    out = step(sched, runner)
    assert [r.request_id for r in out.preempted] == [victim]
    survivor = "x" if victim == "y" else "y"
    # the victim's tokens of this step go back to the budget; the survivor still runs
    assert scheduled(out) == {survivor: 1}
    assert sched.requests[victim].num_computed_tokens == 0
    run_all(sched, runner)
    ref = reference_outputs([("x", prompt(5), 6), ("y", prompt(3, 40), 3)])
    assert {"x": x.output_token_ids, "y": y.output_token_ids} == ref


@pytest.mark.parametrize("policy, victim, step5", [("priority", "x", {"y": 1, "z": 2}),
                                                   ("fcfs", "z", {"x": 1, "y": 1})])
def test_a_victim_scheduled_earlier_in_the_step_gives_back_its_budget(policy, victim, step5):
    # running [x (priority 2), y (0), z (1)], budget 3, 4 blocks of 4. In step 5 x's decode
    # fits its blocks and is scheduled first; y's needs a new block and none is free.
    # priority: the victim is x, already scheduled this step: its token goes back to the
    # budget, and z (after y in the list) still runs. fcfs: the victim is z, the newest.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=3, scheduling_policy=policy)
    runner = FakeRunner(4)
    specs = [("x", prompt(1), 6, 2, 0.0), ("y", prompt(2, 40), 4, 0, 1.0), ("z", prompt(4, 70), 4, 1, 2.0)]
    reqs = {s[0]: make_request(*s) for s in specs}
    sched.add_request(reqs["x"])
    step(sched, runner)
    step(sched, runner)
    add_all(sched, [reqs["y"], reqs["z"]])
    for _ in range(3):
        out = step(sched, runner)
        assert not out.preempted
    assert [r.request_id for r in sched.running] == ["x", "y", "z"]
    out = step(sched, runner)
    assert [r.request_id for r in out.preempted] == [victim]
    assert scheduled(out) == step5
    run_all(sched, runner)
    assert {rid: r.output_token_ids for rid, r in reqs.items()} == reference_outputs(s[:3] for s in specs)


def test_priority_victim_scheduled_earlier_in_the_step_leaves_no_uncomputed_block_cached():
    # block_size 1, 12 blocks, budget 6. v (priority 9) runs first; d (0) shares v's first
    # three tokens; b (5) is a long prompt in chunked prefill behind them.
    sched = make_scheduler(num_blocks=12, block_size=1, max_num_batched_tokens=6, scheduling_policy="priority")
    runner = FakeRunner(1)
    v1 = next_token([1, 2])
    v2 = next_token([1, 2, v1])
    v = make_request("v", [1, 2], 4, priority=9)
    sched.add_request(v)
    step(sched, runner)
    assert v.all_token_ids == [1, 2, v1]
    add_all(sched, [make_request("d", [1, 2, v1, 9, 9], 4, priority=0),
                    make_request("b", [4] * 8, 1, priority=5)])
    assert scheduled(step(sched, runner)) == {"v": 1, "d": 2, "b": 3}
    # step 3: v's decode (position 3, token v2) fills a new block, registered at once; then b
    # needs 3 blocks, 2 are free: v is preempted (frees only that block: the rest is shared
    # with d), b still does not fit and preempts itself. The step runs only d.
    out = step(sched, runner)
    assert [r.request_id for r in out.preempted] == ["v", "b"] and scheduled(out) == {"d": 1}
    # the K/V of v's position 3 was never computed, so [1, 2, v1, v2] must not be a prefix-cache
    # hit: the fake runner raises StaleKVError if c reads position 3 from the uncomputed block
    c = make_request("c", [1, 2, v1, v2, 8], 1, priority=0)
    sched.add_request(c)
    step(sched, runner)
    run_all(sched, runner)
    ref = reference_outputs([("c", [1, 2, v1, v2, 8], 1)], block_size=1)
    assert c.output_token_ids == ref["c"]


def test_a_preempted_request_keeps_its_place_by_priority_and_arrival():
    sched = make_scheduler(num_blocks=3, block_size=4, scheduling_policy="priority")
    runner = FakeRunner(4)
    x = make_request("x", prompt(5), max_tokens=6, priority=2, arrival_time=0.0)
    sched.add_request(x)
    step(sched, runner)
    y = make_request("y", prompt(3, 40), max_tokens=3, priority=0, arrival_time=1.0)
    sched.add_request(y)
    step(sched, runner)
    later = make_request("later", prompt(4, 70), max_tokens=1, priority=2, arrival_time=5.0)
    sched.add_request(later)
    step(sched, runner)
    out = step(sched, runner)
    assert out.preempted == [x]
    assert [r.request_id for r in sched.waiting] == ["x", "later"]


# -- static batching ------------------------------------------------------------------

def test_static_admits_a_new_batch_only_after_the_previous_one_finished():
    sched = make_scheduler(policy="static")
    runner = FakeRunner(4)
    a, b = add_all(sched, [make_request("a", prompt(3), 2), make_request("b", prompt(3, 9), 5)])
    out = step(sched, runner)
    assert set(scheduled(out)) == {"a", "b"}
    c = make_request("c", prompt(3, 30), 2)
    sched.add_request(c)
    while not (a.is_finished and b.is_finished):
        out = step(sched, runner)
        assert "c" not in scheduled(out)
        assert c.status == RequestStatus.WAITING
    assert a.is_finished and b.is_finished
    outs = run_all(sched, runner)
    assert "c" in scheduled(outs[0])
    assert c.output_token_ids == reference_outputs([("c", prompt(3, 30), 2)])["c"]


def test_continuous_admits_a_new_request_while_others_run():
    sched = make_scheduler()
    runner = FakeRunner(4)
    add_all(sched, [make_request("a", prompt(3), 2), make_request("b", prompt(3, 9), 5)])
    step(sched, runner)
    sched.add_request(make_request("c", prompt(3, 30), 2))
    assert scheduled(step(sched, runner)) == {"a": 1, "b": 1, "c": 3}


def test_static_batch_is_not_refilled_when_a_seat_frees_up():
    sched = make_scheduler(max_num_seqs=2, policy="static")
    runner = FakeRunner(4)
    a, b, c = add_all(sched, [make_request("a", prompt(3), 1), make_request("b", prompt(3, 9), 5),
                              make_request("c", prompt(3, 30), 1)])
    step(sched, runner)
    assert a.is_finished
    while not b.is_finished:
        assert "c" not in scheduled(step(sched, runner))
    run_all(sched, runner)
    assert c.output_token_ids == reference_outputs([("c", prompt(3, 30), 1)])["c"]


def test_static_batch_can_take_several_steps_to_admit_under_a_small_budget():
    sched = make_scheduler(max_num_batched_tokens=6, policy="static")
    runner = FakeRunner(4)
    a, b, c = add_all(sched, [make_request("a", prompt(5), 4), make_request("b", prompt(5, 9), 4),
                              make_request("c", prompt(5, 30), 4)])
    assert scheduled(step(sched, runner)) == {"a": 5, "b": 1}
    assert scheduled(step(sched, runner)) == {"a": 1, "b": 4, "c": 1}  # c still joins this batch
    d = make_request("d", prompt(2, 60), 1)
    sched.add_request(d)  # the batch is complete now: d waits for all of a, b, c
    while not all(r.is_finished for r in (a, b, c)):
        assert "d" not in scheduled(step(sched, runner))
    run_all(sched, runner)
    assert d.finish_reason == "length"


def test_static_next_batch_starts_in_the_step_right_after_the_last_one_finished():
    # regression: the batch used to reopen only after the admission check, costing an empty step
    sched = make_scheduler(policy="static")
    runner = FakeRunner(4)
    a = make_request("a", prompt(3), 2)
    sched.add_request(a)
    step(sched, runner)
    b = make_request("b", prompt(3, 30), 2)
    sched.add_request(b)
    step(sched, runner)
    assert a.is_finished and b.status == RequestStatus.WAITING
    out = step(sched, runner)
    assert scheduled(out) == {"b": 3}


# -- stop conditions -------------------------------------------------------------------

def scripted(script: dict[str, list[int]]) -> Callable[[Request], int]:
    return lambda r: script[r.request_id][r.num_output_tokens]


def run_scripted(reqs: list[Request], script: dict[str, list[int]], max_model_len: int = 1024) -> None:
    sched = make_scheduler(max_model_len=max_model_len)
    add_all(sched, reqs)
    run_all(sched, FakeRunner(4, next_token_fn=scripted(script)))
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and not sched.requests


def test_max_tokens_finishes_with_length():
    r = make_request("r", prompt(3), max_tokens=3)
    run_scripted([r], {"r": [5, 6, 7, 8, 9]})
    assert r.output_token_ids == [5, 6, 7]
    assert r.status == RequestStatus.FINISHED_LENGTH and r.finish_reason == "length"


def test_eos_finishes_with_stop_and_keeps_the_eos_token():
    r = make_request("r", prompt(3), max_tokens=10, eos=(2,))
    run_scripted([r], {"r": [5, 6, 2, 8, 9]})
    assert r.output_token_ids == [5, 6, 2]
    assert r.finish_reason == "stop" and r.stop_reason is None


def test_ignore_eos_runs_to_max_tokens():
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    r = Request("r", prompt(3), sp, eos_token_ids=(2,), arrival_time=0.0)
    run_scripted([r], {"r": [2, 2, 2, 2, 2]})
    assert r.output_token_ids == [2, 2, 2, 2] and r.finish_reason == "length"


def test_stop_token_ids_finish_with_stop_and_record_the_token():
    r = make_request("r", prompt(3), max_tokens=10, stop_token_ids=[7, 8])
    run_scripted([r], {"r": [5, 6, 8, 7, 9]})
    assert r.output_token_ids == [5, 6, 8]
    assert r.finish_reason == "stop" and r.stop_reason == 8


def test_min_tokens_holds_back_eos_and_stop_tokens():
    r = make_request("r", prompt(3), max_tokens=10, eos=(2,), min_tokens=3, stop_token_ids=[7])
    s = make_request("s", prompt(3, 9), max_tokens=10, eos=(2,), min_tokens=2)
    run_scripted([r, s], {"r": [2, 7, 7, 9], "s": [2, 2, 5]})
    assert r.output_token_ids == [2, 7, 7] and r.finish_reason == "stop" and r.stop_reason == 7
    assert s.output_token_ids == [2, 2] and s.finish_reason == "stop"


def test_max_model_len_finishes_with_length():
    r = make_request("r", prompt(6), max_tokens=100)
    run_scripted([r], {"r": list(range(10, 20))}, max_model_len=8)
    assert r.output_token_ids == [10, 11] and r.finish_reason == "length"


def test_finished_requests_free_their_blocks_and_leave_the_scheduler():
    sched = make_scheduler(num_blocks=8)
    runner = FakeRunner(4)
    a, b = add_all(sched, [make_request("a", prompt(9), 1), make_request("b", prompt(3, 40), 3)])
    step(sched, runner)
    assert a.is_finished and a.finish_time is not None
    assert sched.kv.get_block_ids("a") == [] and "a" not in sched.requests
    assert sched.kv.num_free_blocks == 8 - 1
    assert sched.running == [b]
    run_all(sched, runner)
    assert not sched.has_unfinished() and sched.kv.num_free_blocks == 8


# -- aborts ----------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_abort_a_waiting_request(policy):
    sched = make_scheduler(max_num_seqs=1, scheduling_policy=policy)
    runner = FakeRunner(4)
    a, b, c = add_all(sched, [make_request("a", prompt(3), 3), make_request("b", prompt(3, 9), 3),
                              make_request("c", prompt(3, 19), 3)])
    step(sched, runner)
    assert sched.finish_request("b", RequestStatus.FINISHED_ABORTED) is b
    check_between_steps(sched)
    assert b.finish_reason == "abort" and b.output_token_ids == []
    assert sched.num_waiting == 1 and "b" not in sched.requests
    assert sched.finish_request("b", RequestStatus.FINISHED_ABORTED) is None
    outs = run_all(sched, runner)
    assert all("b" not in scheduled(o) for o in outs)
    assert c.is_finished and sched.kv.num_free_blocks == sched.kv.num_blocks


def test_abort_a_running_request_frees_its_blocks():
    sched = make_scheduler(num_blocks=8)
    runner = FakeRunner(4)
    a, b = add_all(sched, [make_request("a", prompt(9), 5), make_request("b", prompt(3, 30), 5)])
    step(sched, runner)
    assert len(sched.kv.get_block_ids("a")) == 3
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    check_between_steps(sched)
    assert a.status == RequestStatus.FINISHED_ABORTED and a not in sched.running
    assert sched.kv.get_block_ids("a") == [] and sched.kv.num_free_blocks == 8 - 1
    assert scheduled(step(sched, runner)) == {"b": 1}
    run_all(sched, runner)
    assert sched.kv.num_free_blocks == 8


def test_abort_a_preempted_request():
    sched = make_scheduler(num_blocks=2, block_size=4)
    runner = FakeRunner(4)
    a, b = add_all(sched, [make_request("a", prompt(3), 3), make_request("b", prompt(4, 50), 3)])
    step(sched, runner)
    assert step(sched, runner).preempted == [b]
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    check_between_steps(sched)
    assert sched.num_waiting == 0 and b.finish_reason == "abort"
    run_all(sched, runner)
    assert sched.kv.num_free_blocks == 2 and not sched.kv.req_keys


def test_abort_between_schedule_and_update_keeps_the_others_tokens_aligned():
    sched = make_scheduler()
    runner = FakeRunner(4)
    specs = [("a", prompt(3), 3), ("b", prompt(3, 30), 3)]
    a, b = add_all(sched, [make_request(*s) for s in specs])
    out = sched.schedule()
    sampled = runner.execute(out)
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    changed = sched.update(out, sampled)
    sched.kv.check_integrity()
    assert changed == [b] and a.output_token_ids == []
    run_all(sched, runner)
    assert b.output_token_ids == reference_outputs(specs)["b"]


def test_duplicate_request_id_is_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt(3)))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", prompt(4)))


# -- bookkeeping ------------------------------------------------------------------------

def test_fake_runner_catches_a_block_table_that_points_at_someone_elses_kv():
    # the oracle used everywhere here must be able to fail
    sched = make_scheduler()
    runner = FakeRunner(4)
    add_all(sched, [make_request("a", prompt(5), 3), make_request("b", prompt(5, 40), 3)])
    step(sched, runner)
    out = sched.schedule()
    out.block_tables[1] = list(out.block_tables[0])
    with pytest.raises(AssertionError, match="stale K/V"):
        runner.execute(out)


def test_prefix_hit_statistics_count_each_admission_once():
    sched = make_scheduler(num_blocks=2, block_size=4)
    runner = FakeRunner(4)
    p = prompt(8)
    a, b = add_all(sched, [make_request("a", p, 1), make_request("b", list(p), 1)])
    run_all(sched, runner)
    # a: 8 tokens, no hit; b (admitted after a finished): 8 tokens, 4 hit
    assert (sched.kv.prefix_queries, sched.kv.prefix_hits) == (16, 4)
