"""Structured outputs on the built-in model: every output fits its schema, regex, choice or
grammar, also in a batch with unconstrained requests, under preemption and with n > 1;
compilation is cached and bad specs are refused by name."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.config import DEFAULT_MODEL_DIR
from tokenmill.executor.sampler import apply_token_bitmask
from tokenmill.sampling_params import ParamError

PROMPTS = ["def add(a, b):", "Once upon a time", "import numpy as np\n", "The list of"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "kind": {"enum": ["cat", "dog", "bird"]},
    },
    "required": ["name", "age", "tags", "kind"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe later"]
LARK = 'start: "(" item ("," item)* ")"\nitem: /[a-z]{1,6}/'
GBNF = 'root ::= "x=" [0-9] [0-9]? ";"'


@pytest.fixture(scope="module")
def llm():
    return LLM(str(DEFAULT_MODEL_DIR), dtype="float32", max_model_len=512, kv_cache_memory="16MiB")


def check(kind: str, text: str) -> None:
    """Raises unless `text` is a complete output of the constraint `kind`."""
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    elif kind == "lark":
        assert re.fullmatch(r"\([a-z]{1,6}(,[a-z]{1,6})*\)", text), text
    else:
        assert re.fullmatch(r"x=[0-9][0-9]?;", text), text


SPECS = {
    "json": StructuredOutputsParams(json=PERSON),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "lark": StructuredOutputsParams(grammar=LARK),
    "gbnf": StructuredOutputsParams(grammar=GBNF),
}


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_fit_their_constraint(llm, kind, temperature):
    params = SamplingParams(max_tokens=160, temperature=temperature, seed=7, structured_outputs=SPECS[kind])
    outs = [o.outputs[0] for o in llm.generate(PROMPTS + ["config = ", "x"], params, use_tqdm=False)]
    if kind == "json_object":
        # nothing bounds a free object: this model sometimes loops inside a string until max_tokens
        outs = [c for c in outs if c.finish_reason == "stop" or not c.text.startswith('{"')]
        assert len(outs) >= 4
    for c in outs:
        assert c.finish_reason == "stop", (kind, c.text)
        check(kind, c.text)


def test_mixed_batch_under_preemption_and_with_n(llm):
    """Constrained and unconstrained requests in one batch, with a cache small enough to preempt:
    the constrained ones fit, the others get exactly what they get alone."""
    small = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", max_model_len=512, kv_cache_memory="1MiB")
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in small.generate(PROMPTS, free, use_tqdm=False)]
    kinds = ["json", "regex", "choice", "lark", "gbnf", "json"]
    params, prompts = [], []
    for i, kind in enumerate(kinds * 2):
        params.append(SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured_outputs=SPECS[kind]))
        prompts.append(PROMPTS[i % len(PROMPTS)])
    params += [free] * len(PROMPTS)
    prompts += PROMPTS
    params.append(SamplingParams(max_tokens=120, temperature=1.0, seed=3, n=3, structured_outputs=SPECS["json"]))
    prompts.append(PROMPTS[0])
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    for kind, out in zip(kinds * 2, outs):
        assert out.outputs[0].finish_reason == "stop", (kind, out.outputs[0].text)
        check(kind, out.outputs[0].text)
    assert [o.outputs[0].token_ids for o in outs[len(kinds) * 2:-1]] == alone
    forked = outs[-1].outputs
    assert len(forked) == 3 and len({c.text for c in forked}) > 1
    for c in forked:
        check("json", c.text)
    small.engine.kv_cache.check_integrity()


def test_grammar_compiled_once_per_spec_and_logprobs_stay_finite(llm):
    grammars = llm.engine.grammars
    spec = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["n"], "additionalProperties": False}
    before = len(grammars._cache)
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=i, logprobs=5,
                             structured_outputs=StructuredOutputsParams(json=dict(spec))) for i in range(4)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(grammars._cache) == before + 1  # four requests, one compilation
    for out in outs:
        c = out.outputs[0]
        assert isinstance(json.loads(c.text)["n"], int)
        for token, entry in zip(c.token_ids, c.logprobs):
            # where only one token was allowed, the others are -9999 (vLLM's floor), never -inf
            assert all(-9999.0 <= v <= 0.0 for v in entry.values()) and entry[token] > -9999.0


def test_abort_while_compiling(llm):
    engine = llm.engine
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"abort": {"type": "string"}}})
    request, text = engine.make_request("x", SamplingParams(max_tokens=5, structured_outputs=spec))
    engine.add_request(request, text)
    assert engine.has_unfinished_requests() and engine.num_waiting == 1
    out = engine.abort_request(request.request_id)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_wins_over_bans_that_leave_nothing(llm, temperature):
    """bad_words that ban the only tokens the grammar allows: the grammar's choice stands
    (never a token outside the vocabulary, never an end that does not fit)."""
    spec = StructuredOutputsParams(regex="yes|no")
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=1, bad_words=["yes", "no"],
                            structured_outputs=spec)
    for out in llm.generate(PROMPTS[:2], params, use_tqdm=False):
        assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("spec, message", [
    (dict(), "exactly one"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(json={"type": "foo"}), "Invalid type"),
    (dict(json="{not json"), "json is not usable"),
    (dict(json=[1, 2]), "is an object"),
    (dict(regex="(abc"), "unclosed group"),
    (dict(choice=[]), "non-empty strings"),
    (dict(grammar="start: undefined_rule"), "unknown name"),
    (dict(grammar="root ::= (("), "not usable"),
])
def test_bad_specs_name_structured_outputs(spec, message):
    with pytest.raises(ParamError, match=message) as info:
        StructuredOutputsParams(**spec)
    assert info.value.param == "structured_outputs"


def test_bitmask_masks_exactly_the_cleared_bits():
    gen = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word's high bits are past the vocabulary
    logits = torch.randn(5, vocab, generator=gen)
    expected = logits.clone()
    bits = torch.randint(-2**31, 2**31 - 1, (2, 4), dtype=torch.int32, generator=gen)
    rows = torch.tensor([3, 1])
    apply_token_bitmask(logits, rows, bits)
    for k, row in enumerate(rows.tolist()):
        for t in range(vocab):
            if not (int(bits[k, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    assert torch.equal(logits, expected)
