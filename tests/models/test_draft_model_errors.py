"""A bad draft model is an error naming speculative_config.model before the engine starts:
a path that does not load, a draft with another vocabulary or tokenizer, no draft for a
model other than the built-in one."""

from __future__ import annotations

import json
import shutil

import pytest

from tokenmill import LLM
from tokenmill.config import DEFAULT_DRAFT_MODEL_DIR, EngineConfig


def spec(model=None):
    return {"method": "draft_model", "num_speculative_tokens": 2, **({"model": str(model)} if model else {})}


def test_a_model_is_inferred_as_a_draft_model():
    cfg = EngineConfig(speculative_config={"model": "some/draft", "num_speculative_tokens": 3}).speculative_config
    assert (cfg.method, cfg.model) == ("draft_model", "some/draft")


@pytest.mark.parametrize("case", ["missing", "no-weights", "vocab", "tokenizer", "no-default"])
def test_bad_draft_names_the_key(case, tmp_path, checkpoints):
    target = None
    if case == "missing":
        draft, message = tmp_path / "nothing-here", "does not load"
    elif case == "no-weights":
        draft = tmp_path / "draft"
        shutil.copytree(DEFAULT_DRAFT_MODEL_DIR, draft)
        (draft / "model.safetensors").unlink()
        message = "does not load"
    elif case == "vocab":
        draft = tmp_path / "draft"
        shutil.copytree(DEFAULT_DRAFT_MODEL_DIR, draft, ignore=shutil.ignore_patterns("*.safetensors"))
        cfg = json.loads((draft / "config.json").read_text())
        (draft / "config.json").write_text(json.dumps({**cfg, "vocab_size": 4096}))
        message = "the draft's vocabulary has 4096 tokens, the target's 8192"
    elif case == "tokenizer":
        draft = tmp_path / "draft"
        shutil.copytree(DEFAULT_DRAFT_MODEL_DIR, draft, ignore=shutil.ignore_patterns("*.safetensors"))
        tok = json.loads((draft / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        first, second = list(vocab)[100:102]
        vocab[first], vocab[second] = vocab[second], vocab[first]  # two ids swapped
        (draft / "tokenizer.json").write_text(json.dumps(tok))
        message = "the draft's tokenizer"
    else:
        target, draft, message = checkpoints("llama"), None, "needs a draft model checkpoint"
    with pytest.raises(ValueError) as e:
        LLM(target and str(target), dtype="float32", kv_cache_memory="4MiB", speculative_config=spec(draft))
    assert "speculative_config.model" in str(e.value) and message in str(e.value)
