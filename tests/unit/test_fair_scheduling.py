"""scheduling_policy="fair": priority lanes, then VTC between tenants (engine/request_queue.py).

No model: a real Scheduler and KVCacheManager driven by test_scheduler's FakeRunner, whose
shadow KV cache catches a stale slot. Service is measured here from what each step ran
(prompt tokens computed the first time, output tokens appended), not read from the queue's
counters, and compared with the bound that VTC promises two backlogged tenants.

The bound for these workloads (all requests: prompt L, max_tokens T; at most S running;
prompts computed whole at admission; no lifts while both tenants stay backlogged). Let c_x
be tenant x's counter = its weighted service (w_p * prompt + w_q * output tokens) / weight_x.
At x's last admission it had the smallest counter, so right after it c_x <= c_y + w_p L / w_x;
since then c_x grew only by the outputs of its running requests, at most S * T tokens, and
c_y did not fall. So c_x - c_y <= D_x = (w_p L + w_q S T) / w_x at all times, and over any
interval in which both are backlogged the weighted services differ by at most D_a + D_b
(the paper's 2 * max(w_p L_input, w_q M), made concrete for this batch).
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.config import EngineConfig
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.request_queue import FairQueue, make_request_queue
from tokenmill.engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput
from tokenmill.sampling_params import SamplingParams

from .test_scheduler import (FakeRunner, check_between_steps, check_output, make_scheduler, next_token, prompt,
                             run_all, scheduled, step)
from .test_scheduler_properties import Driver, configs, ops, reference

W_P, W_Q = 1.0, 2.0


def request(rid: str, tenant: str | None, tokens: list[int], max_tokens: int = 8, weight: float = 1.0,
            priority: int = 0, arrival: float = 0.0, **params) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    return Request(rid, tokens, sp, priority=priority, arrival_time=arrival, tenant=tenant, tenant_weight=weight)


class Meter:
    """Each tenant's weighted service, from what the steps ran."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.runner = FakeRunner(sched.kv.block_size)
        self.requests: dict[str, Request] = {}
        self.prompt_done: dict[str, int] = {}  # request id -> prompt tokens counted
        self.prompt = defaultdict(int)  # tenant -> prompt tokens served

    def add(self, *reqs: Request) -> None:
        for r in reqs:
            self.requests[r.request_id] = r
            self.sched.add_request(r)

    def step(self) -> SchedulerOutput:
        out = step(self.sched, self.runner)
        for r, computed, n in zip(out.requests, out.num_computed_tokens, out.num_scheduled_tokens):
            # a prefix hit (the first computed position) and a recomputation are not service
            done = self.prompt_done.setdefault(r.request_id, computed)
            end = min(computed + n, r.num_prompt_tokens)
            self.prompt[r.tenant] += max(0, end - max(done, computed))
            self.prompt_done[r.request_id] = max(done, end)
        for _, child in out.forked:
            self.requests[child.request_id] = child
        return out

    def service(self, tenant: str) -> float:
        reqs = [r for r in self.requests.values() if r.tenant == tenant]
        out = sum(r.num_output_tokens for r in reqs)
        return (W_P * self.prompt[tenant] + W_Q * out) / reqs[0].tenant_weight

    def tokens(self, tenant: str) -> int:
        return self.prompt[tenant] + sum(r.num_output_tokens for r in self.requests.values() if r.tenant == tenant)

    def backlogged(self, *tenants: str) -> bool:
        return all(any(r.tenant == t for r in self.sched.waiting) for t in tenants)


def max_service_gap(meter: Meter, a: str, b: str, start: float = 0.0) -> tuple[float, int]:
    """Steps while both tenants are backlogged; returns the largest difference of their weighted
    service over any interval of them, and the number of steps."""
    gaps = [meter.service(a) - meter.service(b) - start]
    while meter.backlogged(a, b):
        meter.step()
        gaps.append(meter.service(a) - meter.service(b) - start)
    return max(gaps) - min(gaps), len(gaps) - 1


