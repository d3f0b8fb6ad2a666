"""The engine on a CUDA device: parity with HF transformers in bfloat16, CUDA graphs against
eager, the Triton backend against the torch reference on the same paged cache. Skipped
without CUDA (benchmarks/gpu_throughput.py runs them in a device session)."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.conftest import make_checkpoint
from tests.models.test_parity import PROMPTS, assert_close_outputs, hf_greedy
from tests.unit.test_cuda_graphs import recording
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NUM_TOKENS = 32
PARAMS = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # head_dim 64, GQA 2, big enough that bf16 rounding matters as it does in real models
    return make_checkpoint(tmp_path_factory.mktemp("gpu") / "qwen3", "qwen3", hidden=256, layers=4)


def run(path, prompts=PROMPTS, **engine_args):
    gc.collect()  # engines of earlier tests give their memory back first
    torch.cuda.empty_cache()
    llm = LLM(str(path), device="cuda", **{"gpu_memory_utilization": 0.3, **engine_args})
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_bf16_parity_with_transformers(checkpoint):
    """Greedy tokens equal for most prompts; where they part, a near-tie (top-5 both ways)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda().eval()
    ref = []
    with torch.no_grad():
        for p in PROMPTS:
            gen = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=NUM_TOKENS,
                                 min_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True)
            ref.append((gen.sequences[0, len(p):].tolist(), [torch.log_softmax(s[0].float(), -1).cpu()
                                                              for s in gen.scores]))
    _, ours = run(checkpoint, dtype="bfloat16")
    assert_close_outputs(ref, ours, "qwen3-bf16-cuda")
    equal = sum(t == r for t, (r, _) in zip(tokens(ours), ref))
    assert equal >= len(PROMPTS) // 2, f"only {equal} of {len(PROMPTS)} prompts gave HF's exact tokens"


def test_step_has_no_hidden_host_syncs(checkpoint):
    """torch flags every implicit sync (.item(), blocking copies, nonzero, ...): a step may only
    wait where it means to, on the sampled ids (and logprobs) and on last step's input copies."""
    llm = LLM(str(checkpoint), device="cuda", gpu_memory_utilization=0.3, dtype="bfloat16")
    sampled = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=20, seed=3, logprobs=2)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)  # warm-up
    torch.cuda.set_sync_debug_mode("error")
    try:
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [PARAMS, sampled] * 3, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_float32_matches_transformers(checkpoint):
    """HF in float32 on the CPU, tokenmill in float32 on the GPU (cuBLAS sums in another order):
    a near-tie at most, and no more than one prompt parts."""
    ref = hf_greedy(checkpoint, PROMPTS, NUM_TOKENS)
    _, ours = run(checkpoint, dtype="float32")
    assert_close_outputs(ref, ours, "qwen3-float32-cuda")
    assert sum(t == r for t, (r, _) in zip(tokens(ours), ref)) >= len(PROMPTS) - 1


def test_cuda_graphs_equal_eager(checkpoint):
    llm, graphs = run(checkpoint, dtype="float32")
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    _, eager = run(checkpoint, dtype="float32", enforce_eager=True)
    assert tokens(graphs) == tokens(eager)
    for a, b in zip(graphs, eager):
        for step, (lp_a, lp_b) in enumerate(zip(a.outputs[0].logprobs, b.outputs[0].logprobs)):
            tok = a.outputs[0].token_ids[step]
            assert lp_a[tok] == pytest.approx(lp_b[tok], abs=1e-3)


@pytest.mark.parametrize("engine_args", [{}, dict(num_gpu_blocks_override=12)], ids=["plain", "preemption"])
def test_async_scheduling_equals_scheduling_after_each_update(checkpoint, engine_args):
    """CUDA graphs with each decode's input id put on the device from the last step's ids, and
    steps scheduled while the GPU runs the last one: the same tokens and logprobs as sync."""
    llm, fast = run(checkpoint, dtype="float32", **engine_args)
    assert llm.engine.runner.async_scheduling and llm.engine.runner.graphs is not None
    sampled = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=5, min_tokens=4)
    fast_sampled = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampled, use_tqdm=False)
    llm.engine.kv_cache.check_integrity()
    in_step, slow = run(checkpoint, dtype="float32", async_scheduling=False, **engine_args)
    slow_sampled = in_step.generate([{"prompt_token_ids": p} for p in PROMPTS], sampled, use_tqdm=False)
    assert tokens(fast) == tokens(slow) and tokens(fast_sampled) == tokens(slow_sampled)
    for a, b in zip(fast, slow):
        for step, (lp_a, lp_b) in enumerate(zip(a.outputs[0].logprobs, b.outputs[0].logprobs)):
            tok = a.outputs[0].token_ids[step]
            assert lp_a[tok] == pytest.approx(lp_b[tok], abs=1e-5)


@pytest.mark.parametrize("engine_args", [
    {},
    dict(max_num_batched_tokens=7),  # chunked prefill
    dict(num_gpu_blocks_override=12),  # 192 tokens of KV: preemption
], ids=["plain", "chunked-7", "preemption"])
def test_triton_equals_torch_backend(checkpoint, engine_args):
    """Same paged cache layout, same tokens; a second pass hits the prefix cache."""
    outs = {}
    for backend in ("triton", "torch"):
        llm, first = run(checkpoint, dtype="float32", attention_backend=backend, enforce_eager=True,
                         **engine_args)
        second = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        assert any(o.metrics.num_cached_tokens > 0 for o in second)
        llm.engine.kv_cache.check_integrity()
        if "num_gpu_blocks_override" in engine_args:
            assert llm.engine.scheduler.num_preemptions > 0
        outs[backend] = tokens(first) + tokens(second)
    assert outs["triton"] == outs["torch"]


