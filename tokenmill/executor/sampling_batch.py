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
    step: engine.py)."""
    draft_seeds = []
    temps, top_k, top_p, min_p, seeds, unseeded, num_logprobs = [], [], [], [], [], [], []
    banned_rows, banned_ids = [], []
    bias_rows, bias_ids, bias_values = [], [], []
    penalty_rows, penalty_requests = [], []
    use_k = use_p = use_min_p = False
    for row, r in enumerate(requests):
        sp = r.sampling_params
        # the output position this row samples: past the tokens sampled before it and not yet
        # appended (async scheduling: the last step's, still on its way to the host)
        position = r.num_output_tokens + max(r.num_pending_tokens - 1, 0) + (offsets[row] if offsets else 0)
        temps.append(sp.temperature if not sp.greedy else 0.0)
        k = sp.top_k if sp.top_k > 0 else vocab
        top_k.append(min(k, vocab))
        top_p.append(sp.top_p)
        min_p.append(sp.min_p)
        use_k |= k < vocab
        use_p |= sp.top_p < 1.0
        use_min_p |= sp.min_p > 0.0
        if sp.seed is not None:
            # the noise of output position j depends on (seed, j) only
            seeds.append((row, hash((sp.seed, position)) & 0x7FFF_FFFF_FFFF_FFFF))
            if drafts and drafts[row] >= 0:  # and its draft's acceptance on (seed, j, 1)
                draft_seeds.append((row, hash((sp.seed, position, 1)) & 0x7FFF_FFFF_FFFF_FFFF))
        else:
            unseeded.append(row)
        # a best_of sequence needs its chosen token's logprob to be ranked
        num_logprobs.append(sp.logprobs if sp.logprobs is not None or not r.ranked_by_logprob else 0)
        if position < sp.min_tokens:
            stops = set(r.eos_token_ids) | set(sp.stop_token_ids)
            banned_rows.extend([row] * len(stops))
            banned_ids.extend(stops)
        if r.bad_words_token_ids:
            bad = _bad_word_ends(r)
            banned_rows.extend([row] * len(bad))
            banned_ids.extend(bad)
        if sp.logit_bias:
            bias_rows.extend([row] * len(sp.logit_bias))
            bias_ids.extend(sp.logit_bias)
            bias_values.extend(sp.logit_bias.values())
        if sp.has_penalties:
            penalty_rows.append(row)
            penalty_requests.append(r)
    all_greedy = all(t == 0.0 for t in temps)
    wanted = [n for n in num_logprobs if n is not None]
    return SamplingBatch(
        temperature=put(np.array(temps, dtype=np.float32)),
        top_k=put(np.array(top_k, dtype=np.int64)) if use_k and not all_greedy else None,
        top_p=put(np.array(top_p, dtype=np.float32)) if use_p and not all_greedy else None,
        min_p=put(np.array(min_p, dtype=np.float32)) if use_min_p and not all_greedy else None,
        all_greedy=all_greedy,
        seeds=seeds,
        unseeded_rows=put(np.array(unseeded, dtype=np.int64)) if unseeded and not all_greedy else None,
        banned=(put(np.array(banned_rows, dtype=np.int64)), put(np.array(banned_ids, dtype=np.int64)))
        if banned_rows else None,
        bias=(put(np.array(bias_rows, dtype=np.int64)), put(np.array(bias_ids, dtype=np.int64)),
              put(np.array(bias_values, dtype=np.float32))) if bias_rows else None,
        penalties=penalties.batch(penalty_rows, penalty_requests, len(requests)) if penalty_rows else None,
        num_logprobs=num_logprobs,
        max_logprobs=max(wanted) if wanted else -1,
        drafts=put(np.array(drafts, dtype=np.int64)) if drafts and not all_greedy else None,
        draft_seeds=draft_seeds,
    )


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