L, T, S = 8, 8, 4


def two_tenants(policy: str, n: int = 40) -> Meter:
    sched = make_scheduler(num_blocks=256, block_size=4, max_num_seqs=S, max_num_batched_tokens=64,
                           enable_prefix_caching=False, scheduling_policy=policy)
    meter = Meter(sched)
    meter.add(*[request(f"a{i}", "a", prompt(L, i), T, weight=2.0, arrival=i) for i in range(n)])
    meter.add(*[request(f"b{i}", "b", prompt(L, 50 + i), T, weight=1.0, arrival=n + i) for i in range(n)])
    return meter


def test_weights_two_to_one_share_within_the_vtc_bound():
    bound = (W_P * L + W_Q * S * T) * (1 / 2.0 + 1 / 1.0)  # D_a + D_b = 36 + 72
    meter = two_tenants("fair")
    gap, num_steps = max_service_gap(meter, "a", "b")
    assert num_steps > 100 and gap <= bound
    ratio = meter.tokens("a") / meter.tokens("b")
    assert ratio == pytest.approx(2.0, abs=0.15)  # tokens, unweighted: the weights' 2:1
    run_all(meter.sched, meter.runner)
    # fcfs on the same workload: a's backlog runs first and b gets nothing meanwhile
    meter = two_tenants("fcfs")
    gap_fcfs, _ = max_service_gap(meter, "a", "b")
    assert gap_fcfs > 2 * bound and meter.tokens("b") == 0


def test_a_late_tenant_is_admitted_soon_and_does_not_catch_up():
    for policy in ("fair", "fcfs"):
        sched = make_scheduler(num_blocks=256, block_size=4, max_num_seqs=S, max_num_batched_tokens=64,
                               enable_prefix_caching=False, scheduling_policy=policy)
        meter = Meter(sched)
        meter.add(*[request(f"a{i}", "a", prompt(L, i), T, arrival=i) for i in range(60)])
        for _ in range(30):
            meter.step()
        missed = meter.service("a")  # what b could claim if its counter stayed at 0
        meter.add(*[request(f"b{i}", "b", prompt(L, 70 + i), T, arrival=100 + i) for i in range(20)])
        if policy == "fair":  # lifted to the smallest counter of the backlogged tenants: a's
            assert sched.waiting.counters == {"a": missed, "b": missed}
        b0, waited = meter.requests["b0"], 0
        while b0.status == RequestStatus.WAITING:
            meter.step()
            waited += 1
        if policy == "fcfs":
            assert waited > 60  # behind all of a's backlog
            continue
        assert waited <= T  # at the next seats to free up (a request finishes at least every T steps)
        # from here on the two share 1:1 within the bound; b does not replay what it missed
        start = meter.service("a") - meter.service("b")
        tokens_a = meter.tokens("a")
        gap, num_steps = max_service_gap(meter, "a", "b", start)
        assert num_steps > 20 and gap <= 2 * (W_P * L + W_Q * S * T) < missed
        assert (meter.tokens("a") - tokens_a) / meter.tokens("b") == pytest.approx(1.0, abs=0.3)
        run_all(sched, meter.runner)


def _run_step(d: Driver, trace: list) -> None:
    out = d.sched.schedule()
    d.sched.kv.check_integrity()
    check_output(d.sched, out)
    trace.append((scheduled(out), [r.request_id for r in out.preempted], out.block_tables))
    d.sched.update(out, d.runner.execute(out))
    check_between_steps(d.sched)


