"""Penalties and logit bias: against a direct computation on the logits, in the engine against
each request alone, and against HF transformers' own repetition penalty and sequence bias."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.test_parity import PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.engine.request import Request
from tokenmill.executor.attention.base import default_to_device
from tokenmill.executor.penalties import PenaltyState, apply_bias, apply_penalties

VOCAB = 50


def request(rid, prompt, output, **params):
    r = Request(rid, prompt, SamplingParams(**params))
    r.all_token_ids.extend(output)
    return r


def direct(logits, r):
    """The definitions, one token at a time."""
    sp = r.sampling_params
    out = logits.clone()
    counts = np.bincount(r.output_token_ids, minlength=VOCAB)
    for t in range(VOCAB):
        x = out[t].item()
        if counts[t] > 0 or t in r.prompt_token_ids:
            x = x / sp.repetition_penalty if x > 0 else x * sp.repetition_penalty
        x -= sp.frequency_penalty * counts[t] + sp.presence_penalty * (counts[t] > 0)
        out[t] = x
    return out


@pytest.mark.parametrize("rows, num_rows", [([0, 2, 3], 4), ([0, 1, 2], 3)], ids=["some-rows", "all-rows"])
def test_penalties_match_their_definitions(rows, num_rows):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(num_rows, VOCAB, generator=g) * 3
    requests = [
        request("a", [1, 2, 3], [4, 4, 5, 1], frequency_penalty=0.7, presence_penalty=0.3),
        request("b", [7, 8], [9, 9, 9, 2], repetition_penalty=1.8),
        request("c", [10], [], frequency_penalty=-0.5, presence_penalty=-1.0, repetition_penalty=0.6),
    ]
    state = PenaltyState(VOCAB, torch.device("cpu"), default_to_device(torch.device("cpu")))
    batch = state.batch(rows, requests, num_rows)
    out = logits.clone()
    apply_penalties(out, batch)
    if num_rows > len(rows):
        torch.testing.assert_close(out[1], logits[1])  # a row without penalties is left alone
    for row, r in zip(rows, requests):
        torch.testing.assert_close(out[row], direct(logits[row], r))


def test_a_tiny_repetition_penalty_keeps_probabilities_finite():
    """5e-324 divides a positive logit to inf (a NaN distribution, and a token id past the
    vocabulary, as the server's fuzz found): the token becomes the most likely one instead."""
    logits = torch.tensor([[1.0, 3.0, -2.0, 0.5]])
    r = request("a", [1], [2], repetition_penalty=5e-324)
    state = PenaltyState(4, torch.device("cpu"), default_to_device(torch.device("cpu")))
    apply_penalties(logits, state.batch([0], [r], 1))
    probs = torch.softmax(logits, dim=-1)
    assert torch.isfinite(probs).all() and probs.argmax().item() == 1


@pytest.mark.parametrize("penalty", [5e-324, 1e-45, 1e-30, 100.0])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 1e-30])
def test_extreme_repetition_penalties_never_leave_the_grammar(penalty, temperature):
    """The server's fuzz found 5e-324 with a grammar: it rounds to 0 in float32, -inf * 0 is NaN,
    and a NaN row sampled a token the grammar forbids. Whatever the penalty and temperature, a
    constrained row samples an allowed token (here, tokens 1 and 3, both seen)."""
    from tests.unit.test_sampler import batch
    from tokenmill.executor.sampler import Sampler

    logits = torch.tensor([[4.0, 3.0, 2.0, -0.5, 0.0, 1.0]]).repeat(64, 1)
    requests = [request(str(i), [1, 4], [3, 0], repetition_penalty=penalty) for i in range(64)]
    state = PenaltyState(6, torch.device("cpu"), default_to_device(torch.device("cpu")))
    b = batch(64, temperature=temperature)
    b.penalties = state.batch(list(range(64)), requests, 64)
    b.grammar = (torch.arange(64), torch.full((64, 1), 0b001010, dtype=torch.int32))
    ids = [t for t, _ in Sampler(torch.Generator().manual_seed(0))(logits, b)]
    assert set(ids) <= {1, 3}, ids


