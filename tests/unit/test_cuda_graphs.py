"""The GPU start-up paths on the CPU.

- The CUDA-graph runner's data path: static buffers, padding to the bucket (slot -1,
  empty contexts), bucket choice. Capture itself needs CUDA (tests/gpu); here each
  bucket's "graph" re-runs the forward on the same static buffers and plan, with the
  Triton kernels under the interpreter.
- The profiling forward that sizes the KV cache on CUDA: the largest step, over a
  throwaway cache.
- Speculative decoding's steps through the graph runner (verification a row a token, the
  drafters' own graphs), and a drafter's weights in the KV budget.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from tests.models.test_parity import PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.config import DEFAULT_DRAFT_MODEL_DIR, DEFAULT_EAGLE_MODEL_DIR, DEFAULT_MODEL_DIR
from tokenmill.executor.cuda_graphs import CudaGraphRunner, EagerReplay, drafter_graphs, target_graphs
from tokenmill.executor.memory import checkpoint_bytes, profile_forward
from tokenmill.executor.spec.timing import measure_step_cost

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


def recording(graphs: CudaGraphRunner) -> tuple[list[int], list[int]]:
    """The tokens of each step graphs runs, and the bucket each replays, from now on."""
    tokens, buckets = [], []
    for b, captured in graphs.graphs.items():
        original = captured.graph.replay
        captured.graph.replay = lambda b=b, original=original: (buckets.append(b), original())
    run = graphs.run

    def counted(input_ids, *args, **kwargs):
        tokens.append(len(input_ids))
        return run(input_ids, *args, **kwargs)

    graphs.run = counted
    return tokens, buckets


def longest_runs(graphs: CudaGraphRunner) -> list[int]:
    """The longest run of one request's rows (row_spans) in each step graphs runs, from now on."""
    longest = []
    run = graphs.run

    def counted(*args, **kwargs):
        hidden = run(*args, **kwargs)
        longest.append(int(graphs.row_spans.max()))
        return hidden

    graphs.run = counted
    return longest


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_verification_steps_replay_graphs_a_row_a_token(checkpoints, method):
    """With speculation, a step that verifies k drafts a request replays a graph with each token
    a row (its request's block table row, its context up to itself), in buckets up to
    max_num_seqs x (k + 1) rows; a draft model's forwards replay graphs of their own, an EAGLE
    head's (the built-in model's) with the target's hidden states in a static buffer. The greedy
    outputs, and the drafts (as counted), are those of the engine without graphs, whose outputs
    are plain decoding's (tests/models/test_parity.py, test_eagle.py)."""
    path = str(DEFAULT_MODEL_DIR if method == "eagle" else checkpoints("llama_tied_llama3rope"))
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=2)
    elif method == "draft_model":
        spec["model"] = path  # the target as its own draft: every draft accepted
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    args = dict(dtype="float32", kv_cache_memory="8MiB", attention_backend="triton", max_num_seqs=3)
    eager = LLM(path, **args, speculative_config={**spec, "adaptive": False})
    expected = eager.generate(prompts, params, use_tqdm=False)
    counts = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")

    llm = LLM(path, **args, speculative_config={**spec, "adaptive": False})
    runner = llm.engine.runner
    runner.graphs = target_graphs(runner, 64)  # as the runner captures them on CUDA
    assert runner.graphs.buckets == [1, 2, 4, 8, 12]
    target, target_buckets = recording(runner.graphs)
    target_spans = longest_runs(runner.graphs)
    drafter = runner.drafter
    if drafter is not None:
        assert drafter.fused is None  # (beside Triton the layers are not the one-call forward's)
        drafter.graphs = drafter_graphs(drafter)
        assert drafter.graphs.buckets == [1, 2, 4, 8, 15]
        assert (drafter.graphs.features is not None) == (method == "eagle")
        drafts, draft_buckets = recording(drafter.graphs)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in expected]
    stats = llm.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert [stats[c] for c in counts] == [eager.engine.stats()[c] for c in counts]
    assert max(target) > 3 and max(target_buckets) >= 8  # a verification of several tokens a request
    # each request's rows read its context once: the attention's runs of up to k + 1 rows
    assert runner.graphs.max_span == 4 and runner.attn.max_span >= 4
    assert {g.plan.decodes.span for g in runner.graphs.graphs.values()} == {4} and max(target_spans) > 1
    if method == "draft_model":
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]  # its own draft
    if drafter is not None:
        assert max(drafts) > 3 and drafts.count(3) > 0  # forward 1's catch-ups, then a token a request
        assert len(draft_buckets) == len(drafts)
        assert {g.plan.decodes.span for g in drafter.graphs.graphs.values()} == {5}  # k + 2
    llm.engine.kv_cache.check_integrity()
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
    if method == "ngram":  # adaptive speculation's start-up timing replays the graphs as the steps do
        timed, _ = recording(runner.graphs)
        measure_step_cost(runner, 12, repeats=1, context=8, verify=4)
        assert 1 in timed and 12 in timed  # a decode of one request; verifications of 4 tokens for 3


