"""Speculative decoding (n-gram) on the built-in model, float32: greedy requests give exactly
the tokens, text and logprobs of decoding without drafts, alone or mixed with requests that
are served without speculation (penalised) or sampled; stop strings, max_tokens and EOS end
outputs where decoding without drafts does; sampled requests keep the distribution; the
cache's integrity holds after every step."""

from __future__ import annotations

import textwrap
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import scipy.stats

from tokenmill import LLM, SamplingParams
from tokenmill.config import DEFAULT_MODEL_DIR

# code from the standard library (fixed for a Python version; one of tokenmill's own files
# changed the prompts whenever it was edited)
SOURCE = Path(textwrap.__file__).read_text()[2000:3200]
# input-grounded: the model is asked to repeat code it has seen, so the drafts are often right
COPY = "# a copy of the code above\n" + SOURCE + "\n\n# the same again\n" + SOURCE[:200]
PROMPTS = [COPY, "def fibonacci(n):", "import os\nimport sys\nimport os\nimport sys\n", COPY[:600]]
# fixed: every draft found is verified, so the tests exercise verification at every batch size
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "adaptive": False}


def run(llm: LLM, params: list[SamplingParams]) -> list:
    """Every prompt with its params, step by step, checking the cache after each step."""
    engine = llm.engine
    requests = [engine.make_request(p, sp, request_id=str(i)) for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    for request, text in requests:
        engine.add_request(request, text, final_only=True)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        engine.kv_cache.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return [outs[str(i)] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def engines():
    args = dict(dtype="float32", kv_cache_memory="16MiB")
    return LLM(**args), LLM(**args, speculative_config=SPEC)


@pytest.fixture(scope="module")
def adaptive():
    return LLM(dtype="float32", kv_cache_memory="16MiB", speculative_config={**SPEC, "adaptive": True})


def completions(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_greedy_outputs_equal_decoding_without_drafts(engines):
    plain, spec = engines
    params = [SamplingParams(max_tokens=96, temperature=0, ignore_eos=True, logprobs=2)] * len(PROMPTS)
    before = spec.engine.stats()
    a, b = run(plain, params), run(spec, params)
    assert completions(b) == completions(a)
    for x, y in zip(a, b):
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert lx.keys() == ly.keys()
            assert list(ly.values()) == pytest.approx(list(lx.values()), abs=1e-4)
    stats = spec.engine.stats()
    drafts = stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert accepted > drafts / 2  # the copy is mostly predicted
    assert spec.engine.total_steps - plain.engine.total_steps < 0  # fewer steps for the same tokens


def test_adaptive_speculation_keeps_the_output_and_counts_its_choices(engines, adaptive):
    """Adaptive speculation verifies 0..k drafts per request and step (measured step cost,
    acceptance so far): greedy outputs stay those of decoding without drafts, and the
    choices are counted by k."""
    plain, _ = engines
    params = [SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)] * len(PROMPTS)
    assert completions(run(adaptive, params)) == completions(run(plain, params))
    stats = adaptive.engine.stats()
    by_k = stats["spec_decode_num_steps_by_k"]
    assert len(by_k) == SPEC["num_speculative_tokens"] + 1
    assert sum(k * n for k, n in enumerate(by_k)) == stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_the_step_cost_is_timed_where_the_linear_layers_change_paths():
    """Past its small_rows rows a linear layer leaves its small-step kernel for the packed
    weight (SMALL_ROWS in float32), and the step leaves the one-call forward: the start-up
    timing has a point on each side, so a step of SMALL_ROWS + 1 tokens is priced as timed.
    (The timing's steps go as far as the cache has blocks, one a sequence: a cache of
    2 x SMALL_ROWS blocks at least.)"""
    from tokenmill.executor.layers.linear import SMALL_ROWS, Linear
    block_bytes = 6 * 2 * 2 * 64 * 4 * 16  # the built-in model's layers, K and V, kv heads, head dim, float32, block
    adaptive = LLM(dtype="float32", kv_cache_memory=(2 * SMALL_ROWS + 8) * block_bytes,
                   max_num_batched_tokens=max(2048, 2 * SMALL_ROWS), speculative_config={**SPEC, "adaptive": True})
    runner = adaptive.engine.runner
    changes = {m.small_rows + 1 for m in runner.model.modules() if isinstance(m, Linear) and m.small is not None}
    assert changes == {SMALL_ROWS + 1}  # (float32: every small layer's)
    cost = runner.step_cost
    assert {*changes, SMALL_ROWS, 2 * SMALL_ROWS} <= set(cost.tokens.tolist())
    for n in changes:
        assert cost.forward(n) == pytest.approx(cost.seconds[cost.tokens.tolist().index(n)])


def test_mixed_batch_each_request_gets_what_it_would_alone(engines):
    """Greedy requests speculate; the penalised one is served without speculation (and
    counted); the greedy ones and the penalised one equal the engine without drafts, the
    seeded sampled one is reproducible."""
    plain, spec = engines
    params = [SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=48, temperature=0, frequency_penalty=0.5, ignore_eos=True),
              SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)]
    before = spec.engine.stats()["spec_decode_num_unspeculated_steps"]
    ours, theirs = completions(run(spec, params)), completions(run(plain, params))
    assert [ours[i] for i in (0, 2, 3)] == [theirs[i] for i in (0, 2, 3)]
    assert spec.engine.stats()["spec_decode_num_unspeculated_steps"] - before >= 48 - 1
    assert completions(run(spec, params))[1] == ours[1]  # the sampled one: the same seed, the same tokens


