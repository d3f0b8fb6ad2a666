"""Adaptive speculation checks its own predictions: the tokens and seconds that chosen drafts
really added against what choosing them predicted (Calibration), one step in MEASURE_EVERY
without drafts so that the step's cost without them stays measured, and an exploration
after a run of steps without drafts, so that a rate learnt from a few unlucky drafts does
not stop drafting for good (where drafts accepted at a high rate would pay)."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import SpeculativeConfig
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.executor.spec import ngram as ngram_module
from tokenmill.executor.spec.adaptive import (EXPLORE_AFTER, EXPLORE_SHARE, MAX_EXPLORE_AFTER, MEASURE_EVERY,
                                              OPTIMISTIC_RATE, StepCost, choose_num_drafts)
from tokenmill.executor.spec.calibration import Calibration
from tokenmill.executor.spec.proposer import Proposer


def test_calibration_learns_what_drafts_really_added_clips_stalls_and_fades():
    cal = Calibration()
    for _ in range(200):  # predicted 2 tokens in 5 ms; they gave 1 token in 10 ms
        cal.observe(2.0, 0.005, 1.0, 0.010)
    assert cal.tokens == pytest.approx(0.5, abs=0.01) and cal.seconds == pytest.approx(2.0, abs=0.02)
    fresh = Calibration()
    d, w = fresh.decay ** 2, fresh.prior_tokens / 2  # a step's decay by its 2 tokens; the prior's steps
    fresh.observe(2.0, 0.005, 2.0, 100.0)  # a stall counts for 4x the prediction, after the prior as predicted
    assert fresh.seconds == pytest.approx((d * w * 0.005 + 4 * 0.005) / (d * w * 0.005 + 0.005))
    fresh.observe(2.0, 0.005, 2.0, -1.0)  # a step faster than its cost without drafts: no time added
    assert fresh.sums[2] == pytest.approx(d * (d * w * 0.005 + 4 * 0.005))
    wide = Calibration()  # a step of 40 predicted tokens (a large batch) decays the sums as 20 steps of 2 do
    wide.observe(40.0, 0.005, 40.0, 0.005)
    wide.observe(40.0, 0.005, 20.0, 0.005)
    assert wide.sums[0] == pytest.approx(fresh.decay ** 40 * (fresh.decay ** 40 * fresh.prior_tokens + 40) + 20)
    for _ in range(200):  # steps without drafts: the ratios return towards 1, slowly
        cal.fade()
    assert 1.5 < cal.seconds < 1.9 and 0.5 < cal.tokens < 0.65
    for _ in range(5000):
        cal.fade()
    assert cal.tokens == pytest.approx(1.0, abs=0.01) and cal.seconds == pytest.approx(1.0, abs=0.01)


def test_choosing_scales_by_the_calibration_and_leaves_its_prediction():
    mid = StepCost([1, 64, 1024], [0.010, 0.012, 0.2])
    cal = Calibration()
    ks = choose_num_drafts([0.9, 0.5], [4, 4], 2, mid, calibration=cal)
    assert ks == [4, 4]
    gains = sum(0.9 ** j + 0.5 ** j for j in range(1, 5))
    verifying = float(mid.forward(10) - mid.forward(2))  # (no draft model: all of it the target's)
    assert cal.chosen == pytest.approx((gains, verifying, verifying))
    cal.seconds = 4.0  # drafts cost 4x what the model says: the least likely goes
    assert choose_num_drafts([0.9, 0.5], [4, 4], 2, mid, calibration=cal) == [4, 3]
    steep = StepCost([1, 1024], [0.010, 0.3])  # 0.28 ms a token, against 5 ms a token for the step
    cal.seconds = 1.0
    assert choose_num_drafts([0.9, 0.5], [4, 4], 2, steep, calibration=cal)[0] == 4
    cal.tokens = 0.05  # drafts give a twentieth of the tokens expected: none pays
    assert choose_num_drafts([0.9, 0.5], [4, 4], 2, steep, calibration=cal) == [0, 0]
    assert cal.chosen is None


def step(drafts: list[list[int]], context: int = 0) -> SchedulerOutput:
    """A decode step's scheduler output: each request's known token and its drafts, after
    `context` tokens each."""
    return SchedulerOutput(num_computed_tokens=[context] * len(drafts),
                           num_scheduled_tokens=[1 + len(d) for d in drafts], spec_token_ids=drafts)


def test_a_step_is_compared_with_the_choice_made_before_it():
    """A plain decode step teaches the step cost's overhead; the next step's choice is then
    compared with that step: the drafting before it (the drafter's `seconds`) and its time
    over the cost without its drafts, against the seconds predicted; its accepted drafts
    against the tokens predicted."""
    cost = StepCost([1, 1024], [0.010, 0.0101])
    proposer = Proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 2048, cost)
    proposer.observe_step(step([[], []]), 0.012, accepted=0)  # a plain step: 2 ms of overhead
    assert cost.overhead == pytest.approx(0.1 * 0.002, rel=0.01)
    assert proposer.dry_steps == 1 and proposer.calibration.sums is None
    proposer.calibration.chosen = (3.0, 0.004, 0.004)  # this step chooses drafts predicted to add 3 tokens in 4 ms
    proposer.seconds = 0.001  # of its 13 ms, 1 ms is drafting for the next step
    proposer.observe_step(step([[], []]), 0.013, accepted=0)
    assert proposer.calibration.sums is None  # (its own drafts were chosen in the step before: none)
    base = cost(2)
    proposer.seconds = 0.0
    proposer.observe_step(step([[5, 6, 7], [8]]), 0.020, accepted=2)  # verifies them: 2 accepted
    added = 0.001 + 0.020 - base
    cal = proposer.calibration
    d, w = cal.decay ** 3, cal.prior_tokens / 3  # the prior's steps of 3 tokens, decayed once
    assert cal.tokens == pytest.approx((d * w * 3 + 2) / (d * w * 3 + 3))
    assert cal.seconds == pytest.approx((d * w * 0.004 + added) / (d * w * 0.004 + 0.004))
    assert cost.overhead == pytest.approx(0.9 * 0.1 * 0.002 + 0.1 * (0.012 - 0.01), rel=0.01)  # not from it
    assert proposer.dry_steps == 0 and proposer.plain_steps_ago == 1
    for _ in range(MEASURE_EVERY - 1):
        assert not proposer.measuring
        proposer.observe_step(step([[5], [6]]), 0.015, accepted=3)
    assert proposer.measuring  # a step in MEASURE_EVERY verifies none


def test_the_step_cost_prices_the_batchs_attention_so_its_overhead_does_not_follow_the_contexts():
    """A plain step's attention over the batch's contexts is priced at the start-up's
    cost.attention a context token, not learnt as overhead: the overhead of steps whose
    contexts grow from 1,000 to 16,000 tokens stays what they spend besides (1 ms), and a
    step that verifies drafts is compared with its own contexts' cost without them. (Learnt
    as overhead, the attention of 64 requests of the rewrite set, 6-9 ms of a 15 ms step on a
    2-core CPU, was still the last batch's when 28 or 1 requests were left.) The choice's
    step without drafts counts the batch's attention too: the larger it is, the less a
    draft's fixed cost weighs."""
    cost = StepCost([1, 64, 128], [0.002, 0.004, 0.006])
    cost.attention = 400e-9
    proposer = Proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 2048, cost)
    for context in range(16, 256, 4):  # 64 requests of 16..252 tokens of context
        proposer.observe_step(step([[]] * 64, context), 0.004 + 400e-9 * 64 * context + 0.001, accepted=0)
    assert cost.overhead == pytest.approx(0.001, rel=0.01)
    assert cost(64, 64 * 250) == pytest.approx(0.004 + 400e-9 * 64 * 250 + 0.001, rel=1e-3)
    cal = proposer.calibration
    cal.chosen = (32.0, 0.002, 0.002)  # 64 drafts predicted to add 32 tokens in 2 ms
    proposer.observe_step(step([[]] * 64, 250), cost(64, 64 * 250), accepted=0)  # (the choosing step)
    proposer.observe_step(step([[5]] * 64, 250), cost(64, 64 * 250) + 0.002, accepted=32)
    assert cal.tokens == pytest.approx(1.0) and cal.seconds == pytest.approx(1.0)  # as predicted
    cheap = StepCost([1, 2, 64], [0.002, 0.0026, 0.004])  # a draft adds 0.6 ms to a request's 2 ms step
    cheap.attention = 400e-9
    assert choose_num_drafts([0.25], [1], 1, cheap, contexts=[100]) == [0]
    assert choose_num_drafts([0.25], [1], 1, cheap, contexts=[100], batch_context=10000) == [1]  # base 6 ms


