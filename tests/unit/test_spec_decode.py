"""Speculative decoding without a model: the config's errors, prompt-lookup drafts, rejection
sampling's distribution, and the scheduler's tokens-with-spec bookkeeping (scheduling drafts, rolling back rejected ones,
freeing their blocks) on test_scheduler's FakeRunner, whose shadow KV cache catches a stale
slot, and whose outputs must equal a run without drafts."""

from __future__ import annotations

import random

import numpy as np
import pytest
import scipy.stats
import torch

from tests.unit.test_sampler import batch as sampler_batch
from tests.unit.test_scheduler import FakeRunner, make_request, make_scheduler, next_token, step
from tokenmill.config import EngineConfig
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.executor.sampler import Sampler
from tokenmill.executor.spec.adaptive import (CATCH_UP_STEPS, DOUBTFUL_CATCH_UP_STEPS, StepCost, acceptance,
                                              choose_num_drafts)
from tokenmill.executor.spec.calibration import Calibration
from tokenmill.executor.spec.ngram import TokenArrays, propose, propose_batch
from tokenmill.executor.spec.proposer import can_speculate
from tokenmill.executor.spec.rejection import accepted_prefix


@pytest.mark.parametrize("spec, message", [
    ({"method": "eagle3", "num_speculative_tokens": 2},
     "speculative_config.method must be one of ngram, draft_model, eagle; got 'eagle3'"),
    ({"num_speculative_tokens": 2}, "speculative_config.method must be one of"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "a draft model is for methods 'draft_model' and 'eagle'"),
    ({"method": "draft_model", "model": 3, "num_speculative_tokens": 2}, "speculative_config.model must be"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in [1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens must be an integer in [1, 16]"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer in [1, 16], got None"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_min must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive must be true or false"),
])
def test_bad_speculative_config_names_the_key(spec, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(speculative_config=spec)
    assert message in str(e.value)


def test_a_model_without_a_method_is_a_draft_model_or_an_eagle_head_by_its_name():
    """As vLLM: a head named like the EAGLE authors' (EAGLE-LLaMA3-Instruct-8B) is an EAGLE head."""
    method = lambda model: EngineConfig(speculative_config={  # noqa: E731
        "model": model, "num_speculative_tokens": 2}).speculative_config.method
    assert method("yuhuili/EAGLE-LLaMA3-Instruct-8B") == "eagle"
    assert method("/ckpt/tiny-draft") == "draft_model"


def test_lookup_defaults_follow_vllm():
    cfg = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).speculative_config
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    cfg = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                           "prompt_lookup_max": 3}).speculative_config
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (3, 3)


def test_ngram_takes_the_latest_of_the_longest_matches():
    t = np.array([1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3])
    # "1 2 3" (n = 3) occurs at 0; "2 3" also at 6, later, but shorter
    assert propose(t, 1, 3, 4) == [4, 5, 9, 2]
    assert propose(t, 1, 2, 4) == [7, 1, 2, 3]  # n <= 2: the latest "2 3"
    assert propose(t, 1, 3, 2) == [4, 5]  # k caps the drafts
    assert propose(t, 4, 5, 4) == []  # no 4-gram repeats
    assert propose(np.array([8, 8, 8, 8]), 1, 3, 5) == [8]  # only what follows the match exists
    assert propose(np.array([1, 2, 3]), 1, 3, 2) == []
    assert propose(t, 1, 3, 0) == []


def lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, one n at a time: for the longest n in [min_n, max_n] whose last n
    tokens occurred earlier, the up to k tokens after their latest earlier occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if k <= 0 or len(tokens) < n + 1:
            continue
        tail = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tail]
        if starts:
            return tokens[starts[-1] + n:starts[-1] + n + k]
    return []


def test_batched_lookup_equals_the_definition_for_every_row():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, vocab, size=length).tolist()
            for vocab, length in [(3, 40), (5, 2), (4, 1), (2, 300), (50, 60), (6, 7), (3, 3)] * 4]
    for min_n, max_n in [(1, 1), (1, 3), (2, 4), (3, 5)]:
        ks = [int(k) for k in rng.integers(0, 6, size=len(seqs))]
        got = propose_batch([np.array(t) for t in seqs], min_n, max_n, ks)
        assert got == [lookup(t, min_n, max_n, k) for t, k in zip(seqs, ks)], (min_n, max_n)


