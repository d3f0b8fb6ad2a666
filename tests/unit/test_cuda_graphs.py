"""The GPU start-up paths on the CPU.

- The CUDA-graph runner's data path: static buffers, padding to the bucket (slot -1,
  empty contexts), bucket choice. Capture itself needs CUDA (tests/gpu); here each
  bucket's "graph" re-runs the forward on the same static buffers and plan, with the
  Triton kernels under the interpreter.
- The profiling forward that sizes the KV cache on CUDA: the largest step, over a
  throwaway cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.test_parity import PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.executor.cuda_graphs import CudaGraphRunner, EagerReplay
from tokenmill.executor.memory import profile_forward

pytest.importorskip("tokenmill.executor.attention.triton", reason="Triton is not installed")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graph_runner_pads_to_buckets_and_matches_eager(checkpoints, async_scheduling):
    """With async scheduling, each decode's input id is put into the static buffer on the device."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:5]]
    path = str(checkpoints("qwen3"))
    eager = LLM(path, dtype="float32", kv_cache_memory="8MiB", attention_backend="triton")
    expected = eager.generate(prompts, params, use_tqdm=False)

    llm = LLM(path, dtype="float32", kv_cache_memory="8MiB", attention_backend="triton", max_num_seqs=5,
              async_scheduling=async_scheduling)
    runner = llm.engine.runner
    runner.graphs = CudaGraphRunner(runner, max_batch_size=5)
    runner.graphs.capture()
    assert runner.graphs.buckets == [1, 2, 4, 5]
    assert all(isinstance(g.graph, EagerReplay) for g in runner.graphs.graphs.values())
    replays = []
    for b, captured in runner.graphs.graphs.items():
        original = captured.graph.replay
        captured.graph.replay = lambda b=b, original=original: (replays.append(b), original())
    # 5 prompts decode together (bucket 5), then one prompt alone (bucket 1) pads nothing;
    # 3 prompts pad to bucket 4 with a padding row that must leave the cache untouched
    out = llm.generate(prompts, params, use_tqdm=False)
    out3 = llm.generate(prompts[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].token_ids for o in out3] == [o.outputs[0].token_ids for o in expected[:3]]
    for a, b in zip(out, expected):
        for lp_a, lp_b, tok in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert lp_a[tok] == pytest.approx(lp_b[tok], abs=1e-4)
    assert 5 in replays and 4 in replays
    llm.engine.kv_cache.check_integrity()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_profile_forward_runs_the_largest_step_on_a_throwaway_cache(checkpoints, backend):
    llm = LLM(str(checkpoints("llama")), dtype="float32", kv_cache_memory="8MiB", attention_backend=backend,
              max_num_seqs=6)
    runner = llm.engine.runner
    profile_forward(runner, 40)  # 6 requests of 6-7 tokens, logits and sampling for 6 rows
    assert not runner.kv_cache.data.any()  # the engine's own cache was not touched


def test_step_block_tables_are_zero_padded_rows():
    """The runner's block table: each request's (scattered) block ids, then zeros, in the
    step's order; a row freed and taken again holds only its new request's ids."""
    from tokenmill.engine.block_table import BlockTableRows

    rows = BlockTableRows()
    for rid, ids in [("gone", [4, 4, 4, 4, 4]), ("a", [7, 3]), ("b", [12]), ("c", []), ("d", [5, 1])]:
        rows.write(rid, 0, ids)
    rows.write("a", 2, [9])
    rows.drop("gone")
    rows.write("e", 0, [8])  # takes the dropped row
    table = rows.gather(["a", "b", "c", "d", "e"], 3)
    assert table.dtype == np.int32
    assert table.tolist() == [[7, 3, 9], [12, 0, 0], [0, 0, 0], [5, 1, 0], [8, 0, 0]]
