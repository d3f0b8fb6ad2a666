"""The shipped built-in models (target and draft): small enough for the repository, and HF transformers
gives the same greedy tokens as tokenmill on code prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import DEFAULT_MODEL_DIR
from tests.models.test_parity import assert_close_outputs, hf_greedy

DRAFT_MODEL_DIR = DEFAULT_MODEL_DIR.parent / "default_draft_model"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(argv):",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
           "    for i in range(len(items)):"]
NUM_TOKENS = 16


@pytest.mark.parametrize("path, max_bytes", [(DEFAULT_MODEL_DIR, 16_000_000), (DRAFT_MODEL_DIR, 4_000_000)])
def test_shipped_model_is_small_and_shares_the_tokenizer(path, max_bytes):
    assert (path / "model.safetensors").stat().st_size <= max_bytes
    assert (path / "tokenizer.json").read_bytes() == (DEFAULT_MODEL_DIR / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("path", [DEFAULT_MODEL_DIR, DRAFT_MODEL_DIR], ids=["target", "draft"])
def test_greedy_matches_transformers(path):
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=5),
                        use_tqdm=False)
    hf = hf_greedy(path, prompts, NUM_TOKENS)
    assert_close_outputs(hf, ours, path.name)
    assert [o.outputs[0].token_ids for o in ours] == [t for t, _ in hf]


def test_shipped_models_are_trained():
    """Real weights, not random ones (loss ln 8192 = 9.0): both predict Python they never saw (this
    project's scheduler), the target better than the draft."""
    import transformers

    text = (Path(__file__).parents[2] / "tokenmill" / "engine" / "scheduler.py").read_text()
    ids = torch.tensor([transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR).encode(text)[:512]])
    losses = []
    for path in (DEFAULT_MODEL_DIR, DRAFT_MODEL_DIR):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            losses.append(model(ids, labels=ids).loss.item())
    assert losses[0] < losses[1] < 6.5, losses


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_steps_of_one_row_a_token_run_in_one_call_as_through_the_modules(dtype):
    """Where the built-in model's linear layers run on amx_linear (bfloat16 on a CPU with AMX) or
    small_linear (float32, AVX2 and FMA), a step whose every token is a row of its own and that
    fits those kernels' rows runs in one native call (executor/fused_decoder.py): decodes, a
    short prompt, speculative verification's last token and drafts. Each such step gives the
    modules' hidden states over the same rows bit for bit, and the outputs are those of an
    engine that runs every step through the modules (enforce_eager)."""
    from tokenmill.executor.attention import AttentionMetadata

    spec = {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype=dtype, max_num_seqs=3, speculative_config=spec)
    runner = llm.engine.runner
    if runner.fused is None:
        pytest.skip("the one-call forward needs amx_linear (AMX-BF16) in bfloat16, small_linear (AVX2 and FMA) in "
                    "float32")
    fused_forward, shapes = runner._forward_fused, []

    def both(step, fill):
        hidden = fused_forward(step, fill)
        # the modules over the same rows (the same K/V written again), planned as _forward plans them
        put = runner.staging.to_device
        runner.attn.begin_step(AttentionMetadata.from_host(step.query_lens, step.seq_lens, step.block_table,
                                                           put(step.slot_mapping), runner.block_size, put))
        assert torch.equal(hidden, runner.model(put(step.input_ids), put(step.positions), runner.attn))
        shapes.append(tuple(step.query_lens))
        return hidden

    runner._forward_fused = both
    prompts = PROMPTS + ["x ="]  # a prompt of a few tokens: a chunk of one row a token
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    short = len(llm.tokenizer.encode(prompts[-1]))
    assert (1,) in shapes and (5,) in shapes  # a request decoding alone, and verifying 4 drafts
    assert any(short in s and 5 in s for s in shapes)  # the short prompt beside a verification
    eager = LLM(str(DEFAULT_MODEL_DIR), dtype=dtype, max_num_seqs=3, speculative_config=spec, enforce_eager=True)
    assert eager.engine.runner.fused is None
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)] == ours