def test_token_arrays_grow_with_the_request():
    request = make_request("r", [5, 6, 7])
    arrays = TokenArrays()
    assert arrays.get(request).tolist() == request.all_token_ids
    for t in range(200):
        request.all_token_ids.extend([t] * (t % 3))
        assert arrays.get(request).tolist() == request.all_token_ids
    arrays.release("r")
    assert not arrays.arrays


def test_acceptance_stops_at_the_first_difference():
    rows = [(5, "a"), (6, "b"), (7, "c"), (8, "d")]
    assert accepted_prefix([5, 6, 7], rows) == rows  # all three and the bonus token
    assert accepted_prefix([5, 9, 7], rows) == rows[:2]  # the target's 6 replaces the draft 9
    assert accepted_prefix([1, 6, 7], rows) == rows[:1]
    assert accepted_prefix([], rows[:1]) == rows[:1]


def test_what_rules_speculation_out():
    assert can_speculate(make_request("g", [1, 2], temperature=0)) is None
    assert can_speculate(make_request("s", [1, 2], temperature=0.8, seed=1)) is None
    assert can_speculate(make_request("p", [1, 2], temperature=0, presence_penalty=0.5)) == "penalties"
    assert can_speculate(make_request("m", [1, 2], temperature=0, min_tokens=3)) == "min_tokens"
    assert can_speculate(make_request("b", [1, 2], temperature=0, n=2)) == "best_of"


def drafts_for(request, rng: random.Random, k: int) -> list[int]:
    """Drafts as a proposer might make them: the true continuation for a while, then noise."""
    ids, out = list(request.all_token_ids), []
    right = rng.randint(0, k)
    for j in range(rng.randint(0, k)):
        tok = next_token(ids) if j < right else rng.randrange(1000)
        out.append(tok)
        ids.append(tok)
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size, num_blocks, budget", [(4, 64, 64), (4, 14, 64), (1, 40, 9), (2, 30, 5)])
def test_drafts_roll_back_and_outputs_equal_a_run_without_them(seed, block_size, num_blocks, budget):
    """Random requests (some sharing a prefix) with random drafts, under small caches and
    budgets (preemption, drafts cut by the budget): every step the cache's integrity holds,
    no request reads a stale slot (a rejected draft's K/V, a block registered from a draft),
    each running request holds exactly the blocks of its computed tokens, and every
    request's tokens equal those of a run without drafts."""
    rng = random.Random(seed)
    shared = [rng.randrange(1000) for _ in range(6)]
    prompts = [(shared if rng.random() < 0.5 else []) + [rng.randrange(1000) for _ in range(rng.randint(1, 9))]
               for _ in range(8)]
    max_tokens = [rng.randint(1, 12) for _ in prompts]

    def run(with_drafts: bool):
        sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget)
        runner = FakeRunner(block_size)
        requests = [make_request(f"r{i}", p, max_tokens=m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
        for r in requests:
            sched.add_request(r)
        for _ in range(2000):
            if not sched.has_unfinished():
                break
            step(sched, runner)
            if with_drafts:
                for r in sched.running:
                    if r.num_computed_tokens == r.num_tokens - 1:  # decoding
                        room = min(4, r.max_tokens - r.num_output_tokens - 1)
                        r.spec_token_ids = drafts_for(r, rng, room) if room > 0 else []
        assert not sched.has_unfinished()
        assert sched.kv.num_free_blocks == num_blocks
        return [r.output_token_ids for r in requests], sched

    plain, _ = run(False)
    spec, sched = run(True)
    assert spec == plain
    assert sched.num_draft_tokens >= sched.num_accepted_tokens
    assert sum(sched.num_accepted_per_position) == sched.num_accepted_tokens


P = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])