def test_counts_are_kept_incrementally_and_rows_reused():
    state = PenaltyState(VOCAB, torch.device("cpu"), default_to_device(torch.device("cpu")))
    requests = [request(str(i), [i], [i + 1], frequency_penalty=1.0) for i in range(11)]  # grows past 8 rows
    batch = state.batch(list(range(11)), requests, 11)
    ids = torch.tensor([3] * 11)
    state.record(batch, ids)
    state.record(state.batch(list(range(11)), requests, 11), ids)  # same rows again: the counts add up
    for r in requests:
        expected = np.bincount(r.output_token_ids + [3, 3], minlength=VOCAB)
        assert state.counts[state.rows[r.request_id]].tolist() == expected.tolist()
        assert state.in_prompt[state.rows[r.request_id]].nonzero().flatten().tolist() == r.prompt_token_ids
    row = state.rows["0"]
    state.release("0")
    fresh = request("new", [5], [], presence_penalty=1.0)
    assert state.row(fresh) == row and state.counts[row].sum() == 0  # a reused row starts clean


def test_logit_bias_adds_to_the_named_tokens():
    logits = torch.zeros(2, VOCAB)
    apply_bias(logits, (torch.tensor([0, 0, 1]), torch.tensor([3, 7, 3]), torch.tensor([5.0, -100.0, 2.5])))
    assert logits[0, 3] == 5 and logits[0, 7] == -100 and logits[1, 3] == 2.5 and logits.abs().sum() == 107.5


# unpenalised, the "llama" test checkpoint writes prompt 0's second token 2739, and repeats
# itself after prompts 1 and 2
SETTINGS = [
    dict(logit_bias={2739: -100.0, 300: 4.0}),
    dict(repetition_penalty=1.6),
    dict(frequency_penalty=1.2, presence_penalty=0.4),
    dict(),
    dict(presence_penalty=-1.0),
    dict(frequency_penalty=0.6, repetition_penalty=0.8),
]


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(checkpoints):
    llm = LLM(str(checkpoints("llama")), dtype="float32", kv_cache_memory="16MiB")
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **s) for s in SETTINGS]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert together == alone
    plain = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    changed = [a != o.outputs[0].token_ids for a, o in zip(alone, plain)]
    assert changed[:4] == [True, True, True, False]  # the penalties did something
    assert 2739 not in alone[0]
    assert llm.engine.runner.penalties.rows == {}  # every finished request gave its row back


def test_repetition_penalty_and_bias_match_transformers(checkpoints):
    """HF's RepetitionPenaltyLogitsProcessor and SequenceBiasLogitsProcessor, greedy, float32."""
    import transformers

    path = checkpoints("qwen2")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    bias = {PROMPTS[1][0]: 3.0, 42: -5.0}
    for p in PROMPTS[:3]:
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                 pad_token_id=0, repetition_penalty=1.7,
                                 sequence_bias={(t,): v for t, v in bias.items()})[0, len(p):].tolist()
        ours = llm.generate([{"prompt_token_ids": p}], SamplingParams(
            max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.7, logit_bias=bias),
            use_tqdm=False)[0].outputs[0].token_ids
        assert ours == ref


def test_bad_words_are_never_generated():
    """The built-in model writes "list" again and again after this prompt; banned, it never does."""
    llm = LLM(dtype="float32")
    prompt = "def add(a, b):"
    plain = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0].outputs[0]
    assert plain.text.count("list") >= 2
    banned = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, bad_words=["list", "Return"]),
                          use_tqdm=False)[0].outputs[0]
    assert "list" not in banned.text and "Return" not in banned.text


@pytest.mark.parametrize("params, param", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={3: 101}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(bad_words=[""]), "bad_words"),
])
def test_bad_values_name_their_parameter(params, param):
    with pytest.raises(ValueError) as e:
        SamplingParams(**params)
    assert e.value.param == param and param in str(e.value)


def test_logit_bias_takes_token_ids_as_json_strings():
    assert SamplingParams(logit_bias={"5": 2, 7: -1}).logit_bias == {5: 2.0, 7: -1.0}
