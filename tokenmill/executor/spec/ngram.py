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
    """`propose` for a batch of sequences at once: they are laid out as the rows of one
    matrix (padded with -1, which no token equals), and every earlier position of every row
    is matched against its row's last max_n tokens in a few array operations."""
    lengths = np.array([len(t) for t in sequences], dtype=np.int64)
    width = int(lengths.max())
    rows = np.full((len(sequences), width), -1, dtype=np.int64)
    for row, t in zip(rows, sequences):
        row[:len(t)] = t
    idx = np.arange(len(sequences))
    # matched[b, e]: how many tokens ending at e equal row b's last tokens (e itself against
    # the last one, e - 1 against the one before, ...), up to max_n
    matched = np.zeros(rows.shape, dtype=np.int64)
    alive = np.ones(rows.shape, dtype=bool)
    for j in range(max_n):
        back = lengths - 1 - j  # the position of row b's j-th token from its end
        wanted = np.where(back >= 0, rows[idx, np.maximum(back, 0)], -2)  # -2: the row is too short
        shifted = np.full(rows.shape, -1, dtype=np.int64)
        shifted[:, j:] = rows[:, :width - j]  # shifted[b, e] = rows[b, e - j]
        alive &= shifted == wanted[:, None]
        if not alive.any():
            break
        matched += alive
    matched[np.arange(width)[None, :] >= lengths[:, None] - 1] = 0  # the last token is no earlier occurrence
    # the longest match, the latest of those
    end = np.argmax(matched * width + np.arange(width)[None, :], axis=1)
    best = matched[idx, end]
    drafts = []
    for b, k in enumerate(ks):
        ok = k > 0 and best[b] >= max(min_n, 1) and lengths[b] >= min_n + 1
        drafts.append(rows[b, end[b] + 1:min(end[b] + 1 + k, lengths[b])].tolist() if ok else [])
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