@pytest.mark.parametrize("draft", [1, 3, 5])  # a likely, a middling and an unlikely draft
@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.7, 4)])
def test_rejection_sampling_draws_from_the_target_distribution(draft, temperature, top_k):
    """A row verifying an n-gram draft gives the draft with probability p(draft), else a token
    from p without it: the token is distributed as p itself (chi-square, 40,000 rows), whatever
    the draft; p is the distribution after temperature and top-k."""
    n = 40_000
    b = sampler_batch(n, temperature=temperature, top_k=top_k)
    b.drafts = torch.full((n,), draft)
    ids = torch.tensor([t for t, _ in Sampler(torch.Generator().manual_seed(draft))(P.log().repeat(n, 1), b)])
    target = torch.softmax(P.log() / temperature, dim=0)
    if top_k is not None:
        target[target.argsort()[:len(P) - top_k]] = 0
        target /= target.sum()
    counts = torch.bincount(ids, minlength=len(P))
    assert counts[target == 0].sum() == 0
    kept = target > 0
    result = scipy.stats.chisquare(counts[kept].numpy(), (target[kept] * n).numpy())
    assert result.pvalue > 1e-3, (counts.tolist(), (target * n).tolist())
    assert (ids == draft).float().mean() == pytest.approx(target[draft].item(), abs=0.01)


def test_rows_without_drafts_and_seeded_rows_are_unchanged():
    """-1 rows sample as without drafts; a seeded row's token depends on its seed only."""
    b = sampler_batch(4, seeds=[(0, 11), (2, 12)])
    plain = Sampler(torch.Generator().manual_seed(0))(P.log().repeat(4, 1), b)
    b.drafts = torch.tensor([-1, 1, -1, 3])
    b.draft_seeds = [(3, 99)]
    with_drafts = Sampler(torch.Generator().manual_seed(0))(P.log().repeat(4, 1), b)
    assert with_drafts[0] == plain[0] and with_drafts[2] == plain[2]


def test_step_cost_interpolates_and_never_falls():
    cost = StepCost([1, 2, 4, 8], [1.0, 1.0, 0.9, 2.0])  # the 0.9 is timing noise
    assert cost(1) == 1.0 and cost(3) == 1.0 and cost(6) == pytest.approx(1.5)
    assert cost(16) == pytest.approx(2.0 + 8 * 0.25)  # past the last point, its last slope
    for _ in range(200):  # decode steps that took 1.5 s at 4 tokens: 0.5 s beyond the forward
        cost.observe(4, 1.5)
    assert cost.overhead == pytest.approx(0.5) and cost(4) == pytest.approx(1.5)


def test_draft_step_cost_clips_stalls_and_fades():
    """The draft's cost learns its overhead in the engine: a stall counts for at most 4x the
    prediction (the first step too), a lasting slowdown is learnt in a few steps, and with
    nothing to time the overhead fades; after a slowdown and 300 steps without drafts, one
    step at the start-up speed leaves the cost near the start-up time."""
    cost = StepCost([1, 8, 64], [0.001, 0.002, 0.010], robust=True)
    cost.observe(1, 10.0)  # a stall
    assert cost(1) == pytest.approx(0.001 + 0.1 * 0.003)
    for _ in range(60):  # forwards 50 ms slower than at start-up
        cost.observe(1, 0.051)
    assert cost(1) == pytest.approx(0.051, rel=0.05)
    for _ in range(300):
        cost.fade()
    cost.observe(1, 0.001)
    assert cost(1) < 1.2 * 0.001 + 0.050 * 0.99 ** 300
    plain = StepCost([1, 8, 64], [0.001, 0.002, 0.010])  # the target's: no clip
    plain.observe(1, 10.0)
    assert plain.overhead == pytest.approx(0.1 * 9.999)


def test_step_overhead_makes_drafts_worth_more():
    """A step's fixed cost beyond its forward is paid by its tokens, drafts included: the
    same forward keeps more drafts when the step costs more than the forward."""
    forward = StepCost([1, 64, 1024], [0.001, 0.004, 0.06])
    without = sum(choose_num_drafts([0.7] * 64, [4] * 64, 64, forward))
    forward.overhead = 0.01
    assert sum(choose_num_drafts([0.7] * 64, [4] * 64, 64, forward)) > without


