"""A drafter's token map (executor/spec/vocab.py): its LM head cut to the map's tokens gives
the argmax of the whole head's logits over those tokens, whether the head is tied, packed or
plain; a drafter with a map drafts only the map's tokens, and greedy outputs stay those of
decoding without drafts; the built-in drafters use their own maps unless told not to; a bad
map is an error naming speculative_config.token_map before the engine starts."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import DEFAULT_DRAFT_MODEL_DIR, EngineConfig
from tokenmill.executor.spec.vocab import DraftVocab, load_token_map
from tests.models.test_speculative import PROMPTS


def masked_argmax(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return ids[logits[:, ids].argmax(dim=-1)]


@pytest.mark.parametrize("name", ["llama", "llama_tied_llama3rope"])
def test_the_cut_head_gives_the_whole_heads_logits_of_its_tokens(name, checkpoints):
    """Rows recovered through the model's own compute_logits (an untied head is packed and its
    plain weight dropped; a tied one reads the embedding): the same logits for the map's
    tokens, so the same argmax over them."""
    runner = LLM(str(checkpoints(name)), dtype="float32", kv_cache_memory="4MiB").engine.runner
    model = runner.model
    vocab_size, hidden = model.cfg.vocab_size, model.cfg.hidden_size
    ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(0))[:700].sort().values
    vocab = DraftVocab(model, ids, hidden, torch.float32, torch.device("cpu"))
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = model.compute_logits(x)
        assert vocab.head(x) == pytest.approx(full[:, ids], abs=1e-4)
        assert vocab.argmax(runner.sampler, x).tolist() == masked_argmax(full, ids).tolist()


def test_a_draft_model_with_a_map_drafts_its_tokens_and_keeps_the_outputs(tmp_path):
    """A map of 600 tokens (a .pt tensor, the format SGLang's token maps use): every draft is
    one of them, some are accepted, and greedy outputs equal decoding without drafts."""
    plain = LLM(dtype="float32", kv_cache_memory="16MiB")
    order = json.loads((DEFAULT_DRAFT_MODEL_DIR / "token_map.json").read_text())
    allowed = set(order[:600])
    torch.save(torch.tensor(order[:600]), tmp_path / "map.pt")
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False,
            "token_map": str(tmp_path / "map.pt")}
    llm = LLM(dtype="float32", kv_cache_memory="16MiB", speculative_config=spec)
    assert len(llm.engine.runner.drafter.vocab) == 600
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    engine = llm.engine
    made = [engine.make_request(p, params, request_id=str(i)) for i, p in enumerate(PROMPTS)]
    for request, text in made:
        engine.add_request(request, text, final_only=True)
    drafted = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request, _ in made:
            assert set(request.spec_token_ids) <= allowed
            drafted += len(request.spec_token_ids)
    assert drafted > 100 and engine.stats()["spec_decode_num_accepted_tokens"] > 0
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert [list(request.output_token_ids) for request, _ in made] == want


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_built_in_drafters_use_their_own_maps_unless_told_not_to(method):
    spec = {"method": method, "num_speculative_tokens": 2}
    drafter = LLM(dtype="float32", kv_cache_memory="4MiB", speculative_config=spec).engine.runner.drafter
    assert len(drafter.vocab) == (2048 if method == "draft_model" else 4096)
    off = LLM(dtype="float32", kv_cache_memory="4MiB", speculative_config={**spec, "token_map": False})
    assert off.engine.runner.drafter.vocab is None


def test_a_map_is_read_sorted_and_without_repeats(tmp_path):
    (tmp_path / "m.json").write_text("[9, 3, 3, 7]")
    assert load_token_map(tmp_path / "m.json", 10).tolist() == [3, 7, 9]
    torch.save([5, 1], tmp_path / "m.pt")
    assert load_token_map(tmp_path / "m.pt", 10).tolist() == [1, 5]


@pytest.mark.parametrize("content, message", [
    (None, "does not load"),
    ("not a pickle", "does not load"),
    ("[]", "non-empty list of token ids"),
    ("[1, 2.5]", "non-empty list of token ids"),
    ("[1, true]", "non-empty list of token ids"),
    ('{"ids": [1]}', "non-empty list of token ids"),
    ("[3, 8192]", "token id 8192 is outside the vocabulary [0, 8192)"),
    ("[-1, 3]", "token id -1 is outside the vocabulary [0, 8192)"),
])
def test_a_bad_map_names_the_key_before_the_engine_starts(content, message, tmp_path):
    path = tmp_path / ("map.pt" if content == "not a pickle" else "map.json")
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as e:
        LLM(dtype="float32", kv_cache_memory="4MiB",
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "token_map": str(path)})
    assert "speculative_config.token_map" in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("spec, message", [
    ({"method": "ngram", "token_map": "map.json"}, "not 'ngram'"),
    ({"method": "eagle", "token_map": 4096}, "must be a file of token ids or false"),
])
def test_a_misplaced_map_is_refused_with_the_config(spec, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(speculative_config={**spec, "num_speculative_tokens": 2})
    assert "speculative_config.token_map" in str(e.value) and message in str(e.value)
