"""Async scheduling (engine.py): step N + 1 is scheduled and launched before step N's tokens
reach the host, and a request decoding in both reads its pending token from the device.
On the CPU nothing overlaps, but the bookkeeping is the same as on CUDA, so it is checked
here: on the built-in model in float32, greedy and seeded requests give exactly the tokens,
text and logprobs of scheduling each step after the last one's update, through chunked
prefill, prefix hits, preemption, parallel sampling, stop strings, min_tokens, penalties,
grammars and aborts; the cache's integrity holds after every step and every block comes
back at the end."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.config import EngineConfig
from tokenmill.engine.request import RequestStatus

SOURCE = Path(textwrap.__file__).read_text()[2000:2600]  # standard-library code: fixed for a Python version
PROMPTS = [
    SOURCE,  # longer than the step budget: chunked
    "def fibonacci(n):",
    SOURCE[:300] + "\n\ndef helper(x):",  # a prefix hit on the first prompt's blocks
    "import os\nimport sys\n",
    "class Stack:\n    def __init__(self):",
    SOURCE[:300] + "\n\nclass Node:",
    "for i in range(10):\n",
    "# sort a list\ndef sort(xs):",
]
PARAMS = [
    SamplingParams(max_tokens=40, temperature=0, logprobs=2),
    SamplingParams(max_tokens=48, temperature=0.8, top_p=0.9, seed=7),
    SamplingParams(max_tokens=36, temperature=0, stop=["\n\n"], include_stop_str_in_output=True),
    SamplingParams(max_tokens=30, temperature=0.7, seed=3, n=2, logprobs=1),
    SamplingParams(max_tokens=44, temperature=0, min_tokens=20, presence_penalty=0.6, repetition_penalty=1.2),
    SamplingParams(max_tokens=1, temperature=0),
    SamplingParams(max_tokens=50, temperature=1.0, seed=11, frequency_penalty=0.4, top_k=20),
    SamplingParams(max_tokens=33, temperature=0, ignore_eos=True),
]


def make(async_scheduling: bool, **kwargs) -> LLM:
    # a cache too small for the batch (it preempts) and a step budget below the longest prompt
    args = dict(dtype="float32", kv_cache_memory="2MiB", max_num_batched_tokens=96, max_num_seqs=6)
    return LLM(**{**args, **kwargs}, async_scheduling=async_scheduling)


def run(llm: LLM, prompts: list, params: list[SamplingParams], abort: dict[int, str] | None = None) -> dict:
    """Every prompt with its params, step by step, checking the cache after each step;
    `abort`: {step: request id} aborted before that step. Returns the final outputs by id
    and how many steps were scheduled while a request's token was pending (`overlapped`;
    `overlapped_sync_only`: of which while a grammar or bad-words request was in the engine)."""
    engine = llm.engine
    schedule = engine.scheduler.schedule
    counts = {"overlapped": 0, "overlapped_sync_only": 0, "preempted_in_flight": 0}

    def counting_schedule():
        if any(r.num_pending_tokens for r in engine.scheduler.running):
            counts["overlapped"] += 1
            counts["overlapped_sync_only"] += bool(engine._sync_only)
        return schedule()

    update = engine.scheduler.update

    def counting_update(out, result):
        counts["preempted_in_flight"] += sum(r.status == RequestStatus.PREEMPTED for r in out.sampling_requests)
        return update(out, result)

    engine.scheduler.schedule, engine.scheduler.update = counting_schedule, counting_update
    try:
        result = _run(engine, prompts, params, abort)
    finally:
        del engine.scheduler.schedule, engine.scheduler.update
    return {**result, **counts}


def _run(engine, prompts: list, params: list[SamplingParams], abort: dict[int, str] | None) -> dict:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        request, text = engine.make_request(p, sp, request_id=str(i))
        engine.add_request(request, text, final_only=True)
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        if abort and steps in abort:
            out = engine.abort_request(abort[steps])
            if out is not None:
                outs[out.request_id] = out
        steps += 1
        for out in engine.step():
            outs[out.request_id] = out
        engine.kv_cache.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return {"outs": outs, "preemptions": engine.scheduler.num_preemptions,
            "hits": engine.kv_cache.prefix_hits}


def completions(out) -> list:
    return [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]


@pytest.fixture(scope="module")
def engines():
    return make(False), make(True)


@pytest.fixture(scope="module")
def expected(engines):
    return run(engines[0], PROMPTS, PARAMS)


def test_outputs_equal_scheduling_each_step_after_the_last(engines, expected):
    sync, async_ = engines
    assert not sync.engine.runner.async_scheduling and async_.engine.runner.async_scheduling
    got = run(async_, PROMPTS, PARAMS)
    # the workload reaches what it is meant to: preemption, prefix hits, overlapped steps
    assert expected["preemptions"] > 0 and got["preemptions"] > 0
    assert got["hits"] > 0 and got["preempted_in_flight"] > 0  # they resume with that token
    assert got["overlapped"] > 10 and expected["overlapped"] == 0
    for i in range(len(PROMPTS)):
        a, b = expected["outs"][str(i)], got["outs"][str(i)]
        assert completions(b) == completions(a), i
        for ca, cb in zip(a.outputs, b.outputs):
            if ca.logprobs is None:
                continue
            for tok, lp_a, lp_b in zip(ca.token_ids, ca.logprobs, cb.logprobs):
                assert lp_b[tok] == pytest.approx(lp_a[tok], abs=1e-5)
    assert len(got["outs"]["3"].outputs) == 2
    assert got["outs"]["4"].outputs[0].finish_reason == "length"  # min_tokens held it past EOS


def test_the_last_output_comes_in_the_call_after_its_step():
    """One request: the step that samples its last token returns nothing; the next call
    takes that step's tokens and returns the output, with nothing left to run."""
    llm = make(True, kv_cache_memory="4MiB")
    engine = llm.engine
    request, text = engine.make_request("def f(x):", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    engine.add_request(request, text)
    tokens = []
    for _ in range(3):  # the prefill samples token 1; tokens 2 and 3 are scheduled before 1 and 2 are known
        outs = engine.step()
        tokens += [t for o in outs for t in o.outputs[0].token_ids[len(tokens):]]
    assert len(tokens) == 2 and engine.has_unfinished_requests()
    [out] = engine.step()
    assert out.finished and len(out.outputs[0].token_ids) == 3
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_grammar_and_bad_words_requests_run_each_step_after_the_last(engines, expected):
    """Their next inputs need their last token on the host: while one is in flight, each step
    waits for the last one's update; the others beside them still give the same tokens."""
    sync, async_ = engines
    choice = SamplingParams(max_tokens=20, temperature=0, structured_outputs=StructuredOutputsParams(choice=["alpha", "beta gamma"]))
    bad = SamplingParams(max_tokens=24, temperature=0, bad_words=["def", " return"])
    prompts = PROMPTS[:4] + ["The answer is", "def g():\n   "]
    params = PARAMS[:4] + [choice, bad]
    want = run(sync, prompts, params)
    got = run(async_, prompts, params)
    for i in range(len(prompts)):
        assert completions(got["outs"][str(i)]) == completions(want["outs"][str(i)]), i
    assert got["outs"]["4"].outputs[0].text in ("alpha", "beta gamma")
    assert got["overlapped_sync_only"] == 0
    assert got["overlapped"] > 0  # once they ended


def test_an_abort_while_its_step_runs_leaves_the_others_unchanged(engines, expected):
    sync, async_ = engines
    params = [sp for sp in PARAMS]
    # request 1 aborted at step 6, while a step with it is in flight; the others as before
    got = run(async_, PROMPTS, params, abort={6: "1"})
    assert got["outs"]["1"].outputs[0].finish_reason == "abort"
    for i in (0, 2, 4, 5, 7):  # greedy: what the others get does not depend on the batch
        assert completions(got["outs"][str(i)]) == completions(expected["outs"][str(i)]), i


@pytest.mark.parametrize("kwargs, key", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size"),
])
def test_async_scheduling_with_what_it_cannot_run_with_is_an_error(kwargs, key):
    with pytest.raises(ValueError, match=f"async_scheduling does not run with {key}"):
        EngineConfig(async_scheduling=True, **kwargs)


def test_the_default_is_off_on_the_cpu(engines):
    llm = LLM(dtype="float32", kv_cache_memory="1MiB")
    assert llm.engine.runner.async_scheduling is False


def test_aborting_a_request_whose_fork_step_is_in_flight_ends_every_sequence():
    """The step that forks n sequences is in flight when the abort comes: the forks end too."""
    llm = make(True, kv_cache_memory="4MiB")
    engine = llm.engine
    request, text = engine.make_request("def f(x):", SamplingParams(max_tokens=30, temperature=0.8, n=3))
    engine.add_request(request, text)
    assert engine.step() == []  # the prefill, which forks, is launched and in flight
    assert len(engine.scheduler.running) == 3
    out = engine.abort_request(request.request_id)
    assert out is not None and out.finished
    assert not engine.scheduler.running and not engine.has_unfinished_requests()
    assert engine.step() == []  # takes the step in flight; nothing comes of it
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    engine.kv_cache.check_integrity()