def test_drafts_are_chosen_while_they_pay_for_their_time():
    flat = StepCost([1, 1024], [0.010, 0.0101])  # a step costs about the same whatever its tokens
    steep = StepCost([1, 1024], [0.001, 1.024])  # every token costs as much as the step's base
    assert choose_num_drafts([0.8] * 4, [4] * 4, 4, flat) == [4] * 4
    assert choose_num_drafts([0.0, 0.8], [4, 4], 2, flat) == [0, 4]  # never-accepted drafts are not worth it
    assert choose_num_drafts([0.8] * 4, [4] * 4, 4, steep) == [0] * 4  # a draft is worth < 1 token
    assert choose_num_drafts([0.9, 0.9], [2, 0], 2, flat) == [2, 0]  # up to the drafts a request has
    # overhead-bound up to 64 tokens, then GEMM-bound: drafts in a small batch, none in a full one
    mid = StepCost([1, 64, 1024], [0.010, 0.012, 0.2])
    assert choose_num_drafts([0.9, 0.5], [4, 4], 2, mid) == [4, 4]
    assert sum(choose_num_drafts([0.9] * 200 + [0.5] * 200, [4] * 400, 400, mid)) == 0
    # near the bend, the likelier requests keep their drafts and the others lose them
    bend = choose_num_drafts([0.95] * 8 + [0.3] * 8, [4] * 16, 48, mid)
    assert min(bend[:8]) > max(bend[8:])


def test_one_draft_for_each_request_beats_one_requests_deep_drafts_where_each_depth_costs_a_forward():
    """A draft model's j-th forward costs the same for one row as for four: the likeliest
    request's 4 drafts (0.95, then 0.90, 0.86, 0.81) rank above the others' first (0.8), but
    they cost 4 forwards where one first draft each costs one, and the target's step stays
    under its jump at 9 tokens either way. Without a draft model the target's tokens are the
    only cost, and the likeliest drafts go first."""
    target = StepCost([1, 8, 9, 1024], [0.010, 0.010, 0.020, 0.0201])
    draft = StepCost([1, 1024], [0.001, 0.001])
    assert choose_num_drafts([0.95, 0.8, 0.8, 0.8], [4] * 4, 4, target, draft) == [1, 1, 1, 1]
    assert choose_num_drafts([0.95, 0.8, 0.8, 0.8], [4] * 4, 4, target) == [4, 0, 0, 0]
    # two requests, 8 tokens: 3 drafts each (3 forwards) over 4 and 2 (4 forwards)
    assert choose_num_drafts([0.95, 0.8], [4, 4], 2, target, draft) == [3, 3]
    assert choose_num_drafts([0.9, 0.9], [1, 3], 2, target, draft) == [1, 3]  # caps past a request's limit


def test_a_draft_pays_for_one_more_query_of_its_request_not_for_a_decoding_sequences_attention():
    """A verified draft is one more query of a sequence whose keys and values the attention
    reads for its first query anyway: its attention is priced at `query_attention` a context
    token, not at `attention` (a decoding sequence's, several times dearer on the CPU)."""
    cost = StepCost([1, 1024], [0.010, 0.0101])
    cost.attention = 1e-5  # 10 ms over 1000 tokens of context: no draft would pay at this price
    assert choose_num_drafts([0.8] * 4, [4] * 4, 4, cost, contexts=[1000] * 4) == [4] * 4
    cost.query_attention = 1e-5
    assert choose_num_drafts([0.8] * 4, [4] * 4, 4, cost, contexts=[1000] * 4) == [0] * 4
    cost.query_attention = 1e-7  # 0.1 ms a draft: the likely ones pay, the unlikely do not
    assert choose_num_drafts([0.9, 0.005], [4, 4], 2, cost, contexts=[1000] * 2) == [4, 0]


