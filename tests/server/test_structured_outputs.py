"""Structured outputs through the official openai client: 32 concurrent JSON-schema requests
all valid, OpenAI's response_format (parse() with a pydantic model included) and vLLM's
structured_outputs / guided_* fields, streamed and not. (Free JSON, json_object, is tested
offline: this model can loop inside an unbounded string.)"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL_NAME

CHAT = [{"role": "user", "content": "Describe a pet as JSON."}]
PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "kind", "toys"],
    "additionalProperties": False,
}


class Pet(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "bird"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_32_concurrent_json_schema_requests_are_all_valid(server):
    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
        raw = [client.chat.completions.create(model=MODEL_NAME, messages=CHAT, response_format=fmt, max_tokens=120,
                                              temperature=1.0, seed=i) for i in range(16)]
        # the client's own structured-output helper: a pydantic model in, a parsed object out
        parsed = [client.chat.completions.parse(model=MODEL_NAME, messages=CHAT, response_format=Pet, max_tokens=120,
                                                temperature=1.0, seed=100 + i) for i in range(16)]
        try:
            return await asyncio.gather(*raw, *parsed)
        finally:
            await client.close()

    answers = asyncio.run(run())
    assert len(answers) == 32
    texts = set()
    for answer in answers[:16]:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PET)
        texts.add(choice.message.content)
    for answer in answers[16:]:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pet)
        texts.add(choice.message.content)
    assert len(texts) > 8  # seeded sampling: not one answer 32 times
    server.wait_idle()


def test_vllm_fields_on_completions(client):
    common = dict(model=MODEL_NAME, prompt="The answer is", max_tokens=60, temperature=1.0, seed=5)
    regex = client.completions.create(**common, extra_body={"guided_regex": r"[A-Z][a-z]{2,6} [0-9]{2}"})
    assert re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{2}", regex.choices[0].text)
    choice = client.completions.create(**common, extra_body={"guided_choice": ["left", "right"]})
    assert choice.choices[0].text in ("left", "right") and choice.choices[0].finish_reason == "stop"
    grammar = client.completions.create(**common, extra_body={
        "structured_outputs": {"grammar": 'root ::= "v" [0-9] "." [0-9]'}})
    assert re.fullmatch(r"v[0-9]\.[0-9]", grammar.choices[0].text)
    as_json = client.completions.create(**common, n=3, extra_body={"guided_json": PET})
    for c in as_json.choices:
        jsonschema.validate(json.loads(c.text), PET)


def test_streamed_json_schema(client):
    text, finish, chunks = "", None, 0
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=CHAT, stream=True, max_tokens=120,
                                                temperature=0, response_format=fmt):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            chunks += 1
    assert finish == "stop" and chunks > 3
    jsonschema.validate(json.loads(text), PET)