def test_a_catch_up_is_left_out_of_the_calibration_as_measured():
    """A request the drafter must catch up with (a prompt) has its catch-up priced at a share
    a step in the choice, and left out of the prediction it leaves; the step that verifies its
    drafts takes the catch-up's measured time (the drafter's catch_up_seconds) out of the
    drafting's, so the calibration compares only what the drafts cost beyond it. (In full
    against the share, clipped at 4x, it made drafts look dearer after every prompt; at the
    drafter's learnt rate, a catch-up slower than that rate still did.)"""
    cost = StepCost([1, 1024], [0.010, 0.0101])
    draft = StepCost([1, 1024], [0.0005, 0.010])
    draft.catch_up = 20e-6
    cal = Calibration()
    ks = choose_num_drafts([0.9, 0.9], [1, 1], 2, cost, draft, behind=[400, 0], remaining=[100, 100],
                           calibration=cal)
    assert ks == [1, 1]
    caught_up = cal.chosen
    shares = choose_num_drafts([0.9, 0.9], [1, 1], 2, cost, draft, behind=[0, 0], calibration=cal)
    assert shares == [1, 1] and cal.chosen == pytest.approx(caught_up)  # the catch-up is not in the prediction
    proposer = Proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 2048, cost)
    proposer.observe_step(step([[], []]), 0.010, accepted=0)
    proposer.calibration.chosen = (1.8, 0.002, 0.0)
    # its drafting: 1.5 ms, and 13 ms catching up (the learnt rate would say 8)
    proposer.seconds, proposer.catch_up_seconds = 0.0145, 0.013
    proposer.observe_step(step([[], []]), 0.0145 + 0.010, accepted=0)
    proposer.seconds = proposer.catch_up_seconds = 0.0
    proposer.observe_step(step([[5], [6]]), 0.011, accepted=2)
    added = 0.0015 + 0.011 - cost(2)  # what the drafts added, the catch-up aside
    cal = proposer.calibration
    d, w = cal.decay ** 1.8, cal.prior_tokens / 1.8
    assert cal.seconds == pytest.approx((d * w * 0.002 + added) / (d * w * 0.002 + 0.002))
    assert proposer.calibration.seconds < 1.5