@settings(max_examples=150, deadline=None)
@given(cfg=configs(), operations=ops, tenant=st.sampled_from([None, "", "t"]), weight=st.sampled_from([1.0, 3.0]))
def test_one_tenant_is_scheduled_exactly_as_fcfs(cfg, operations, tenant, weight):
    """Same requests, steps and aborts: the same SchedulerOutput every step, the same tokens."""
    runs = []
    for policy in ("fcfs", "fair"):
        d = Driver(dict(cfg, scheduling_policy=policy))
        trace: list = []
        reqs: list[Request] = []
        for op, arg in operations:
            if op == "add":
                r = request(f"r{len(reqs)}", tenant, arg["prompt"], arg["max_tokens"], weight=weight,
                            arrival=float(len(reqs)))
                reqs.append(r)
                d.sched.add_request(r)
            elif op == "step":
                for _ in range(arg):
                    _run_step(d, trace)
            elif reqs:
                d.sched.finish_request(reqs[arg % len(reqs)].request_id, RequestStatus.FINISHED_ABORTED)
        while d.sched.has_unfinished():
            _run_step(d, trace)
        runs.append((trace, [r.output_token_ids for r in reqs]))
    assert runs[0] == runs[1]


# -- tenants, lanes, preemption, prefix caching, chunked prefill: invariants and outputs ----

TENANTS = {"a": 1.0, "b": 2.0, "c": 0.5, None: 1.0}


@settings(max_examples=300, deadline=None)
@given(cfg=configs(), operations=ops, tenants=st.lists(st.sampled_from(list(TENANTS)), min_size=40, max_size=40))
def test_fair_keeps_the_cache_consistent_and_outputs_exact(cfg, operations, tenants):
    """test_scheduler_properties' random workloads (small pools: preemption; shared heads:
    prefix hits; chunked prefill; static batches; aborts) with tenants of different weights in
    priority lanes: after every step the KV cache's integrity and the scheduler's invariants
    hold, no step idles with work left, and every output equals an unconstrained run."""
    d = Driver(dict(cfg, scheduling_policy="fair"))
    sched = d.sched
    specs: dict[str, dict] = {}
    reqs: dict[str, Request] = {}
    for op, arg in operations:
        if op == "add":
            rid = f"r{len(specs)}"
            tenant = tenants[len(specs)]
            specs[rid] = arg
            sp = SamplingParams(max_tokens=arg["max_tokens"], ignore_eos=arg["ignore_eos"],
                                min_tokens=arg["min_tokens"])
            reqs[rid] = Request(rid, arg["prompt"], sp, eos_token_ids=(0,), priority=arg["priority"],
                                arrival_time=float(len(specs)), tenant=tenant, tenant_weight=TENANTS[tenant])
            sched.add_request(reqs[rid])
        elif op == "step":
            for _ in range(arg):
                d.step()
        elif reqs:
            sched.finish_request(list(reqs)[arg % len(reqs)], RequestStatus.FINISHED_ABORTED)
            check_between_steps(sched)
    d.finish()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and not sched.waiting and not sched.requests
    ref = reference(cfg, specs)
    for rid, r in reqs.items():
        n = r.num_output_tokens
        assert r.output_token_ids == (ref[rid][:n] if r.status == RequestStatus.FINISHED_ABORTED else ref[rid])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_blocks, budget", [(64, 64), (12, 64), (8, 16)])