def test_stop_strings_eos_and_max_tokens_count_tokens_one_by_one(engines):
    """A stop string completed by an accepted draft ends the output there, the tokens after it
    in the same step are taken back; EOS and max_tokens end it where decoding would."""
    plain, spec = engines
    free = run(plain, [SamplingParams(max_tokens=96, temperature=0)] * len(PROMPTS))[0].outputs[0].text
    at = next(i for i in range(40, len(free)) if free.find(free[i:i + 5]) == i)
    stop = free[at:at + 5]  # first met some way into the output, where drafts are accepted
    params = [SamplingParams(max_tokens=96, temperature=0, stop=[stop]),
              SamplingParams(max_tokens=80, temperature=0),  # may end with EOS
              SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=96, temperature=0, stop=[stop], include_stop_str_in_output=True)]
    a, b = run(plain, params), run(spec, params)
    assert completions(b) == completions(a)
    assert a[0].outputs[0].finish_reason == "stop" and a[0].outputs[0].stop_reason == stop
    assert len(b[2].outputs[0].token_ids) == 5


@pytest.fixture(scope="module")
def adaptive_draft():
    """The built-in model with its built-in draft, adaptive (the default)."""
    return LLM(dtype="float32", kv_cache_memory="16MiB",
               speculative_config={"method": "draft_model", "num_speculative_tokens": 4})


