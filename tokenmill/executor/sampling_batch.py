"""A step's sampling settings as device tensors: one row per sampled token (with speculative
drafts, one per draft plus the bonus), built once per step from the requests' SamplingParams.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tokenmill.engine.request import Request
from tokenmill.executor.penalties import PenaltyState
from tokenmill.executor.sampler import SamplingBatch


def build_sampling_batch(penalties: PenaltyState, put: Callable[[np.ndarray], torch.Tensor], vocab: int,
                         requests: list[Request], offsets: list[int] | None = None,
                         drafts: list[int] | None = None) -> SamplingBatch:
    """Per-row settings; with drafts, row i is output position num_output_tokens +
    offsets[i] of its request and verifies the draft token drafts[i] (-1: none). A request
    with a grammar or bad words must have no token pending (async scheduling runs them in
    step: engine.py). The settings that never change are read from each request's cached
    row; only rows with a seed, min_tokens, bad words, a bias or penalties take a Python pass."""
    rows = [r.sampling_row or _cache_row(r, vocab) for r in requests]
    n = len(rows)
    table = np.array([row[0] for row in rows], dtype=np.float64).reshape(n, 4)
    temps = table[:, 0].astype(np.float32)
    all_greedy = not temps.any()
    num_logprobs = [row[1] for row in rows]
    seeds, draft_seeds, seeded = [], [], []
    banned_rows, banned_ids = [], []
    bias_rows, bias_ids, bias_values = [], [], []
    penalty_rows, penalty_requests = [], []
    for i, r in enumerate(requests):
        if not rows[i][2]:
            continue  # plain: nothing that depends on the step
        sp = r.sampling_params
        # the output position this row samples: past the tokens sampled before it and not yet
        # appended (async scheduling: the last step's, still on its way to the host)
        position = r.num_output_tokens + max(r.num_pending_tokens - 1, 0) + (offsets[i] if offsets else 0)
        if sp.seed is not None:
            # the noise of output position j depends on (seed, j) only
            seeds.append((i, hash((sp.seed, position)) & 0x7FFF_FFFF_FFFF_FFFF))
            seeded.append(i)
            if drafts and drafts[i] >= 0:  # and its draft's acceptance on (seed, j, 1)
                draft_seeds.append((i, hash((sp.seed, position, 1)) & 0x7FFF_FFFF_FFFF_FFFF))
        if position < sp.min_tokens:
            stops = set(r.eos_token_ids) | set(sp.stop_token_ids)
            banned_rows.extend([i] * len(stops))
            banned_ids.extend(stops)
        if r.bad_words_token_ids:
            bad = _bad_word_ends(r)
            banned_rows.extend([i] * len(bad))
            banned_ids.extend(bad)
        if sp.logit_bias:
            bias_rows.extend([i] * len(sp.logit_bias))
            bias_ids.extend(sp.logit_bias)
            bias_values.extend(sp.logit_bias.values())
        if sp.has_penalties:
            penalty_rows.append(i)
            penalty_requests.append(r)
    unseeded = np.delete(np.arange(n, dtype=np.int64), seeded) if seeded else np.arange(n, dtype=np.int64)
    wanted = [k for k in num_logprobs if k is not None]

    def column(j: int, dtype, used) -> torch.Tensor | None:
        values = table[:, j]
        return put(values.astype(dtype)) if not all_greedy and used(values).any() else None

    return SamplingBatch(
        temperature=put(temps),
        top_k=column(1, np.int64, lambda k: k < vocab),
        top_p=column(2, np.float32, lambda p: p < 1.0),
        min_p=column(3, np.float32, lambda p: p > 0.0),
        all_greedy=all_greedy,
        seeds=seeds,
        unseeded_rows=put(unseeded) if len(unseeded) and not all_greedy else None,
        banned=(put(np.array(banned_rows, dtype=np.int64)), put(np.array(banned_ids, dtype=np.int64)))
        if banned_rows else None,
        bias=(put(np.array(bias_rows, dtype=np.int64)), put(np.array(bias_ids, dtype=np.int64)),
              put(np.array(bias_values, dtype=np.float32))) if bias_rows else None,
        penalties=penalties.batch(penalty_rows, penalty_requests, n) if penalty_rows else None,
        num_logprobs=num_logprobs,
        max_logprobs=max(wanted) if wanted else -1,
        drafts=put(np.array(drafts, dtype=np.int64)) if drafts and not all_greedy else None,
        draft_seeds=draft_seeds,
    )


def _cache_row(request: Request, vocab: int) -> tuple:
    """What a request's sampling rows always are: ((temperature, top-k, top-p, min-p), the
    logprobs it wants, whether it has settings that depend on the step). Kept on the request."""
    sp = request.sampling_params
    k = sp.top_k if sp.top_k > 0 else vocab
    # a best_of sequence needs its chosen token's logprob to be ranked
    num_logprobs = sp.logprobs if sp.logprobs is not None or not request.ranked_by_logprob else 0
    special = (sp.seed is not None or sp.min_tokens > 0 or bool(request.bad_words_token_ids)
               or bool(sp.logit_bias) or sp.has_penalties)
    row = ((0.0 if sp.greedy else sp.temperature, min(k, vocab), sp.top_p, sp.min_p), num_logprobs, special)
    request.sampling_row = row
    return row


def _bad_word_ends(request: Request) -> list[int]:
    """The tokens that would complete one of the request's bad words now: a one-token word
    always, a longer one when the output ends with all of it but its last token."""
    out = []
    num_output = request.num_output_tokens
    for seq in request.bad_words_token_ids:
        k = len(seq) - 1
        if k == 0 or (num_output >= k and request.all_token_ids[-k:] == seq[:-1]):
            out.append(seq[-1])
    return out
