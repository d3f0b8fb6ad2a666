"""Prompt lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of
a request's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that
occurs. Host-only work on the token ids; no model runs.

    tokens:  ... a b c d e ... x y a b c   (last 3: "a b c", found before)
    drafts:                              d e ...   (up to k of the tokens after it)
"""

from __future__ import annotations

import numpy as np

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.request import Request


def propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k draft tokens for the sequence `tokens` (prompt and output, int64), or [] when
    none of its last n-grams occurred before."""
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return []
    # candidate ends: earlier positions holding the last token (the last one itself excluded)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if len(ends) == 0:
        return []
    # how far each candidate's match reaches back, up to max_n tokens
    matched = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, min(max_n, length - 1)):
        ok = ends >= j
        ok[ok] = tokens[ends[ok] - j] == tokens[length - 1 - j]
        alive &= ok
        if not alive.any():
            break
        matched += alive
    best = matched.max()
    if best < min_n:
        return []
    end = ends[np.flatnonzero(matched == best)[-1]]  # the latest of the longest matches
    return tokens[end + 1:end + 1 + k].tolist()


def can_speculate(request: Request) -> str | None:
    """None when the request's drafts can be verified exactly here; else what rules it out
    (the request is then served without speculation)."""
    sp = request.sampling_params
    if sp.has_penalties or request.bad_words_token_ids or request.num_output_tokens < sp.min_tokens:
        return "penalties"  # each position's logits would depend on the drafts before it
    if request.grammar is not None:
        return "structured_outputs"
    if request.ranked_by_logprob or request.num_forks:
        return "best_of"
    return None


class NgramProposer:
    """Drafts for the requests that got tokens this step, from their own tokens."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.num_unspeculated_steps = 0  # request-steps served without speculation by their features

    def propose(self, requests: list[Request]) -> None:
        cfg = self.config
        for request in requests:
            if request.is_finished:
                continue
            if can_speculate(request) is not None:
                self.num_unspeculated_steps += 1
                continue
            # room for the drafts and the token after them within max_tokens and max_model_len
            k = min(cfg.num_speculative_tokens, request.max_tokens - request.num_output_tokens - 1,
                    self.max_model_len - request.num_tokens - 1)
            request.spec_token_ids = propose(np.asarray(request.all_token_ids), cfg.prompt_lookup_min,
                                             cfg.prompt_lookup_max, k)
