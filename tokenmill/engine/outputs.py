"""What the engine keeps per request for its callers (its sequences, what each has handed
out) and the RequestOutput snapshots it builds from them."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.request import (CompletionOutput, Request, RequestMetrics, RequestOutput, RequestStatus,
                                      TokenLogprobs)


def _logprob_dict(entry: TokenLogprobs) -> dict[int, float]:
    token, logprob, top = entry
    return {**dict(top), token: logprob}


@dataclass(slots=True)
class Seq:
    """One sequence of a request: the request itself, or one forked from it (parallel sampling)."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    num_sent_tokens: int = 0  # output tokens handed out in RequestOutputs
    num_decoded_tokens: int = 0  # output tokens fed to the detokenizer


@dataclass(slots=True)
class Tracked:
    """A request as its caller knows it: its sequences (one, or n / best_of), by index."""

    request: Request  # sequence 0, whose id the caller knows
    prompt: str | None
    seqs: list[Seq]
    final_only: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None  # as dicts, built once when complete
    # no output until it finishes (final_only, or ranked by best_of) and no stop strings to
    # check as tokens come: a step that does not end one of its sequences has nothing to do
    quiet: bool = False

    @property
    def finished(self) -> bool:
        """Every sequence has finished, and none is still to be forked (an aborted or failed
        request may end before its fork)."""
        r = self.request
        return (r.num_forks == 0 or r.is_finished) and all(seq.request.is_finished for seq in self.seqs)

    @property
    def error(self) -> str | None:
        return next((seq.request.error for seq in self.seqs if seq.request.error is not None), None)


def snapshot(tracked: Tracked, seqs: list[Seq], new_text: str, new_ids: list[int],
              finished: bool, index: int | None = None) -> RequestOutput:
    """The request's state with `seqs` as its outputs (numbered from `index`, else by
    their own index); the deltas are those of the first."""
    completions = []
    for i, seq in enumerate(seqs):
        q = seq.request
        logprobs = None
        if q.logprobs is not None and q.is_finished:
            # the whole list only once, at the end: rebuilding it every step would be quadratic
            logprobs = [_logprob_dict(e) for e in q.logprobs]
        completions.append(CompletionOutput(
            index=q.index if index is None else index + i,
            text=seq.detokenizer.text if seq.detokenizer is not None else "",
            token_ids=q.output_token_ids,
            finish_reason=q.finish_reason,
            stop_reason=q.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=q.cumulative_logprob if q.logprobs is not None or q.ranked_by_logprob else None,
        ))
    new_logprobs = None
    first = seqs[0].request if seqs else None
    if first is not None and first.logprobs is not None:
        new_logprobs = [_logprob_dict(e) for e in first.logprobs[len(first.logprobs) - len(new_ids):]]
    r = tracked.request
    if tracked.prompt_logprobs is None and r.prompt_logprobs is not None and not r.needs_prompt_logprobs:
        tracked.prompt_logprobs = [None if e is None else _logprob_dict(e) for e in r.prompt_logprobs]
    metrics = RequestMetrics(r.arrival_time, r.first_scheduled_time, r.first_token_time, r.last_token_time,
                             r.finish_time, max(r.num_cached_tokens, 0), r.num_preemptions)
    return RequestOutput(r.request_id, tracked.prompt, r.prompt_token_ids, completions, finished,
                         metrics, tracked.error or r.error, new_ids, new_text, new_logprobs,
                         tracked.prompt_logprobs, r.tenant)


def failed_output(request: Request, message: str) -> RequestOutput:
    """The final output of a request that ends with an error before any engine took it."""
    request.status, request.error, request.finish_time = RequestStatus.FINISHED_ERROR, message, time.time()
    tracked = Tracked(request, None, [Seq(request, None)])
    return snapshot(tracked, tracked.seqs, "", [], finished=True)