def test_a_drafters_catch_up_is_paid_by_the_requests_first_draft():
    """A request the drafter is behind on (its prompt, steps it did not draft in) first costs
    a forward over those tokens: in a small batch that pays back, in a larger one only the
    requests the drafter has kept up with draft; a later draft never ranks above its request's
    first."""
    flat = StepCost([1, 1024], [0.010, 0.0101])
    head = StepCost([1, 1024], [0.001, 0.002])
    head.catch_up = 20e-6
    late = 96 * DOUBTFUL_CATCH_UP_STEPS  # tokens behind: 1.9 ms a step over the steps (no calibration: doubtful)
    assert choose_num_drafts([0.8], [4], 1, flat, head, behind=[late]) == [4]
    ks = choose_num_drafts([0.8] * 16, [4] * 16, 16, flat, head, behind=[late] * 8 + [0] * 8)
    assert ks == [0] * 8 + [4] * 8
    # without the catch-up's cost every request looks the same
    assert choose_num_drafts([0.8] * 16, [4] * 16, 16, flat, head) == [4] * 16
    # a request about to end has fewer steps to spread its catch-up over
    assert choose_num_drafts([0.8], [4], 1, flat, head, behind=[late], remaining=[1000]) == [4]
    assert choose_num_drafts([0.8], [4], 1, flat, head, behind=[late], remaining=[4]) == [0]
    # a likelier request far behind ranks below a less likely one that is not
    assert choose_num_drafts([0.9, 0.6], [1, 1], 2, StepCost([1, 2, 1024], [0.010, 0.0105, 0.5]), head,
                             behind=[500 * DOUBTFUL_CATCH_UP_STEPS, 0]) == [0, 1]


def test_a_request_joining_a_drafting_batch_catches_up_where_the_calibration_confirmed_the_drafts():
    """At 4 requests of the built-in model with its EAGLE head (costs as timed on a 2-core
    CPU), a request that joins three drafting ones with a 390-token prompt and 128 tokens to
    go is worth the head's catch-up (24 ms at 61 us a token) where the drafts have given what
    was predicted: spread over the steps it has left (at most CATCH_UP_STEPS), not over 16
    (1.5 ms a step, more than its first draft is worth). Before the calibration has confirmed
    the drafts, or where it found them short, a catch-up is spread over 16 steps."""
    assert CATCH_UP_STEPS >= 64 and DOUBTFUL_CATCH_UP_STEPS == 16
    tokens = [1, 2, 4, 8, 9, 16, 64, 512]
    cost = StepCost(tokens, [4.37e-3, 4.43e-3, 4.54e-3, 4.8e-3, 6.73e-3, 7.02e-3, 12.9e-3, 73.3e-3])
    head = StepCost(tokens, [0.52e-3, 0.55e-3, 0.62e-3, 0.8e-3, 1.5e-3, 1.5e-3, 3.64e-3, 16.8e-3])
    head.catch_up = 61e-6
    confirmed = Calibration()
    confirmed.observe(2.0, 0.002, 2.0, 0.002)  # a step's drafts gave what was predicted
    assert confirmed.confirmed

    def choose(remaining: int, calibration: Calibration | None) -> list[int]:
        return choose_num_drafts([0.8] * 4, [4] * 4, 4, cost, head, contexts=[450] * 4, behind=[0, 0, 0, 390],
                                 remaining=[100, 100, 100, remaining], first_rows=[2] * 4, calibration=calibration)

    assert all(choose(128, confirmed))
    assert choose(8, confirmed)[3] == 0  # with a few steps left it is not worth it
    assert choose(128, None)[3] == 0 and all(choose(128, None)[:3])  # unconfirmed
    short = Calibration()
    short.observe(2.0, 0.002, 1.0, 0.003)  # half the tokens, 1.5x the seconds
    assert not short.confirmed and choose(128, short)[3] == 0
    for _ in range(5000):  # fading does not confirm drafts
        short.fade()
    assert not short.confirmed


def test_a_draft_models_first_forward_counts_each_requests_rows():
    """A draft model's first forward in a step computes, for each request that drafts, its
    last token before the step and the tokens the step gave it (2 + its accepted drafts).
    Counted as one row a request, drafts that do not pay for those rows looked as if they
    did; a request without drafts adds no rows."""
    flat = StepCost([1, 1024], [0.010, 0.0101])
    draft = StepCost([1, 4, 1024], [0.001, 0.001, 0.3])  # flat to 4 rows, then 0.29 ms a row
    assert choose_num_drafts([0.2] * 4, [1] * 4, 4, flat, draft) == [1] * 4
    assert choose_num_drafts([0.2] * 4, [1] * 4, 4, flat, draft, first_rows=[3] * 4) == [0] * 4
    assert choose_num_drafts([0.2] * 4, [1, 0, 1, 1], 4, flat, draft, first_rows=[1, 9, 1, 1]) == [1, 0, 1, 1]