@pytest.fixture(scope="module")
def draft():
    """The built-in model with its built-in draft (the default draft for it)."""
    return LLM(dtype="float32", kv_cache_memory="16MiB",
               speculative_config={"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False})


def test_draft_model_outputs_equal_decoding_without_drafts(engines, draft):
    """The built-in draft's drafts: greedy requests get the tokens and logprobs of decoding
    without drafts, beside a penalised one (served without them) and a sampled one; the
    cache's integrity holds after every step; a repeated prompt hits the prefix cache."""
    plain, _ = engines
    params = [SamplingParams(max_tokens=96, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=40, temperature=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=48, temperature=0, frequency_penalty=0.5, ignore_eos=True),
              SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, stop=["\n\n"])]
    for _ in range(2):  # the second time, the prompts' blocks are cached
        a, b = run(plain, params), run(draft, params)
        assert [completions([o])[0] for i, o in enumerate(b) if i != 1] == \
            [completions([o])[0] for i, o in enumerate(a) if i != 1]
        for lx, ly in zip(a[0].outputs[0].logprobs, b[0].outputs[0].logprobs):
            assert list(ly.values()) == pytest.approx(list(lx.values()), abs=1e-4)
    assert draft.engine.kv_cache.prefix_hits > 0
    stats = draft.engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_unspeculated_steps"] >= 2 * 47


@pytest.mark.parametrize("which", ["ngram", "draft_model"])
def test_sampled_tokens_keep_the_distribution_of_decoding_without_drafts(engines, draft, which):
    """Rejection sampling keeps the target's distribution: the 2nd and 3rd tokens of 400
    seeded requests with drafts have the histogram of 400 without them (two-sample
    chi-square), and the same seed gives the same tokens twice."""
    plain, spec = engines[0], engines[1] if which == "ngram" else draft
    prompt = "import os\nimport sys\nimport re\nimport os\nimport sys\nimport re\nimport"
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=s, ignore_eos=True) for s in range(400)]
    before = spec.engine.stats()
    a = plain.generate([prompt] * 400, params, use_tqdm=False)
    b = spec.generate([prompt] * 400, [replace(p, seed=p.seed + 1000) for p in params], use_tqdm=False)
    stats = spec.engine.stats()
    accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert accepted > 150  # the drafts ("os", "sys", ...) are often right
    for pos in (1, 2):
        ca = Counter(o.outputs[0].token_ids[pos] for o in a)
        cb = Counter(o.outputs[0].token_ids[pos] for o in b)
        common = [t for t in ca | cb if ca[t] + cb[t] >= 10]
        table = [[c[t] for t in common] + [400 - sum(c[t] for t in common)] for c in (ca, cb)]
        table = [row for row in zip(*table) if sum(row) > 0]  # columns with counts
        assert scipy.stats.chi2_contingency(list(zip(*table))).pvalue > 1e-3, (pos, ca, cb)
    again = spec.generate([prompt] * 8, [replace(p, seed=p.seed + 1000) for p in params[:8]], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in b[:8]]


def test_adaptive_drafting_learns_what_draft_forwards_cost_in_the_step():
    """The start-up timing runs the draft alone; in the engine its forwards can cost more
    (the target's weights evict the draft's from the cache, another load on the machine).
    Adaptive speculation times each step's drafting as it runs: when forwards are made 50 ms
    slower (or 8 steps' time, on a loaded machine), requests soon get no drafts at all."""
    import time

    llm = LLM(dtype="float32", kv_cache_memory="16MiB",
              speculative_config={"method": "draft_model", "num_speculative_tokens": 4})
    drafter = llm.engine.runner.drafter
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    by_k = lambda: list(llm.engine.stats()["spec_decode_num_steps_by_k"])  # noqa: E731
    for _ in range(4):  # cheap drafts of a repetitive prompt are verified (once the costs are learnt)
        llm.generate([PROMPTS[2]], params, use_tqdm=False)
        if sum(by_k()[1:]) > 0:
            break
    if sum(by_k()[1:]) == 0:  # whether the built-in draft pays depends on the machine and its load
        pytest.skip("adaptive speculation chose no drafts here even before the slowdown")

    start = time.perf_counter()
    llm.generate([PROMPTS[2]], params, use_tqdm=False)
    # The slowdown is against the step as this machine runs it now: at 50 ms a forward, a step
    # slowed by a loaded machine (another test run beside this one) could still find drafts worth it.
    delay = max(0.05, 8 * (time.perf_counter() - start) / params.max_tokens)
    forward, rows = drafter.model.forward, drafter.decode_rows  # (the modules' forward, the one-call one)
    drafter.model.forward = lambda *a, **kw: (time.sleep(delay), forward(*a, **kw))[1]
    drafter.decode_rows = lambda *a, **kw: (time.sleep(delay), rows(*a, **kw))[1]
    llm.generate([PROMPTS[2]], replace(params, max_tokens=96), use_tqdm=False)  # learns the cost
    learnt = drafter.draft_cost(1)
    assert learnt > float(drafter.draft_cost.forward(1))  # above what start-up measured
    before = by_k()
    llm.generate([PROMPTS[2]], params, use_tqdm=False)
    slow = [b - a for a, b in zip(before, by_k())]
    assert slow[0] >= 0.9 * sum(slow), slow  # almost every step without drafts
    drafter.model.forward, drafter.decode_rows = forward, rows


