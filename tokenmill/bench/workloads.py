"""Benchmark workloads: lists of (prompt token ids, output length)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def parse_range(value: str, name: str) -> tuple[int, int]:
    """'128' -> (128, 128); '32:256' -> (32, 256)."""
    try:
        parts = [int(p) for p in str(value).split(":")]
    except ValueError:
        raise ValueError(f"{name}: expected N or MIN:MAX with integers, got {value!r}") from None
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
        raise ValueError(f"{name}: expected N or MIN:MAX with 1 <= MIN <= MAX, got {value!r}")
    return parts[0], parts[1]


def random_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                    seed: int = 0, prefix_len: int = 0, low_token: int = 16) -> list[BenchRequest]:
    """Prompts of uniformly random tokens (ids below `low_token` avoided: special tokens
    live there), lengths uniform in the given ranges. With `prefix_len`, every prompt
    starts with the same random prefix of that many tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(low_token, vocab_size) for _ in range(prefix_len)]
    out = []
    for _ in range(num):
        n = rng.randint(*input_len)
        tokens = prefix + [rng.randrange(low_token, vocab_size) for _ in range(n)]
        out.append(BenchRequest(tokens, rng.randint(*output_len)))
    return out