def test_exploring_after_steps_without_drafts_doubles_its_interval_until_a_choice_drafts():
    proposer = Proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 2048,
                        StepCost([1, 1024], [0.010, 0.0101]))
    for _ in range(EXPLORE_AFTER - 1):
        proposer.observe_step(step([[], [], []]), 0.012, accepted=0)
    assert proposer.explore([0.2, 0.6, 0.4], [4, 4, 4]) is None
    proposer.observe_step(step([[], [], []]), 0.012, accepted=0)
    assert proposer.explore([0.2, 0.6, 0.9], [4, 4, 0]) == [0, 4, 0]  # the likeliest that has drafts
    assert proposer.dry_steps == 0 and proposer.explore_after == 2 * EXPLORE_AFTER
    for _ in range(20):
        proposer.explore_after = 2 * MAX_EXPLORE_AFTER
        proposer.dry_steps = proposer.explore_after
        proposer.explore([0.5], [2])
    assert proposer.explore_after == MAX_EXPLORE_AFTER
    assert proposer.chose([0, 1]) == [0, 1] and proposer.explore_after == EXPLORE_AFTER


def test_exploring_only_where_drafts_accepted_at_the_optimistic_rate_would_be_chosen():
    proposer = Proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 2048,
                        StepCost([1, 1024], [0.010, 0.0101]))
    asked = []

    def never(rates):
        asked.append(rates)
        return [0] * len(rates)

    proposer.dry_steps = proposer.explore_after
    assert proposer.explore([0.2, 0.95], [4, 4], never) is None
    assert asked == [[OPTIMISTIC_RATE, 0.95]]  # each rate at least the optimistic one
    assert proposer.dry_steps == 0 and proposer.explore_after == 2 * EXPLORE_AFTER  # tried again later
    proposer.dry_steps = proposer.explore_after
    assert proposer.explore([0.2, 0.6], [4, 4], lambda rates: [1, 0]) == [0, 4]
    # the step's real choice, with the cost model: one request alone, drafts cheap, is worth
    # exploring; 64 requests over 512 tokens of context each, where a draft's attention
    # costs what a token is worth, are not
    cost = StepCost([1, 64, 128, 512], [0.005, 0.010, 0.016, 0.050])
    cost.query_attention = 1e-6
    for n, context, explores in ((1, 100, True), (64, 512, False)):
        def choose(rates):
            return choose_num_drafts(rates, [4] * n, n, cost, contexts=[context] * n)
        proposer.dry_steps = proposer.explore_after
        assert (proposer.explore([0.3] * n, [4] * n, choose) is not None) == explores


