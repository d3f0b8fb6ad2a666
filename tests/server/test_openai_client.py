"""The official openai client against a real server: completions and chat, streamed and not."""

from __future__ import annotations

import math

import openai
import pytest

from tests.server.conftest import MODEL_NAME


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def stream_completion(client, **kwargs):
    """(text, finish_reason, usage, number of chunks) of a streamed completion."""
    text, finish, usage, chunks = "", None, None, 0
    for chunk in client.completions.create(model=MODEL_NAME, stream=True,
                                           stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
            chunks += 1
    return text, finish, usage, chunks


def stream_chat(client, **kwargs):
    text, finish, usage = "", None, None
    for chunk in client.chat.completions.create(model=MODEL_NAME, stream=True,
                                                stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    import httpx2 as httpx
    assert httpx.get(f"{server.url}/health").status_code == 200
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])


def test_completion_usage_and_length(server, client):
    out = client.completions.create(model=MODEL_NAME, prompt="def fibonacci(n):", max_tokens=12,
                                    extra_body={"ignore_eos": True})
    prompt_tokens = len(server.engine.tokenizer.encode("def fibonacci(n):"))
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == prompt_tokens + 12
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.model == MODEL_NAME and out.object == "text_completion"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_streamed_text_equals_non_streamed(client, temperature):
    # Each request is sent once before the pair that is compared, so that both find the
    # same blocks of their prompt in the prefix cache: in bfloat16 a prompt computed in
    # full and one computed after a cache hit round differently (GEMMs of other shapes),
    # and greedy tokens may part after a while.
    args = dict(prompt="import os\n", max_tokens=40, temperature=temperature, seed=7,
                extra_body={"ignore_eos": True})
    client.completions.create(model=MODEL_NAME, **args)
    whole = client.completions.create(model=MODEL_NAME, **args)
    text, finish, usage, chunks = stream_completion(client, **args)
    assert text == whole.choices[0].text
    assert finish == whole.choices[0].finish_reason == "length"
    assert usage.completion_tokens == whole.usage.completion_tokens == 40
    # a consumer that falls behind gets its pending deltas merged (engine/async_engine.py): 40
    # tokens of the built-in model can come in one chunk (0.7 ms a token, the test suite beside
    # the server), 250 come in several however fast the engine
    assert stream_completion(client, **{**args, "max_tokens": 250})[3] > 1

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "sort a list"}]
    client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=30, seed=3,
                                   temperature=temperature, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=30, seed=3,
                                          temperature=temperature, extra_body={"ignore_eos": True})
    text, finish, usage = stream_chat(client, messages=messages, max_tokens=30, seed=3, temperature=temperature,
                                      extra_body={"ignore_eos": True})
    assert text == chat.choices[0].message.content and chat.choices[0].message.role == "assistant"
    assert usage.completion_tokens == chat.usage.completion_tokens == 30
    assert usage.prompt_tokens == chat.usage.prompt_tokens > 4


def test_n_samples(client):
    out = client.completions.create(model=MODEL_NAME, prompt=["a = 1", "class A:"], n=3, max_tokens=10,
                                    temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == list(range(6))
    assert len({c.text for c in out.choices[:3]}) == 3  # different seeds per sample
    assert out.usage.completion_tokens == 60
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=8, temperature=1.0, seed=1, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1] and chat.usage.completion_tokens == 16
    # streamed n > 1: every choice's text is the non-streamed one
    streamed = {}
    for chunk in client.completions.create(model=MODEL_NAME, prompt=["a = 1", "class A:"], n=3, max_tokens=10,
                                           temperature=1.0, seed=11, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(6)] == [c.text for c in out.choices]


def test_n_is_one_prefill_and_best_of_picks_among_more(server, client):
    ids = list(range(300, 345))
    engine = server.engine.engine
    before = engine.stats()["num_prompt_tokens_computed"]
    out = client.completions.create(model=MODEL_NAME, prompt=ids, n=4, max_tokens=5, temperature=1.0, seed=2,
                                    extra_body={"ignore_eos": True})
    assert len(out.choices) == 4 and out.usage.prompt_tokens == len(ids)
    assert engine.stats()["num_prompt_tokens_computed"] - before == len(ids)  # forked, not four prefills
    best = client.completions.create(model=MODEL_NAME, prompt=ids, n=1, best_of=4, max_tokens=5, temperature=1.0,
                                     seed=2, logprobs=0, extra_body={"ignore_eos": True})
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert best.choices[0].text in {c.text for c in out.choices}  # the same four sequences, the best one back


