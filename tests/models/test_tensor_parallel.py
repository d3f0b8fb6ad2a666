"""Tensor parallelism on the CPU: 2 ranks of 1 thread (gloo), held to Hugging Face transformers
and to one rank on the same checkpoints, in float32.

The checkpoints split every way a model can: KV heads split (llama: 2 over 2 ranks), one KV
head copied to both ranks (llama_tied_llama3rope, also a tied LM head), q/k/v biases (qwen2,
split with their rows), per-head q/k norms (qwen3).
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.models.test_parity import NUM_TOKENS, PROMPTS, assert_close_outputs, hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.executor.distributed.parallel import ColumnShard, RowShard

TP2 = dict(tensor_parallel_size=2, num_threads=2)
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=3)


@pytest.fixture
def make_llm():
    """LLM(...) whose worker processes are stopped when the test ends, pass or fail."""
    made: list[LLM] = []

    def make(path, **engine_args) -> LLM:
        made.append(LLM(str(path), **{"dtype": "float32", "kv_cache_memory": "32MiB", **engine_args}))
        return made[-1]

    yield make
    for llm in made:
        llm.shutdown()


def run(llm: LLM, params: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def assert_same(one, two) -> None:
    """Equal tokens; logprobs and prompt logprobs equal up to the all-reduce's float32 rounding."""
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp_a.keys() == lp_b.keys()
            assert [lp_a[t] for t in lp_a] == pytest.approx([lp_b[t] for t in lp_a], abs=1e-4)
        for pa, pb in zip((a.prompt_logprobs or [None])[1:], (b.prompt_logprobs or [None])[1:]):
            assert pa.keys() == pb.keys()
            assert [pa[t] for t in pa] == pytest.approx([pb[t] for t in pa], abs=1e-4)


@pytest.mark.parametrize("name", ["llama", "llama_tied_llama3rope", "qwen2", "qwen3"])
def test_two_ranks_match_transformers_and_one_rank(name, checkpoints, make_llm):
    path = checkpoints(name)
    one = run(make_llm(path, num_threads=1))
    llm = make_llm(path, **TP2)
    two = run(llm)
    hf = hf_greedy(path, PROMPTS, NUM_TOKENS)
    assert [o.outputs[0].token_ids for o in two] == [t for t, _ in hf]
    assert_close_outputs(hf, two, name)
    assert_same(one, two)
    # the same prompts again: prefix-cache hits on both ranks' caches (a request that wants
    # prompt logprobs computes its whole prompt, so these do not)
    again = run(llm, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=5))
    assert any(o.metrics.num_cached_tokens > 0 for o in again)
    assert_same(two, again)
    llm.engine.kv_cache.check_integrity()


def test_biases_on_every_layer_and_an_odd_vocabulary(tmp_path, make_llm):
    """Llama with attention_bias and mlp_bias (o_proj's and down_proj's biases: row parallel,
    added once) and 8,195 tokens (the last rank's vocabulary slice is padded)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=8195, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      attention_bias=True, mlp_bias=True, initializer_range=0.1, bos_token_id=0,
                                      eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random biases: zeros would not show one added twice
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path)
    hf = hf_greedy(tmp_path, PROMPTS, NUM_TOKENS)
    llm = make_llm(tmp_path, skip_tokenizer_init=True, **TP2)
    assert llm.engine.runner.model.embed_tokens.rows == 4098
    two = run(llm, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=5,
                                  detokenize=False))
    assert [o.outputs[0].token_ids for o in two] == [t for t, _ in hf]
    assert_close_outputs(hf, two, "llama-biases-odd-vocab")


def test_preemption_and_forked_sequences(checkpoints, make_llm):
    """A KV cache too small for the batch preempts and recomputes; n=2 forks each request's
    sequences after one prefill and copies its last block on write, on every rank."""
    path = checkpoints("llama")
    hf = hf_greedy(path, PROMPTS, NUM_TOKENS)
    # 160 tokens of KV per rank (one KV head each: 2 layers x K,V x 16 x 4 bytes = 256 B a token)
    llm = make_llm(path, block_size=4, kv_cache_memory=160 * 256, **TP2)
    assert llm.engine.kv_capacity_tokens == 160
    ours = run(llm)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in ours] == [t for t, _ in hf]
    llm.engine.kv_cache.check_integrity()
    forked = run(llm, SamplingParams(n=2, max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))
    for out, (tokens, _) in zip(forked, hf):
        assert [c.token_ids for c in out.outputs] == [tokens, tokens]


def test_seeded_sampling_matches_one_rank(checkpoints, make_llm):
    path = checkpoints("qwen3")
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    one = run(make_llm(path, num_threads=1), params)
    two = run(make_llm(path, **TP2), params)
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in two]


@pytest.mark.parametrize("engine_args, message", [
    (dict(tensor_parallel_size=3), "does not divide the model's 4 attention heads"),
    (dict(tensor_parallel_size=4, num_threads=2), "tensor_parallel_size 4 exceeds the 2 cores to split"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
    (dict(tensor_parallel_size=2, quantization="int8"), "does not run with quantization"),
    (dict(tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "does not run with speculative_config"),
])
def test_bad_sizes_name_the_flag(engine_args, message, checkpoints):
    with pytest.raises(ValueError, match="tensor_parallel_size") as e:
        LLM(str(checkpoints("llama")), dtype="float32", **engine_args)
    assert message in str(e.value)


def test_killed_worker_fails_the_step_not_hangs(checkpoints, make_llm):
    llm = make_llm(checkpoints("llama"), **TP2)
    worker = llm.engine.runner.workers.procs[0]
    worker.kill()
    worker.wait()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor-parallel worker 1 failed"):
        run(llm)
    assert time.monotonic() - t0 < 10


def test_shards_take_this_ranks_rows_and_columns():
    w = torch.arange(10 * 4, dtype=torch.float32).reshape(10, 4)
    # a vocabulary of 10 rows over 4 ranks: 3 rows each, the last rank's padded with zeros
    last = ColumnShard({"": (9, 3)}).narrow("weight", "", w)
    assert torch.equal(last, torch.cat([w[9:], torch.zeros(2, 4)]))
    row = RowShard(rank=1, start=2, size=2)
    assert torch.equal(row.narrow("weight", "", w), w[:, 2:4])
    assert torch.equal(row.narrow("bias", "", torch.ones(10)), torch.zeros(10))  # rank 0 adds it
    assert torch.equal(RowShard(0, 0, 2).narrow("bias", "", torch.ones(10)), torch.ones(10))