def test_an_unreachable_engine_leaves_its_memory_to_the_next(checkpoint):
    """An engine dropped while in a reference cycle (no collection has run yet) does not take
    its KV cache's memory from the next engine's budget: the budget is measured after a
    collection (with the automatic collector off, nothing else would free it)."""
    gc.collect()
    torch.cuda.empty_cache()
    gc.disable()
    try:
        first = LLM(str(checkpoint), device="cuda", gpu_memory_utilization=0.6)
        budget = first.engine.runner.profile["kv_budget_bytes"]
        first.engine.runner.cycle = first  # reachable only through itself once dropped
        del first
        second = LLM(str(checkpoint), device="cuda", gpu_memory_utilization=0.6)
        assert second.engine.runner.profile["kv_budget_bytes"] >= 0.95 * budget
    finally:
        gc.enable()


def near_ties_at_most(expected, ours, most_parted: int = 1, tol: float = 1e-3) -> None:
    """Outputs in float32 through other summation orders (another bucket, cuBLAS picking
    another kernel for other row counts): equal, or parted at a near-tie (each side's token in
    the other's top 5), for at most `most_parted` prompts; logprobs within `tol` before that."""
    parted = 0
    for a, b in zip(expected, ours):
        x, y = a.outputs[0], b.outputs[0]
        j = next((k for k, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), len(x.token_ids))
        for step in range(j):
            assert y.logprobs[step][y.token_ids[step]] == pytest.approx(x.logprobs[step][x.token_ids[step]], abs=tol)
        if j < len(x.token_ids):
            parted += 1
            assert x.token_ids[j] in y.logprobs[j] and y.token_ids[j] in x.logprobs[j], (j, x.token_ids, y.token_ids)
    assert parted <= most_parted


def strict(obj, name: str) -> list[int]:
    """obj.name run with every implicit host sync an error (a step's later draft forwards are
    launched without one, spec/chain.py); the calls counted, from now on."""
    calls, method = [], getattr(obj, name)

    def run(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return method(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            calls.append(1)

    setattr(obj, name, run)
    return calls


@pytest.mark.parametrize("method, dtype", [("ngram", "float32"), ("draft_model", "float32"), ("ngram", "bfloat16")])
def test_speculative_decoding_with_graphs_equals_plain_decoding(checkpoint, method, dtype):
    """Verification steps replay the target's graphs a row a token, and a draft model's forwards
    replay its own: greedy tokens are plain decoding's (the target as its own draft has its
    drafts accepted). In bfloat16 (the runs of rows' kernel with 16-bit dots, which the CPU's
    interpreter cannot run), a row's logits round apart from a decode's: outputs may part at
    near-ties, as they do from HF's in the bfloat16 parity test."""
    loose = dict(most_parted=len(PROMPTS), tol=0.1) if dtype == "bfloat16" else {}
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
            "adaptive": False} if method == "ngram" else \
        {"method": "draft_model", "model": str(checkpoint), "num_speculative_tokens": 3, "adaptive": False}
    plain = run(checkpoint, dtype=dtype)[1]
    # (8 sequences: the graphs go up to 32 rows, few to capture)
    llm = LLM(str(checkpoint), device="cuda", gpu_memory_utilization=0.3, dtype=dtype, max_num_seqs=8,
              speculative_config=spec)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.graphs.max_query == 4
    target, _ = recording(runner.graphs)
    if method == "draft_model":
        assert runner.drafter.graphs is not None and runner.drafter.graphs.graphs
        drafts, _ = recording(runner.drafter.graphs)
        chained = strict(runner.drafter, "_chain_forwards")
    ours = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert max(target) > len(PROMPTS)  # verifications in graphs, a row a token
    if method == "draft_model":
        assert stats["spec_decode_num_accepted_tokens"] >= 0.9 * stats["spec_decode_num_draft_tokens"]
        assert drafts.count(len(PROMPTS)) > 0  # later drafts, a token a request
        assert chained  # forwards 2 to k launched without a wait for the device
    near_ties_at_most(plain, ours, **loose)
    llm.engine.kv_cache.check_integrity()
    del llm, runner
    eager = run(checkpoint, dtype=dtype, speculative_config=spec, enforce_eager=True, max_num_seqs=8)[1]
    near_ties_at_most(eager, ours, **loose)


def test_eagle_head_on_the_built_in_model():
    """The built-in model with its EAGLE head, both in graphs: plain decoding's tokens."""
    prompts = ["def fibonacci(n):", "import os\nimport sys\nimport os\n", "class Stack:\n    def push(self, x):"]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=5)
    outs = {}
    for name, spec in [("plain", None), ("eagle", {"method": "eagle", "num_speculative_tokens": 3, "adaptive": False})]:
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(device="cuda", dtype="float32", gpu_memory_utilization=0.3, max_num_seqs=8, speculative_config=spec)
        chained = strict(llm.engine.runner.drafter, "_chain_forwards") if spec else None
        outs[name] = llm.generate(prompts, params, use_tqdm=False)
        if spec:
            assert chained  # the head's later forwards launched without a wait for the device
            assert llm.engine.runner.drafter.graphs.features is not None
            assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0
            llm.engine.kv_cache.check_integrity()
        del llm
    near_ties_at_most(outs["plain"], outs["eagle"])