def test_service_is_new_prompt_tokens_and_appended_outputs(seed, num_blocks, budget):
    """Counters = (w_p * prompt tokens not hit in the prefix cache at first admission + w_q *
    output tokens of every sequence, accepted drafts included) / weight, with preemption
    (recomputation is not service), prefix hits, chunked prefill, forks (n=2, the children
    charged to the parent's tenant) and speculative drafts; outputs equal a plain run."""
    rng = random.Random(seed)
    w_p, w_q = 0.5, 3.0
    kv = make_scheduler(num_blocks=num_blocks, block_size=4).kv
    sched = Scheduler(kv, 16, budget, 1024, scheduling_policy="fair",
                      fair_prompt_token_weight=w_p, fair_output_token_weight=w_q)
    runner = ForkingRunner(4)
    shared = prompt(8, 40)
    reqs = [request(f"r{i}", "ab"[i % 2], (shared if rng.random() < 0.5 else []) + prompt(rng.randint(1, 9), 7 * i),
                    rng.randint(1, 10), weight=(1.0, 4.0)[i % 2], n=1 + (i % 3 == 0), seed=i)
            for i in range(10)]
    for r in reqs:
        sched.add_request(r)
    seqs = list(reqs)
    while sched.has_unfinished():
        out = sched.schedule()  # not test_scheduler's step: its checks do not know forks
        sched.kv.check_integrity()
        sched.update(out, runner.execute(out))
        check_between_steps(sched)
        seqs += [child for _, child in out.forked]
        for r in sched.running:  # random drafts, some right, for the decoding requests
            room = r.max_tokens - r.num_output_tokens - 1
            if r.num_computed_tokens == r.num_tokens - 1 and room > 0:
                ids = list(r.all_token_ids)
                for _ in range(min(3, room)):
                    ids.append(next_token(ids) if rng.random() < 0.6 else rng.randrange(1000))
                r.spec_token_ids = ids[r.num_tokens:]
    assert len(seqs) > len(reqs) and sched.num_accepted_tokens > 0
    if num_blocks < 64:
        assert sched.num_preemptions > 0
    expected: dict[str | None, float] = defaultdict(float)
    for r in seqs:
        prompt_service = w_p * (r.num_prompt_tokens - r.num_cached_tokens) if r.parent is None else 0.0
        expected[r.tenant] += (prompt_service + w_q * r.num_output_tokens) / r.tenant_weight
        assert r.output_token_ids == _plain(r)
    assert isinstance(sched.waiting, FairQueue)
    assert sched.waiting.counters == pytest.approx(expected)