def test_an_exploration_waits_while_its_catch_up_costs_more_than_its_share_of_the_time():
    """A drafter that must catch up with the exploring request first (all the tokens since it
    last drafted) explores once the steps since the last exploration are worth 1/EXPLORE_SHARE
    times that catch-up, and never later than MAX_EXPLORE_AFTER steps."""
    proposer = Proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 2048,
                        StepCost([1, 1024], [0.010, 0.0101]))
    proposer.dry_steps = EXPLORE_AFTER
    wait = int(0.010 / (EXPLORE_SHARE * 0.010))  # a step's worth of catching up: 100 steps
    assert wait > EXPLORE_AFTER
    assert proposer.explore([0.9, 0.5], [4, 4], catch_up=[0.010, 0.0], step=0.010) is None
    assert proposer.explore_after == wait and proposer.dry_steps == EXPLORE_AFTER and not proposer.exploring
    proposer.dry_steps = wait
    assert proposer.explore([0.9, 0.5], [4, 4], catch_up=[0.010, 0.0], step=0.010) == [4, 0]
    assert proposer.dry_steps == 0 and proposer.explore_after == 2 * wait
    proposer.dry_steps = proposer.explore_after = MAX_EXPLORE_AFTER
    assert proposer.explore([0.9], [4], catch_up=[10.0], step=0.010) == [4]  # however dear
    # without a catch-up, as before: after EXPLORE_AFTER steps
    proposer.dry_steps = proposer.explore_after = EXPLORE_AFTER
    assert proposer.explore([0.9], [4], catch_up=[0.0], step=0.010) == [4]


