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