def test_a_draft_model_skips_resting_steps_and_catches_up_after_them(engines, monkeypatch):
    """When no draft pays, adaptive speculation rests for 1, 2, 4, ... steps, and in a resting
    step the draft does nothing at all (the runner does not call it): its requests fall behind
    and catch up when they next draft. The target as its own draft, with drafts said to pay at every third choice: the
    outputs are those without drafts, and every draft made is accepted (float32), which holds
    only if each catch-up covers every token of the rest before it."""
    import tokenmill.executor.spec.rests as draft_module

    calls = []

    def every_third(rates, limits, *args, **kwargs):
        calls.append(len(rates))
        return list(limits) if len(calls) % 3 == 0 else [0] * len(rates)

    monkeypatch.setattr(draft_module, "choose_num_drafts", every_third)
    llm = LLM(dtype="float32", kv_cache_memory="16MiB", speculative_config={
        "method": "draft_model", "model": str(DEFAULT_MODEL_DIR), "num_speculative_tokens": 3})
    drafter = llm.engine.runner.drafter
    params = [SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)] * len(PROMPTS)
    choices_before_resting = []
    idle = drafter.idle

    def counted(out, num_sampling):  # the runner asks before the drafter's step; a resting one skips it
        resting = idle(out, num_sampling)
        if resting:
            choices_before_resting.append(len(calls))
        return resting

    monkeypatch.setattr(drafter, "idle", counted)
    assert completions(run(llm, params)) == completions(run(engines[0], params))
    stats = llm.engine.stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert accepted >= 0.97 * drafted > 0
    assert len(calls) > 6 and len(choices_before_resting) > 6  # it chose, and it rested
    assert len(set(choices_before_resting)) < len(choices_before_resting)  # rests of more than a step


def test_later_draft_forwards_of_more_requests_than_one_call_takes_run_through_the_modules(engines, monkeypatch):
    """On the CPU, a step's later draft forwards (2 to k) run in one native call each while their
    requests fit in it (fused_rows, 256), and through the modules when there are more. With
    fused_rows at 2 and the target as its own draft (float32: every draft accepted), 4 requests
    that finish one by one take both: the outputs are those without drafts."""
    llm = LLM(dtype="float32", kv_cache_memory="16MiB", speculative_config={
        "method": "draft_model", "model": str(DEFAULT_MODEL_DIR), "num_speculative_tokens": 3, "adaptive": False})
    drafter = llm.engine.runner.drafter
    if drafter.fused is None:
        pytest.skip("the one-call draft forward needs small_linear (AVX2 and FMA) in float32")
    monkeypatch.setattr(drafter, "fused_rows", 2)
    monkeypatch.setattr(drafter, "fused_drafts", False)  # (small_draft_chain: all of forwards 2 to k in one call)
    later = Counter()  # the later forwards' calls: _decode_rows(at, table, ids), _forward(lens, at, table, ids, rows)
    for name, arity in (("_decode_rows", 3), ("_forward", 5)):
        def counted(*args, _call=getattr(drafter, name), _name=name, _arity=arity):
            later[_name] += len(args) == _arity
            return _call(*args)
        monkeypatch.setattr(drafter, name, counted)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (96, 72, 48, 24)]
    assert completions(run(llm, params)) == completions(run(engines[0], params))
    stats = llm.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] >= 0.97 * stats["spec_decode_num_draft_tokens"] > 0
    assert later["_decode_rows"] > 0 and later["_forward"] > 0, later


