"""What the proposers share: which requests may speculate, how many drafts each has room
for, and the counts the metrics report."""

from __future__ import annotations

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.request import Request
from tokenmill.executor.spec.adaptive import StepCost


def can_speculate(request: Request) -> str | None:
    """None when the request's drafts can be verified exactly here; else what rules it out
    (the request is then served without speculation)."""
    sp = request.sampling_params
    if sp.has_penalties or request.bad_words_token_ids:
        return "penalties"  # each position's logits would depend on the drafts before it
    if request.num_output_tokens < sp.min_tokens:
        return "min_tokens"  # so would EOS's mask; once it is lifted, the request may speculate
    if request.grammar is not None:
        return "structured_outputs"
    if request.ranked_by_logprob or request.num_forks:
        return "best_of"
    return None


class Proposer:
    """After each step, `propose(changed requests, ...)` sets the drafts each one verifies
    next step (request.spec_token_ids); `release(request_id)` drops what it kept for one."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, cost: StepCost | None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.cost = cost if config.adaptive else None  # the target step's cost (adaptive speculation)
        self.num_unspeculated_steps = 0  # request-steps served without speculation by their features
        self.num_steps_by_k = [0] * (config.num_speculative_tokens + 1)  # request-steps by drafts verified

    def room(self, request: Request, new_tokens: int = 0) -> int:
        """The drafts that fit, with the token after them, within max_tokens and max_model_len,
        once the request has `new_tokens` more tokens."""
        return min(self.config.num_speculative_tokens,
                   request.max_tokens - request.num_output_tokens - new_tokens - 1,
                   self.max_model_len - request.num_tokens - new_tokens - 1)

    def release(self, request_id: str) -> None:
        pass

    @staticmethod
    def fade(request: Request, num_drafts: int, keep: float = 0.9) -> None:
        """A request given no drafts gathers no evidence; what it had fades, so that its rate
        returns towards the proposer's overall one and it is tried again (drafts that failed
        early in an output often succeed once it repeats itself)."""
        if num_drafts == 0:
            request.spec_accepted *= keep
            request.spec_rejected *= keep