@pytest.mark.parametrize("engine_args", [dict(max_num_batched_tokens=4), dict(kv_cache_memory=4 * 4096)],
                         ids=["chunks-of-4", "preemption"])
def test_prompt_chunks_preemption_and_prefix_hits_through_verification_graphs(checkpoints, engine_args):
    """Prompt chunks of up to k + 1 tokens replay the graphs a row a token too; preemption
    (4 blocks of 16 tokens for 3 requests) and a second pass's prefix hits run through them:
    n-gram's outputs are those of the engine without graphs."""
    path = str(checkpoints("llama_tied_llama3rope"))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
            "adaptive": False}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    args = {**dict(dtype="float32", kv_cache_memory="8MiB", attention_backend="triton", max_num_seqs=3,
                   speculative_config=spec), **engine_args}
    eager = LLM(path, **args)
    expected = [o.outputs[0].token_ids for _ in range(2) for o in eager.generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, **args)
    runner = llm.engine.runner
    runner.graphs = target_graphs(runner, engine_args.get("max_num_batched_tokens", 64))
    target, _ = recording(runner.graphs)
    first = llm.generate(prompts, params, use_tqdm=False)
    second = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + second] == expected
    assert any(o.metrics.num_cached_tokens > 0 for o in second)
    assert max(target) > 1
    if "kv_cache_memory" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0
    else:
        assert runner.graphs.buckets == [1, 2, 4]  # within the step's 4 tokens
    llm.engine.kv_cache.check_integrity()
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


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


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_what_a_drafter_holds_is_counted_from_its_checkpoint(method, tmp_path):
    """On CUDA a drafter loads after the KV cache has taken its share, so the budget counts its
    weights from its checkpoint's headers: the bytes the loaded drafter holds (in bfloat16, where
    the CPU's float32 layers do not repack their weights), twice that in float32; a checkpoint
    that carries copies of the target's embedding and LM head (some EAGLE heads do) or a tied
    draft's LM head counts without them, as they are not loaded. What the drafter holds besides
    (drafter_bytes): its rotary table, its LM head cut to its token map, and its scratch blocks."""
    from safetensors.torch import save_file

    from tokenmill.executor.memory import drafter_bytes
    from tokenmill.executor.spec.checkpoint import skipped_tensors

    path = tmp_path / "drafter"
    shutil.copytree(DEFAULT_EAGLE_MODEL_DIR if method == "eagle" else DEFAULT_DRAFT_MODEL_DIR, path)
    copies = {"model.embed_tokens.weight": torch.ones(8192, 256), "lm_head.weight": torch.ones(8192, 256)} \
        if method == "eagle" else {"lm_head.weight": torch.ones(8192, 128)}
    save_file({name: t.bfloat16() for name, t in copies.items()}, path / "z_copies.safetensors")
    spec = {"method": method, "model": str(path), "num_speculative_tokens": 5, "adaptive": False,
            "token_map": str(path / "token_map.json")}
    llm = LLM(dtype="bfloat16", kv_cache_memory="8MiB", block_size=4, max_num_seqs=6, speculative_config=spec)
    runner, drafter = llm.engine.runner, llm.engine.runner.drafter
    skipped = skipped_tensors(runner.config.speculative_config, drafter.model_config)
    held = sum(p.numel() * p.element_size() for p in drafter.model.parameters())
    table = sum(b.numel() * b.element_size() for b in drafter.model.buffers())  # the rotary table
    assert checkpoint_bytes(path, torch.bfloat16, skipped) == held > 0
    assert checkpoint_bytes(path, torch.float32, skipped) == 2 * held
    assert checkpoint_bytes(path, torch.bfloat16) == held + sum(t.numel() * 2 for t in copies.values())
    # the cut head unpacked (the CPU repacks it), and the cache's slots past the shared blocks'
    head = len(drafter.vocab) * drafter.model_config.hidden_size * 2
    scratch = (drafter.kv_cache.num_slots - runner.num_blocks * 4) * drafter.model_config.kv_bytes_per_token(
        drafter.kv_cache_dtype)
    assert 0 < len(drafter.vocab) < 8192 and scratch >= 6 * 4 * 4 * drafter.model_config.num_layers
    assert drafter_bytes(runner.config.speculative_config, path, drafter.model_config, torch.bfloat16,
                         drafter.kv_cache_dtype, 4, 6, runner.max_model_len) == held + table + head + scratch > 0