def test_a_catch_up_forward_is_split_into_its_drafting_rows_and_the_catch_up(adaptive_draft):
    """A draft forward whose rows catch up with a request (a prompt) besides the drafting
    requests' own rows: those own rows count as a decode-shaped forward at their learnt cost,
    the rest of its time is the step's measured catch-up (what the calibration leaves out),
    and a catch-up of CATCH_UP_ROWS rows or more teaches what a catch-up token costs."""
    drafter = adaptive_draft.engine.runner.drafter
    cost = drafter.draft_cost
    adaptive_draft.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    drafter._new_step()
    priced = float(cost.forward(3)) + cost.overhead
    rate = cost.catch_up
    drafter._timed(priced + 0.004, 403, 400)  # 3 rows of its own, 400 catching up in 4 ms more
    assert drafter.forwards == [3] and drafter.forward_seconds == pytest.approx(priced)
    assert drafter.catch_up_seconds == pytest.approx(0.004)
    assert cost.catch_up == pytest.approx(0.9 * rate + 0.1 * min(0.004 / 400, 4 * rate))
    drafter._timed(0.0001, 2, 0)  # decode-shaped: all its own
    assert drafter.forwards == [3, 2] and drafter.catch_up_seconds == pytest.approx(0.004)
    drafter._timed(0.5 * priced, 403, 400)  # faster than its own rows' price: no catch-up time
    assert drafter.catch_up_seconds == pytest.approx(0.004)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_draft_forward_equals_the_modules(dtype):
    """Where the built-in draft model's layers run on amx_linear (a CPU with AMX, bfloat16) or on
    small_linear (float32, a CPU with AVX2 and FMA), its forwards run in one native call
    (executor/fused_decoder.py), each token a row of its own (one a request for later drafts;
    a request's new tokens, or a catch-up, in a step's first forward): each gives the modules'
    hidden states over the same rows bit for bit, and where the drafts' head joins the call
    (small_llama_draft), the drafts of the modules' argmax. A step's later forwards run in one
    call (small_draft_chain), whose drafts are those of the same forwards one by one."""
    import numpy as np
    import torch

    from tokenmill.executor.attention import AttentionMetadata

    llm = LLM(str(DEFAULT_MODEL_DIR), dtype=dtype, max_num_seqs=3,
              speculative_config={"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False})
    drafter = llm.engine.runner.drafter
    if drafter.fused is None:
        pytest.skip("the one-call draft forward needs amx_linear (AMX-BF16) in bfloat16, small_linear (AVX2 and "
                    "FMA) in float32")
    kernels, rows, drafted = drafter.kernels, [], []

    class Both:
        @staticmethod
        def small_llama_decode(model, ids, positions, slots, table, seq_lens, block_size):
            fused = kernels.small_llama_decode(model, ids, positions, slots, table, seq_lens, block_size)
            # the modules over the same rows (the same K/V written again), their attention planned as _forward does
            drafter.attn.begin_step(AttentionMetadata.from_host(np.ones(len(ids), dtype=np.int32), seq_lens.numpy(),
                                                                table.numpy(), slots, block_size, torch.from_numpy))
            assert torch.equal(fused, drafter.model(ids, positions, drafter.attn))
            rows.append(len(ids))
            return fused

        @staticmethod
        def small_llama_draft(model, ids, positions, table, block_size, at=None):
            slots = table[torch.arange(len(ids)), positions // block_size].long() * block_size + positions % block_size
            hidden = Both.small_llama_decode(model, torch.tensor(ids), positions, slots, table,
                                             (positions + 1).int(), block_size)
            drafts = kernels.small_llama_draft(model, ids, positions, table, block_size, at)
            assert drafts == drafter._argmax(hidden if at is None else hidden[at]).tolist()
            drafted.append(len(drafts))
            return drafts

        @staticmethod
        def small_draft_chain(model, firsts, positions, table, block_size, ks, features):
            assert features is None  # (an EAGLE head's)
            chained = kernels.small_draft_chain(model, firsts, positions, table, block_size, ks)
            drafts, ks, active = [[first] for first in firsts], np.array(ks), np.arange(len(firsts))
            for j in range(1, int(ks.max())):  # the same forwards one by one: forward j feeds draft j
                active = active[ks[active] > j]
                at = torch.from_numpy(active)
                nxt = Both.small_llama_draft(model, [drafts[a][-1] for a in active], positions[at] + j - 1, table[at],
                                             block_size)
                for a, t in zip(active, nxt):
                    drafts[a].append(t)
            assert chained == [d[1:] for d in drafts]
            chains.append(len(firsts))
            return chained

    chains = []
    drafter.kernels = Both
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    assert rows and min(rows) == 1 and max(rows) > 3  # later drafts of 1-3 requests, first forwards of more tokens
    # the built-in drafter's head (its token map's 2048 rows) runs on the layers' kernel: every forward drafts in
    # the call
    assert drafter.fused_drafts and len(drafted) == len(rows)
    assert chains and max(chains) > 1  # a step's later drafts in one call (small_draft_chain), of several requests