def test_a_catch_up_token_is_learnt_from_the_engines_forwards():
    """The start-up timing of a catch-up token (the draft alone, its weights in cache) moves
    towards what catch-ups cost in the engine's steps; one stalled forward counts for at
    most 4 times the estimate."""
    head = StepCost([1, 1024], [0.001, 0.002])
    head.catch_up = 20e-6
    for _ in range(40):
        head.observe_catch_up(40e-6)
    assert head.catch_up == pytest.approx(40e-6, rel=0.02)
    head.observe_catch_up(1.0)  # a stall: counted as 4x the estimate
    assert head.catch_up == pytest.approx(0.9 * 40e-6 + 0.1 * 160e-6, rel=0.02)


def test_a_drafting_steps_host_work_is_learnt_and_charged_once_a_step():
    """What a step that drafts adds besides the drafter's forwards is learnt from the steps
    and charged once for any number of drafts: it turns a single draft's worth below its
    cost, while four drafts of a likely request still pay."""
    flat = StepCost([1, 1024], [0.010, 0.0101])
    head = StepCost([1, 1024], [0.001, 0.002])
    assert choose_num_drafts([0.3], [4], 1, flat, head) == [1]
    for _ in range(60):
        head.observe_fixed(0.003)
    assert head.fixed == pytest.approx(0.003, rel=0.01)
    assert choose_num_drafts([0.3], [4], 1, flat, head) == [0]
    assert choose_num_drafts([0.9], [4], 1, flat, head) == [4]
    head.observe_fixed(10.0)  # a stall: counted as 4x (a one-row forward plus the estimate)
    assert head.fixed == pytest.approx(0.9 * 0.003 + 0.1 * 4 * 0.004, rel=0.01)


def test_a_drafter_that_finds_no_draft_paying_rests_longer_each_time():
    """When no draft pays, the next steps get none without asking (the choice's numpy is a
    few percent of a step): 1, 2, 4, ... up to MAX_REST steps while the answer stays no; a
    batch half the size asks again at once; an answer of yes ends the rests."""
    from types import SimpleNamespace

    from tokenmill.executor.spec.draft import DraftModel
    from tokenmill.executor.spec.rests import MAX_REST

    steep = StepCost([1, 1024], [0.001, 1.024])  # a draft costs a token's time: none pays at 0.3
    drafter = SimpleNamespace(choosing=True, resting=0, rest_length=0, rest_batch=0, prior=0.3, later=0.3, cost=steep,
                              draft_cost=None, measuring=False, calibration=None, exploring=False,
                              explore=lambda rates, limits, choose=None, catch_up=None, step=0.0: None, chose=lambda ks: ks)
    drafter._rests = lambda candidates: DraftModel._rests(drafter, candidates)
    drafter._rest_after = lambda ks, candidates, most: DraftModel._rest_after(drafter, ks, candidates, most)
    requests = [make_request(f"r{i}", [1, 2, 3], max_tokens=64) for i in range(8)]
    asked = []

    def choose(step: int, batch: list) -> list[int]:
        def inputs():
            asked.append(step)
            return [3] * len(batch), [0] * len(batch), [1] * len(batch)
        out = SchedulerOutput(requests=batch, num_computed_tokens=[3] * len(batch),
                              num_scheduled_tokens=[1] * len(batch))
        return DraftModel._choose(drafter, batch, [4] * len(batch), out, inputs)

    for step in range(60):
        assert choose(step, requests) == [0] * 8
    gaps = np.diff(asked).tolist()
    assert gaps == [2, 3, 5, 9, 17] + [MAX_REST + 1] * (len(gaps) - 5)
    assert drafter.resting > 0 and choose(60, requests[:4]) == [0] * 4 and asked[-1] == 60  # half the batch
    assert drafter.resting == MAX_REST and drafter.rest_batch == 4  # (a no again: resting resumes)
    drafter.cost = StepCost([1, 1024], [0.010, 0.0101])  # now drafts are nearly free
    assert choose(61, requests[:2]) == [4] * 2 and asked[-1] == 61  # half of 4 asks; a yes ends the rests
    assert drafter.resting == drafter.rest_length == 0
    assert choose(62, requests) == [4] * 8 and asked[-1] == 62
    drafter.cost = steep
    assert choose(63, requests) == [0] * 8 and drafter.resting == 1
    choose(64, [])  # a batch without candidates (all prefilling): the next one starts afresh
    assert choose(65, requests) == [0] * 8 and asked[-1] == 65