@pytest.mark.parametrize("pays_if_likely", [True, False])
def test_an_engine_whose_choice_never_drafts_explores_where_likely_drafts_would_pay(monkeypatch, pays_if_likely):
    """The built-in model with adaptive n-gram, its choice made to answer no drafts at the
    rates it has: after EXPLORE_AFTER steps without drafts, one request drafts all the
    lookup found, where drafts accepted at OPTIMISTIC_RATE would be chosen; where not even
    those would, none; the outputs stay those of decoding without drafts."""
    def choose(rates, limits, *_, calibration=None, **__):
        # the step's own choice (with the calibration) says no; the exploration's question
        # (each rate at least OPTIMISTIC_RATE, without it) says yes where likely drafts pay
        likely = pays_if_likely and calibration is None and min(rates) >= OPTIMISTIC_RATE
        return list(limits) if likely else [0] * len(rates)

    monkeypatch.setattr(ngram_module, "choose_num_drafts", choose)
    prompt = "import os\nimport sys\nimport os\nimport sys\n"
    params = SamplingParams(max_tokens=3 * EXPLORE_AFTER + 16, temperature=0, ignore_eos=True)
    plain = LLM(dtype="float32", kv_cache_memory="16MiB").generate([prompt], params, use_tqdm=False)
    llm = LLM(dtype="float32", kv_cache_memory="16MiB", speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    out = llm.generate([prompt], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    by_k = llm.engine.stats()["spec_decode_num_steps_by_k"]
    if pays_if_likely:  # after 64 steps without drafts, then 128 (fewer if drafts were found late)
        assert 1 <= sum(by_k[1:]) <= 3, by_k
    else:
        assert sum(by_k[1:]) == 0, by_k
    assert llm.engine.proposer.explore_after > EXPLORE_AFTER


def test_an_overhead_learnt_on_a_slow_machine_goes_once_plain_steps_are_fast_again():
    """While the machine is slow (another load) the target's overhead grows, and drafts look
    cheap; a batch that then drafts every step measures a plain step only every
    MEASURE_EVERY. Once plain steps run well under the cost again, each next step is
    measured without drafts too until they agree; a single stall counts for at most STALL
    times the cost."""
    from tokenmill.executor.spec.proposer import RECHECK, STALL

    cost = StepCost([1, 1024], [0.010, 0.0101])
    proposer = Proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 2048, cost)
    for _ in range(20):  # 20 ms steps: learnt gradually (each counts for at most STALL times the cost)
        proposer.observe_step(step([[], []]), 0.020, accepted=0)
    assert cost.overhead == pytest.approx(0.010 * (1 - 0.9 ** 20), rel=0.01)
    for _ in range(60):  # then a slow machine: plain steps of 50 ms
        proposer.observe_step(step([[], []]), 0.050, accepted=0)
    assert cost.overhead > 0.035
    for _ in range(MEASURE_EVERY):  # drafting every step
        proposer.observe_step(step([[5], [6]]), 0.060, accepted=1)
    assert proposer.measuring
    plain = 0
    while proposer.measuring:  # fast again: 12 ms, 2 ms of overhead; measured until the cost agrees
        proposer.observe_step(step([[], []]), 0.012, accepted=1)
        plain += 1
    assert 10 < plain < 40 and 0.012 >= RECHECK * cost(2)  # (26 steps: the overhead 40 -> 4.5 ms)
    overhead = cost.overhead
    proposer.observe_step(step([[], []]), 1.0, accepted=1)  # a stall
    assert cost.overhead == pytest.approx(0.9 * overhead + 0.1 * (STALL * (0.010 + overhead) - 0.010), rel=0.01)


def test_later_drafts_are_priced_at_the_proposers_continuation_where_it_is_higher():
    """A draft after an accepted one is accepted at the larger of the request's rate and the
    proposer's continuation: at 10 ms a step and 1 ms a draft, a request accepting 0.6 keeps 3
    drafts alone (its 4th worth 0.6^4), all 4 when acceptance continues at 0.9; one accepting
    0.95 is priced at its own rate either way."""
    cost = StepCost([1, 1024], [0.010, 0.010 + 1023 * 0.001])
    assert choose_num_drafts([0.6], [4], 1, cost) == [3]
    assert choose_num_drafts([0.6], [4], 1, cost, later=0.9) == [4]
    dear = StepCost([1, 1024], [0.010, 0.010 + 1023 * 0.005])  # 5 ms a draft: a first draft at 0.3 does not pay
    assert choose_num_drafts([0.3], [4], 1, dear, later=0.9) == [0]
    assert choose_num_drafts([0.95, 0.6], [4, 4], 2, cost, later=0.5) == choose_num_drafts([0.95, 0.6], [4, 4], 2,
                                                                                           cost)


def test_the_scheduler_counts_later_drafts_reached_and_accepted():
    """A verification of 4 drafts that accepts 2 reached drafts 2 and 3 after accepted ones and
    accepted draft 2; one that accepts all 4 reached and accepted 2, 3 and 4; one that rejects
    the first reached none."""
    llm = LLM(dtype="float32", kv_cache_memory="4MiB")
    scheduler = llm.engine.scheduler
    request, _ = llm.engine.make_request("def f():", SamplingParams(max_tokens=4))
    for drafts, accepted in ((4, 2), (4, 4), (3, 0), (1, 1)):
        scheduler._count_accepted(request, drafts, accepted)
    assert (scheduler.num_later_reached, scheduler.num_later_accepted) == (2 + 3 + 0 + 0, 1 + 3 + 0 + 0)


def test_one_requests_choice_in_plain_python_is_the_batch_forms():
    """A request alone is chosen for in plain Python (the array form's numpy calls took 0.125
    ms a step): the same drafts and the same prediction left for the calibration, over random
    costs, rates, catch-ups and calibrations."""
    from tokenmill.executor.spec.adaptive import _choose_many, _choose_one
    rng = np.random.default_rng(0)
    kept = 0
    for _ in range(400):
        counts = [1, 2, 4, 8, 9, 16, 32]
        cost = StepCost(counts, np.cumsum(rng.uniform(0, 1e-3, len(counts))) + rng.uniform(1e-3, 3e-3))
        cost.overhead, cost.query_attention = rng.uniform(0, 1e-3), rng.uniform(0, 1e-7)
        draft = None
        if rng.random() < 0.7:
            draft = StepCost(counts, np.cumsum(rng.uniform(0, 2e-4, len(counts))) + rng.uniform(1e-4, 1e-3))
            draft.overhead, draft.fixed = rng.uniform(0, 3e-4), rng.uniform(0, 2e-4)
            draft.catch_up, draft.attention = rng.uniform(0, 5e-5), rng.uniform(0, 1e-7)
        cal = Calibration()
        cal.tokens, cal.seconds, cal.confirmed = rng.uniform(0.5, 1.5), rng.uniform(0.5, 3), rng.random() < 0.5
        args = dict(contexts=[int(rng.integers(1, 2000))], behind=[int(rng.integers(0, 500))],
                    remaining=[int(rng.integers(1, 300))], first_rows=[int(rng.integers(1, 6))],
                    later=None if rng.random() < 0.3 else rng.uniform(0.2, 0.95))
        rate, limit = rng.uniform(0.05, 0.99), int(rng.integers(1, 9))
        other = Calibration()
        other.tokens, other.seconds, other.confirmed = cal.tokens, cal.seconds, cal.confirmed
        k = _choose_one(rate, limit, 1, cost, draft, calibration=cal, **args)
        assert [k] == _choose_many([rate], [limit], 1, cost, draft, calibration=other, **args)
        assert (cal.chosen is None) == (other.chosen is None)
        if cal.chosen is not None:
            assert cal.chosen == pytest.approx(other.chosen, rel=1e-9, abs=1e-15)
            kept += 1
    assert 50 < kept < 350  # both answers were tried


def test_verifying_drafts_teaches_what_it_adds_to_the_target_step_beyond_its_forward():
    """The target's step cost is timed at start-up as forwards; a step that verifies drafts also
    does the host work of the verification and the accepted tokens' updates, once a step. Each
    step that verifies chosen drafts teaches it (StepCost.verify: the step's time over its cost
    without drafts and the forward's price for them), and the choice adds it to any step with
    drafts: drafts worth less than that are no longer kept."""
    cost = StepCost([1, 1024], [0.010, 0.0101])
    assert choose_num_drafts([0.1, 0.1], [1, 1], 2, cost) == [1, 1]  # priced at the forward alone
    proposer = Proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 2048, cost)
    proposer.observe_step(step([[], []]), 0.010, accepted=0)
    priced = float(cost.forward(4) - cost.forward(2))
    for _ in range(60):
        proposer.calibration.chosen = (0.2, priced, priced)
        proposer.observe_step(step([[5], [6]]), cost(2) + priced + 0.002, accepted=0)
    assert cost.verify == pytest.approx(0.002, rel=0.01)
    assert choose_num_drafts([0.1, 0.1], [1, 1], 2, cost) == [0, 0]
    assert choose_num_drafts([0.9], [1], 1, cost) == [1]  # (one request's choice prices it too)
    assert choose_num_drafts([0.1], [1], 1, cost) == [0]
    for _ in range(60):  # steps faster than their price lower it, not below none
        proposer.calibration.chosen = (0.2, priced, priced)
        proposer.observe_step(step([[5], [6]]), cost(2) + priced - 0.001, accepted=0)
    assert cost.verify == 0.0
