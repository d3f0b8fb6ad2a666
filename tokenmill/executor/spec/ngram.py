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
from tokenmill.executor.spec.adaptive import StepCost, acceptance, choose_num_drafts, continuation
from tokenmill.executor.spec.calibration import Calibration
from tokenmill.executor.spec.proposer import Proposer, can_speculate
from tokenmill.executor.spec.rests import MAX_REST


def propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k draft tokens for the sequence `tokens` (prompt and output, int64), or [] when
    none of its last n-grams occurred before."""
    return propose_batch([tokens], min_n, max_n, [k])[0]


def propose_batch(sequences: list[np.ndarray], min_n: int, max_n: int, ks: list[int]) -> list[list[int]]:
    """`propose` for a batch of sequences at once, laid end to end in one array: the earlier
    positions that hold a sequence's last token are found in one comparison, and only at
    those are the max_n tokens ending there compared with the sequence's last ones, all in
    one gather. (Matching every position of the sequences padded into a matrix, max_n times
    over, took 0.1 ms a step for one request of 600 tokens on a 2-core CPU, a tenth of a
    verifying step of the built-in model, and about 4 ms for 64 requests of 1,500.)"""
    flat = sequences[0] if len(sequences) == 1 else np.concatenate(sequences)
    lengths = np.fromiter((len(t) for t in sequences), dtype=np.int64, count=len(sequences))
    ends = np.cumsum(lengths)  # one past each sequence's last token in `flat`
    starts = ends - lengths
    hit = flat == (flat[-1] if len(sequences) == 1 else np.repeat(flat[ends - 1], lengths))
    hit[ends - 1] = False  # the last token is no earlier occurrence
    at = np.flatnonzero(hit)  # where an earlier occurrence may end
    row = np.searchsorted(ends, at, side="right")  # its sequence
    j = np.arange(max_n)
    back, tail = at[:, None] - j, (ends[row] - 1)[:, None] - j  # [candidates, max_n]
    same = (back >= starts[row][:, None]) & (j < lengths[row][:, None])
    same &= flat[np.maximum(back, 0)] == flat[np.maximum(tail, 0)]
    matched = np.logical_and.accumulate(same, axis=1).sum(axis=1)  # tokens ending at `at` equal to the last ones
    # each sequence's longest match, the latest of those
    width = int(lengths.max()) + 1
    score = matched * width + at - starts[row]
    if len(sequences) == 1:
        best = np.array([score.max() if len(score) else -1])
    else:
        best = np.full(len(sequences), -1, dtype=np.int64)
        np.maximum.at(best, row, score)
    drafts = []
    for k, found, start, length in zip(ks, best.tolist(), starts.tolist(), lengths.tolist()):
        n, end = divmod(found, width) if found >= 0 else (0, 0)
        ok = k > 0 and n >= max(min_n, 1) and length >= min_n + 1
        drafts.append(flat[start + end + 1:start + min(end + 1 + k, length)].tolist() if ok else [])
    return drafts


class TokenArrays:
    """Each request's tokens as a growing int64 array, extended by the tokens it got since the
    last step (not rebuilt from its list every step). A request's tokens only grow while it
runs: those a stop string takes back end it."""

    def __init__(self) -> None:
        self.arrays: dict[str, tuple[np.ndarray, int]] = {}

    def get(self, request: Request) -> np.ndarray:
        array, n = self.arrays.get(request.request_id, (np.empty(0, dtype=np.int64), 0))
        tokens = request.all_token_ids
        if len(tokens) > len(array):
            grown = np.empty(max(2 * len(array), len(tokens) + 64), dtype=np.int64)
            grown[:n] = array[:n]
            array = grown
        array[n:len(tokens)] = tokens[n:]
        self.arrays[request.request_id] = (array, len(tokens))
        return array[:len(tokens)]

    def release(self, request_id: str) -> None:
        self.arrays.pop(request_id, None)


class NgramProposer(Proposer):
    """Drafts for the requests that got tokens this step, from their own tokens; with
    `cost` (adaptive speculation), as many of them as pay for their time."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, cost: StepCost | None = None) -> None:
        super().__init__(config, max_model_len, cost)
        self.tokens = TokenArrays()

    def release(self, request_id: str) -> None:
        self.tokens.release(request_id)

    def propose(self, requests: list[Request], num_running: int, accepted: int, rejected: int,
                later: tuple[int, int] = (0, 0)) -> None:
        """`num_running`: the requests the next step will run (a token each at least);
        `accepted` / `rejected`: the drafts accepted and the verification steps that
        rejected one, over all requests so far (the prior for a request's own rate); `later`:
        the drafts after a request's first, accepted and verified after an accepted one
        (adaptive.continuation).
        Where the lookups found drafts and none paid, the next steps neither look up nor
        choose (Proposer._rest_after: 1, 2, 4, ... up to MAX_REST steps): at 64 requests of
        about 600 tokens the lookups and the choice took 1-1.5 ms of a 7-9 ms step on a
        2-core Xeon, where adaptive n-gram verified drafts in one request-step of eight and ran
        at 0.86-0.94x of no speculation on the rewrite set."""
        cfg = self.config
        if self.cost is not None and self._rests(len(requests)):
            self._propose_none(requests)
            return
        drafting, ks, context = [], [], 0  # context: the next step's, beyond each request's last token
        for request in requests:
            if request.is_finished:
                self.tokens.release(request.request_id)
                continue
            context += request.num_tokens - 1
            if can_speculate(request) is not None:
                self.num_unspeculated_steps += 1
                continue
            ks.append(self.room(request))
            drafting.append(request)
        if not drafting:
            return
        drafts = propose_batch([self.tokens.get(r) for r in drafting], cfg.prompt_lookup_min,
                               cfg.prompt_lookup_max, ks)
        if self.cost is not None:
            prior = acceptance(accepted, rejected, prior=0.5)
            rates = [acceptance(r.spec_accepted, r.spec_rejected, prior) for r in drafting]
            after = continuation(later, prior)
            limits = [len(d) for d in drafts]
            contexts = [r.num_tokens for r in drafting]

            def choose(rates: list[float], calibration: Calibration | None = None) -> list[int]:
                return choose_num_drafts(rates, limits, num_running, self.cost, contexts=contexts,
                                         calibration=calibration, later=after, batch_context=context)

            if self.measuring:
                chosen = [0] * len(drafts)
            elif (chosen := self.explore(rates, limits, choose)) is not None:
                self.rest_length = self.resting = 0
            else:
                chosen = self.chose(choose(rates, self.calibration))
                if any(limits):  # (no rest where the lookups found nothing: that is no verdict on drafts)
                    self._rest_after(chosen, len(requests), MAX_REST)
            drafts = [d[:k] for d, k in zip(drafts, chosen)]
        for request, d in zip(drafting, drafts):
            request.spec_token_ids = d
            self.num_steps_by_k[len(d)] += 1
            self.fade(request, len(d))