def test_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt="x = ", max_tokens=6, logprobs=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and chosen <= 0
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-4)  # greedy picks the most likely
    assert lp.text_offset == sorted(lp.text_offset)

    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, logprobs=True, top_logprobs=2, temperature=0,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and "".join(c.token for c in content) == chat.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert math.isclose(c.logprob, c.top_logprobs[0].logprob, abs_tol=1e-4)
        assert bytes(c.bytes).decode() == c.token

    streamed = []
    for chunk in client.completions.create(model=MODEL_NAME, prompt="x = ", max_tokens=6, logprobs=3,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(lp.token_logprobs)


def test_stop_strings(client):
    args = dict(model=MODEL_NAME, prompt="def main():\n", max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**args).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    expected = full[:full.index(stop)]
    out = client.completions.create(**args, stop=[stop, "\x00never"])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 60
    text, finish, _, _ = stream_completion(client, **{k: v for k, v in args.items() if k != "model"}, stop=stop)
    assert text == expected and finish == "stop"


def test_echo_and_token_prompts(server, client):
    ids = server.engine.tokenizer.encode("for i in range(3):")
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, temperature=0)
    by_text = client.completions.create(model=MODEL_NAME, prompt="for i in range(3):", max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(model=MODEL_NAME, prompt="for i in range(3):", max_tokens=5, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "for i in range(3):" + by_text.choices[0].text
    many = client.completions.create(model=MODEL_NAME, prompt=[ids, ids[:3]], max_tokens=4, temperature=0)
    assert many.choices[0].text == by_ids.choices[0].text[:len(many.choices[0].text)]
    assert many.usage.prompt_tokens == len(ids) + 3


def test_chat_content_parts_and_fallback_template(server, client):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    a = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": parts}],
                                       max_tokens=5, temperature=0)
    b = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hello\nworld"}],
                                       max_tokens=5, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content

    from tokenmill.server.protocol import ChatCompletionRequest
    from tokenmill.server.chat import ChatServing

    serving = ChatServing(server.engine, [MODEL_NAME])
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    with_template = server.engine.tokenizer.decode(serving.chat_prompt(request))
    assert "<|im_start|>user\nhi<|im_end|>" in with_template
    template, serving.tokenizer.chat_template = serving.tokenizer.chat_template, None
    try:
        assert server.engine.tokenizer.decode(serving.chat_prompt(request)) == "user: hi\nassistant:"
    finally:
        serving.tokenizer.chat_template = template


def test_penalties_bias_and_bad_words_through_the_client(client):
    """The built-in model repeats itself after this prompt ("the list of the list of ..."):
    each of the client's knobs changes that, and bad_words takes the word out."""
    prompt = "def add(a, b):"
    greedy = dict(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
    plain = client.completions.create(**greedy).choices[0].text
    assert plain.count("list") >= 2
    for knobs in (dict(frequency_penalty=2.0), dict(presence_penalty=2.0),
                  dict(extra_body={"repetition_penalty": 2.0})):
        assert client.completions.create(**greedy, **knobs).choices[0].text != plain, knobs
    banned = client.completions.create(**greedy, extra_body={"bad_words": ["list"]}).choices[0].text
    assert "list" not in banned
    # a bias of -100 on the first token it wrote takes that token away
    first = client.completions.create(**{**greedy, "max_tokens": 1}, logprobs=1).choices[0].logprobs.tokens[0]
    biased = client.completions.create(**{**greedy, "max_tokens": 1}, logprobs=1,
                                       logit_bias={str(_token_id(first)): -100})
    assert biased.choices[0].logprobs.tokens[0] != first
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=8, temperature=0, frequency_penalty=1.0, presence_penalty=0.5,
                                          logit_bias={"5": -100})
    assert chat.choices[0].finish_reason == "length"


def _token_id(token_text: str) -> int:
    from tokenmill.config import DEFAULT_MODEL_DIR
    from tokenmill.engine.detokenizer import load_tokenizer

    ids = load_tokenizer(DEFAULT_MODEL_DIR).encode(token_text, add_special_tokens=False)
    assert len(ids) == 1
    return ids[0]


@pytest.fixture(scope="module")
def hf_builtin():
    """The built-in model in transformers (float32), the reference for prompt logprobs."""
    import torch
    import transformers

    from tokenmill.executor.loader import resolve_model_path

    path = resolve_model_path(None)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_echo_with_logprobs_gives_the_prompt_logprobs(server, client, hf_builtin):
    """lm-eval's loglikelihood request: echo + logprobs + max_tokens 0 or 1 returns the prompt's
    token logprobs (None for the first), equal to HF's in float32; streamed equals whole."""
    import torch

    prompt = "def fibonacci(n):\n    return"
    ids = server.engine.tokenizer.encode(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(hf_builtin(torch.tensor([ids])).logits[0].float(), -1)
    for max_tokens in (0, 1):
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, echo=True,
                                        logprobs=2, temperature=0)
        choice, lp = out.choices[0], out.choices[0].logprobs
        assert len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for pos in range(1, len(ids)):
            assert lp.token_logprobs[pos] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
            assert 2 <= len(lp.top_logprobs[pos]) <= 3
        assert lp.text_offset == sorted(lp.text_offset)
        assert choice.text.startswith(prompt) and out.usage.completion_tokens == max_tokens
        if max_tokens == 0:
            assert choice.text == prompt and choice.finish_reason == "length"
        else:  # the generated token comes after the prompt's, greedy: the most likely one
            assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()), abs=1e-4)
    streamed = []
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, echo=True, logprobs=2,
                                           temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)

    # vLLM's prompt_logprobs extension, on both endpoints
    ext = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 1})
    prompt_lps = ext.choices[0].prompt_logprobs  # an extra field: the client keeps it as a plain list
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    assert prompt_lps[1][str(ids[1])]["logprob"] == pytest.approx(ref[0, ids[1]].item(), abs=1e-4)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert chat.prompt_logprobs[0] is None and all(len(e) == 1 for e in chat.prompt_logprobs[1:])
