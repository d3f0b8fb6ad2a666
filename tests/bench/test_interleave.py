"""Engines taking turns in one run (tokenmill.bench.interleave), on a tiny real model."""

from __future__ import annotations

import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.bench.interleave import run_interleaved

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15], [400] * 30, [1, 2]]


@pytest.fixture(scope="module")
def llms(checkpoints):
    return {name: LLM(str(checkpoints("llama")), dtype="float32", kv_cache_memory="16MiB", max_model_len=256,
                      max_num_seqs=2) for name in ("a", "b")}


def test_turns_alternate_and_each_engine_keeps_its_own_clock(llms):
    expected = [o.outputs[0].token_ids for o in llms["a"].generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                                   PARAMS, use_tqdm=False)]
    start = time.perf_counter()
    turns = run_interleaved(llms, PROMPTS, PARAMS, turn=0)  # one step a turn
    wall = time.perf_counter() - start
    for t in turns.values():
        assert [o.outputs[0].token_ids for o in t.outputs] == expected
    a, b = turns["a"], turns["b"]
    # same workload, same steps: a's turn k, then b's, then a's k + 1
    assert len(a.turns) == len(b.turns) > 12
    for k in range(len(a.turns) - 1):
        assert a.turns[k][0] <= b.turns[k][0] <= a.turns[k + 1][0]
    assert 0 < a.seconds and 0 < b.seconds and a.seconds + b.seconds <= wall
    # on its own clock, a request's tokens come at least as close together as on the wall's,
    # where the other engine's steps fall between them
    for t in (a, b):
        own = t.time_per_output_token()
        walls = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
                 for o in t.outputs]
        assert len(own) == len(PROMPTS)
        assert all(0 < x <= w + 1e-6 for x, w in zip(own, walls))
        assert sum(own) < sum(walls)
        assert max(own) * (PARAMS.max_tokens - 1) <= t.seconds


def test_longer_turns_take_several_steps(llms):
    turns = run_interleaved(llms, PROMPTS, PARAMS, turn=10.0)  # each engine runs to the end in its first turn
    assert [len(t.turns) for t in turns.values()] == [1, 1]
    assert turns["a"].turns[0][0] < turns["b"].turns[0][0]


def test_a_negative_turn_is_refused(llms):
    with pytest.raises(ValueError, match="turn"):
        run_interleaved(llms, PROMPTS, PARAMS, turn=-1)
