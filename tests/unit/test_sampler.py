"""Sampler on hand-made logits: the filters keep the right support, the draws follow the distribution."""

from __future__ import annotations

import torch

from tokenmill.executor.sampler import Sampler, SamplingBatch


def batch(n, temperature=1.0, top_k=None, top_p=None, min_p=None, seeds=(), logprobs=None, banned=None):
    t = torch.full((n,), float(temperature))
    unseeded = [r for r in range(n) if r not in dict(seeds)]
    return SamplingBatch(
        temperature=t,
        top_k=None if top_k is None else torch.full((n,), top_k, dtype=torch.long),
        top_p=None if top_p is None else torch.full((n,), top_p),
        min_p=None if min_p is None else torch.full((n,), min_p),
        all_greedy=temperature == 0,
        seeds=list(seeds),
        unseeded_rows=torch.tensor(unseeded) if unseeded and temperature != 0 else None,
        banned=banned,
        num_logprobs=[logprobs] * n,
        max_logprobs=-1 if logprobs is None else logprobs,
    )


LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))


def draw(b, n=4000):
    sampler = Sampler(torch.Generator().manual_seed(0))
    ids = [t for t, _ in sampler(LOGITS.repeat(n, 1), b)]
    return torch.bincount(torch.tensor(ids), minlength=5).float() / n


def test_temperature_one_follows_the_distribution():
    freq = draw(batch(4000))
    assert torch.allclose(freq, LOGITS.exp(), atol=0.03)


def test_top_k_top_p_min_p_restrict_the_support():
    assert draw(batch(4000, top_k=2))[2:].sum() == 0
    freq = draw(batch(4000, top_p=0.7))  # 0.5 + 0.25 reaches 0.7: two tokens stay
    assert freq[2:].sum() == 0 and freq[1] > 0.2
    freq = draw(batch(4000, min_p=0.4))  # keeps p >= 0.2: two tokens
    assert freq[2:].sum() == 0 and freq[1] > 0.2


def test_greedy_rows_and_banned_tokens():
    sampler = Sampler(torch.Generator().manual_seed(0))
    out = sampler(LOGITS.repeat(2, 1), batch(2, temperature=0, banned=(torch.tensor([1]), torch.tensor([0]))))
    assert [t for t, _ in out] == [0, 1]


def test_seeded_rows_do_not_depend_on_neighbours():
    sampler = Sampler(torch.Generator().manual_seed(0))
    alone = sampler(LOGITS.repeat(1, 1), batch(1, seeds=[(0, 77)]))[0][0]
    for others in range(1, 6):
        rows = sampler(LOGITS.repeat(others + 1, 1), batch(others + 1, seeds=[(others, 77)]))
        assert rows[others][0] == alone


def test_logprobs_are_raw_model_logprobs():
    sampler = Sampler(torch.Generator().manual_seed(0))
    (token, (chosen, lp, top)), = sampler(LOGITS.repeat(1, 1), batch(1, temperature=0.5, top_k=1, logprobs=2))
    assert token == chosen == 0
    assert abs(lp - LOGITS[0].item()) < 1e-5
    assert [t for t, _ in top] == [0, 1] and abs(top[1][1] - LOGITS[1].item()) < 1e-5