def test_acceptance_estimate_starts_at_the_prior():
    assert acceptance(0, 0, prior=0.7) == pytest.approx(0.7)
    assert acceptance(30, 10, prior=0.7) == pytest.approx(31.4 / 42)


def test_eagle_waiting_pairs_keep_their_order_drop_whole_old_pieces_and_hold_no_collected_objects():
    """A request's pairs waiting for its next drafting step (executor/spec/eagle.py): its
    tokens in order, the hidden-state rows of each piece where its slab has them, at most
    MAX_WAITING positions in whole pieces, oldest dropped first; and nothing a step adds is
    a new object the garbage collector walks (the tokens go into one array, the rows are
    ints, the pieces share their slab)."""
    import gc

    from tokenmill.executor.spec.eagle_pairs import MAX_WAITING, Waiting

    slab = torch.arange(64.0).reshape(32, 2)
    w = Waiting(10)
    ids = w.ids
    w.add([1, 2, 3], slab, 4)
    w.add([4], slab, 9)
    assert (w.start, w.end, w.ids.tolist()) == (10, 14, [1, 2, 3, 4]) and w.ids is ids
    assert all(s is slab for s in w.sources) and not any(gc.is_tracked(x) for x in (*w.lengths, *w.firsts))
    pieces = [source[first:first + n] for n, source, first in zip(w.lengths, w.sources, w.firsts)]
    assert torch.equal(torch.cat(pieces), slab[[4, 5, 6, 9]])
    piece = 100
    for i in range(MAX_WAITING // piece + 1):
        w.add(list(range(i * piece, (i + 1) * piece)), slab, 0)
    # whole pieces went, oldest first, until at most MAX_WAITING positions wait
    assert w.end - w.start <= MAX_WAITING < w.end - w.start + piece
    assert w.ids.tolist() == list(range((MAX_WAITING // piece + 1) * piece - (w.end - w.start),
                                        (MAX_WAITING // piece + 1) * piece))
    assert len(w.lengths) == len(w.sources) == len(w.firsts) == (w.end - w.start) // piece


def test_ngram_rests_while_its_drafts_do_not_pay_and_not_while_it_finds_none(monkeypatch):
    """Adaptive n-gram: where the lookups find drafts and none pays, the next steps neither
    look up nor choose, 1, 2, 4, ... steps while the answer stays no (their lookups cost
    1-1.5 ms a step at 64 requests); where the lookups find nothing, that is no verdict on
    drafts, and every step looks again."""
    from tokenmill.config import SpeculativeConfig
    from tokenmill.executor.spec import ngram as ngram_module
    from tokenmill.executor.spec.adaptive import StepCost

    looked = []
    batch = ngram_module.propose_batch
    monkeypatch.setattr(ngram_module, "propose_batch", lambda *a: looked.append(step) or batch(*a))
    steep = StepCost([1, 1024], [0.001, 1.024])  # a draft costs a token's time
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2)
    proposer = ngram_module.NgramProposer(config, 2048, steep)
    repeating = [make_request(f"r{i}", [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=64) for i in range(4)]
    for step in range(40):  # every request's rate about 0.02: no draft pays
        proposer.propose(repeating, 4, accepted=0, rejected=40)
        assert all(r.spec_token_ids == [] for r in repeating)
    assert np.diff(looked).tolist()[:4] == [2, 3, 5, 9] and proposer.num_steps_by_k[0] == 160
    looked.clear()
    fresh = ngram_module.NgramProposer(config, 2048, steep)
    novel = [make_request(f"n{i}", list(range(10 * i, 10 * i + 8)), max_tokens=64) for i in range(4)]
    for step in range(10):
        fresh.propose(novel, 4, accepted=0, rejected=40)
    assert looked == list(range(10))
