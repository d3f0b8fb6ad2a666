"""Verification of draft tokens, exact: what a request gets from a step with drafts is what
it would have got, token by token, from as many steps without them (greedy), or tokens drawn
from the same distribution (sampling).

Row j of a request scheduled with drafts d_0..d_{k-1} holds the target's token after
d_0..d_{j-1}:
- greedy: its argmax, which accepts d_j when it equals it;
- sampled: rejection sampling (`rejection_sample`, run by the sampler on the row's
  distribution) gives d_j when it accepts it, else a token from the residual
  distribution, never d_j.
Either way drafts are accepted while the row's token equals the draft; the first row that
differs gives its own token (or, when all k are accepted, the last row gives one more: the
bonus token). So a step yields 1 to k + 1 tokens.
"""

from __future__ import annotations

from typing import TypeVar

import torch

T = TypeVar("T")


def rejection_sample(probs: torch.Tensor, drafts: torch.Tensor,
                     uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling against drafts that are one token d each (n-gram drafts: q(d) = 1).
    probs: [N, vocab], each row's sampling distribution (not necessarily normalised);
    drafts: [N], the token row i verifies (-1: none); uniform: [N] in [0, 1).

    A row accepts d with probability p(d) = min(1, p(d) / q(d)); otherwise its token comes
    from the residual max(0, p - q), normalised: p without d. So the token is drawn from p
    exactly (Leviathan et al. 2023). Returns the rows' probabilities with d's removed (to
    draw the residual from) and whether each row accepts its draft."""
    has = drafts >= 0
    d = drafts.clamp(min=0).unsqueeze(1)
    p_d = probs.gather(1, d).squeeze(1)
    accepted = has & (uniform * probs.sum(dim=-1) < p_d)
    residual = probs.scatter(1, d, torch.where(has, 0.0, p_d).unsqueeze(1))
    return residual, accepted


def accepted_prefix(drafts: list[int], rows: list[tuple[int, T]]) -> list[tuple[int, T]]:
    """rows: (the target's token, its logprobs) for positions 0..k; returns the accepted
    prefix of them: the rows up to and including the first whose token is not the draft."""
    for j, draft in enumerate(drafts):
        if rows[j][0] != draft:
            return rows[:j + 1]
    return rows[:len(drafts) + 1]