class ForkingRunner(FakeRunner):
    """FakeRunner, plus copy on write of shared blocks and the first token of each sequence
    forked this step (from its parent's row)."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for src, dst in out.block_copies:
            for offset in range(self.block_size):
                if (src, offset) in self.slots:
                    self.slots[(dst, offset)] = self.slots[(src, offset)]
        sampled = super().execute(out).sampled
        return ModelRunnerOutput(sampled + [[(next_token(seq.all_token_ids), None)] for _, seq in out.forked])


def _plain(r: Request) -> list[int]:
    ids = list(r.prompt_token_ids)
    for _ in range(r.max_tokens):
        ids.append(next_token(ids))
    return ids[r.num_prompt_tokens:]


def test_a_better_lane_is_admitted_first_whatever_the_counters():
    sched = make_scheduler(max_num_seqs=1, scheduling_policy="fair")
    runner = FakeRunner(4)
    sched.add_request(request("heavy", "b", prompt(9), 6))  # b's counter grows first
    step(sched, runner)
    for rid, tenant, prio in [("a_low1", "a", 1), ("a_low2", "a", 1), ("b_high", "b", 0), ("c_low", "c", 1)]:
        sched.add_request(request(rid, tenant, prompt(3, len(rid)), 1, priority=prio, arrival=1.0))
    order = [out.requests[0].request_id for out in run_all(sched, runner)]
    # b_high's lane first though b has the largest counter; in lane 1, VTC between a and c
    assert [rid for i, rid in enumerate(order) if i == 0 or rid != order[i - 1]] == \
        ["heavy", "b_high", "a_low1", "c_low", "a_low2"]


@pytest.mark.parametrize("x_lane, y_lane, victim", [(0, 0, "x"), (0, 2, "y"), (2, 0, "x")])
def test_victim_is_from_the_worst_lane_then_the_largest_counter(x_lane, y_lane, victim):
    # x (tenant a) runs first, y (tenant b, weight 4) joins later; in step 4 y's decode needs a
    # new block and none is free. b's counter is lifted to a's when y arrives (5 + 1 output * 2,
    # nobody else waits), then grows 4 times slower: in one lane x goes, though y is the newest
    # (fcfs takes y); a worse lane goes first whatever the counters.
    sched = make_scheduler(num_blocks=3, block_size=4, scheduling_policy="fair")
    runner = FakeRunner(4)
    x = request("x", "a", prompt(5), 6, priority=x_lane)
    y = request("y", "b", prompt(3, 40), 3, weight=4.0, priority=y_lane, arrival=1.0)
    sched.add_request(x)
    step(sched, runner)
    sched.add_request(y)
    assert isinstance(sched.waiting, FairQueue) and sched.waiting.counters == {"a": 7.0, "b": 7.0}
    step(sched, runner)
    step(sched, runner)
    assert sched.waiting.counters == {"a": 7.0 + 2 * 2, "b": 7.0 + (3 + 2 * 2) / 4}
    out = step(sched, runner)
    assert [r.request_id for r in out.preempted] == [victim]
    run_all(sched, runner)
    assert x.output_token_ids == _plain(x) and y.output_token_ids == _plain(y)


# -- configuration and the engine ------------------------------------------------------------

@pytest.mark.parametrize("field", ["fair_prompt_token_weight", "fair_output_token_weight"])
@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, True, "2"])
def test_fair_weights_must_be_finite_and_positive(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number > 0"):
        EngineConfig(**{field: value})


def test_policies_by_name():
    assert EngineConfig(scheduling_policy="fair", fair_output_token_weight=4).fair_output_token_weight == 4
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, fair"):
        EngineConfig(scheduling_policy="vtc")
    assert isinstance(make_request_queue("fair", 1.0, 3.0), FairQueue)
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_request_queue("lottery")


def test_fair_changes_the_order_never_the_tokens(checkpoints):
    """float32 greedy, two tenants (weights 1 and 3, two lanes) in a KV cache of 80 tokens
    (preemption): the same tokens as fcfs; every output carries its tenant."""
    from tokenmill import LLM
    from tokenmill.sampling_params import ParamError

    prompts = [[7 + i] * (5 + 3 * i) for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    tenants = ["a", "a", "a", "a", "b", "b"]
    results, orders = {}, {}
    for policy in ("fcfs", "fair"):
        llm = LLM(str(checkpoints("llama")), dtype="float32", block_size=4, kv_cache_memory=80 * 512,
                  scheduling_policy=policy)
        engine = llm.engine
        if policy == "fcfs":
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, tenant=tenants)
        else:  # by hand: LLM.generate takes no weights
            for i, p in enumerate(prompts):
                req, _ = engine.make_request(p, params, tenant=tenants[i], priority=i % 2,
                                             tenant_weight=3.0 if tenants[i] == "b" else 1.0)
                engine.add_request(req, final_only=True)
            done = {}
            while engine.has_unfinished_requests():
                done.update({o.request_id: o for o in engine.step() if o.finished})
            outs = [done[rid] for rid in sorted(done, key=int)]
            with pytest.raises(ParamError) as e:
                engine.make_request([1, 2], params, tenant_weight=0.0)
            assert e.value.param == "tenant_weight"
        assert engine.scheduler.num_preemptions > 0
        assert [o.tenant for o in outs] == tenants
        results[policy] = [o.outputs[0].token_ids for o in outs]
        orders[policy] = sorted(range(len(outs)), key=lambda i: outs[i].metrics.finished_time)
    assert orders["fair"] != orders["fcfs"]
    assert results["fair"] == results["fcfs"]


def test_a_tenant_is_lifted_to_the_tenants_of_its_own_lane():
    """The counter lift compares a tenant with those it competes with: the backlogged tenants
    of its lane, not a lower counter waiting in another lane."""
    from tokenmill.engine.request_queue import FairQueue

    queue = FairQueue()
    queue.counters.update({"low-lane": 1000.0, "high-lane": 50.0})

    def request(rid: str, tenant: str, priority: int) -> Request:
        return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), priority=priority, tenant=tenant)

    queue.add(request("a", "high-lane", 0))
    queue.add(request("b", "low-lane", 10))
    queue.add(request("c", "newcomer", 10))
    assert queue.counters["newcomer"] == 1000.0
