"""Incremental detokenization: streamed deltas add up to the final text, characters are never split."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from tokenmill.config import DEFAULT_MODEL_DIR
from tokenmill.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))


TEXT = "def f(x):\n    return x  # naïve café 日本語 🚀 done"


def stream(tok, text, stop=(), include=False, prompt="print("):
    ids = tok.encode(text).ids
    d = IncrementalDetokenizer(lambda t: tok.decode(t, skip_special_tokens=True), tok.encode(prompt).ids,
                               list(stop), include)
    deltas, hit = [], None
    for i in ids:
        hit = d.add([i])
        deltas.append(d.delta(finished=hit is not None))
        if hit:
            break
    deltas.append(d.delta(finished=True))
    return d, deltas, hit


def test_deltas_add_up_to_the_text_and_never_split_characters(tok):
    d, deltas, _ = stream(tok, TEXT)
    assert "".join(deltas) == d.text == TEXT
    assert all("\ufffd" not in x for x in deltas)


@pytest.mark.parametrize("stop, include, expect", [
    (["café"], False, TEXT[:TEXT.index("café")]),
    (["café"], True, TEXT[:TEXT.index("café") + 4]),
    (["nope", "return"], False, TEXT[:TEXT.index("return")]),
])
def test_stop_strings_across_token_boundaries(tok, stop, include, expect):
    d, deltas, hit = stream(tok, TEXT, stop, include)
    assert hit is not None and d.text == expect
    assert "".join(deltas) == expect  # nothing past the stop string was ever streamed


@pytest.mark.parametrize("seed", range(4))
def test_many_tokens_at_once_give_the_token_by_token_text(tok, seed):
    """A final_only output is decoded in one go: the same text as one token at a time, with
    characters split across tokens and random ids (some ending inside a character)."""
    import random

    rng = random.Random(seed)
    ids = tok.encode(TEXT * 3).ids
    ids = ids + [rng.randrange(tok.get_vocab_size()) for _ in range(200)]
    decode = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    prompt = tok.encode("print(").ids
    for cut in (len(ids), len(ids) - 1, rng.randrange(2, len(ids))):
        one_by_one = IncrementalDetokenizer(decode, prompt, [])
        for i in ids[:cut]:
            one_by_one.add([i])
        together = IncrementalDetokenizer(decode, prompt, [])
        together.add(ids[:cut // 2])
        together.add(ids[cut // 2:cut])
        assert together.text == one_by_one.text
        assert together.delta(finished=True) == one_by_one.delta(finished=True)
