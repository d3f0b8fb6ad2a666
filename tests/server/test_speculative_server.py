"""`tokenmill serve --speculative-config`: the official openai client gets the tokens of
decoding without drafts, streamed or not, and /metrics counts drafts and accepted ones
under vLLM's names, and the drafts adaptive speculation chose."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import MODEL_NAME, start_server
from tokenmill import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPT = "import os\nimport sys\nimport os\nimport sys\nimport os\n"


@pytest.fixture(scope="module")
def spec_server():
    srv = start_server(speculative_config=SPEC, dtype="float32")
    yield srv
    srv.stop()


def test_completions_equal_decoding_without_drafts(spec_server):
    client = openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="unused", max_retries=0)
    expected = LLM(dtype="float32", max_model_len=256, kv_cache_memory="16MiB").generate(
        [PROMPT], SamplingParams(max_tokens=48, temperature=0), use_tqdm=False)[0].outputs[0].text
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=48, temperature=0)
    assert whole.choices[0].text == expected
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=48, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected
    m = spec_server.wait_idle()
    drafts = m["tokenmill:spec_decode_num_draft_tokens_total"]
    accepted = m["tokenmill:spec_decode_num_accepted_tokens_total"]
    assert drafts >= accepted > 0
    assert m["tokenmill:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] > 0
    assert sum(v for k, v in m.items() if k.startswith("tokenmill:spec_decode_num_accepted_tokens_per_pos_total")) \
        == accepted
    assert m["tokenmill:generation_tokens_total"] == 96
    by_k = {k: v for k, v in m.items() if k.startswith("tokenmill:spec_decode_num_steps_by_k_total")}
    assert by_k and sum(by_k.values()) > 0  # adaptive speculation's choices, k = 0..4
