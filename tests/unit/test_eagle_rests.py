"""An EAGLE head's resting steps (executor/spec/eagle.py): logged a step at a time, their
pairs handed out to each request's waiting ones later, one strided piece a request and run
of steps; runs end where the requests, the slab or a request's position do not follow on."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.executor.spec.eagle import EagleProposer
from tokenmill.executor.spec.eagle_pairs import Rest
from tokenmill.sampling_params import SamplingParams


def waiting(proposer, request_id: str) -> tuple[int, int, list[int], torch.Tensor]:
    """(start, end, tokens, hidden-state rows) of the pairs waiting for a request."""
    w = proposer.pending[request_id]
    rows = torch.cat([source[first:first + n] for n, source, first in zip(w.lengths, w.sources, w.firsts)])
    return w.start, w.end, w.ids.tolist(), rows


def test_rests_are_handed_out_as_one_piece_a_request_and_run():
    params = SamplingParams(max_tokens=32)
    a, b, c, done = (Request(name, list(range(100 * k, 100 * k + 12)), params)
                     for k, name in enumerate(("a", "b", "c", "done"), start=1))
    done.status = RequestStatus.FINISHED_STOPPED
    slab, other = torch.arange(32.0).reshape(16, 2), -torch.arange(32.0).reshape(16, 2)
    log = [Rest([a, b, done], [3, 5, 1], slab, 0), Rest([a, b, done], [4, 6, 2], slab, 3),
           Rest([a, b, done], [5, 7, 3], slab, 6),  # a run of three steps: rows every third
           Rest([a, c], [6, 2], slab, 9),  # other requests: a run of its own
           Rest([a, c], [7, 3], other, 0)]  # another slab: one more
    assert log[1].continues(log[0], 1) and log[2].continues(log[0], 2)
    assert not log[3].continues(log[2], 1) and not log[4].continues(log[3], 1)
    proposer = SimpleNamespace(log=log, pending={})
    EagleProposer._hand_out(proposer)
    assert proposer.log == [] and "done" not in proposer.pending
    start, end, ids, rows = waiting(proposer, "a")
    assert (start, end, ids) == (3, 8, a.all_token_ids[4:9]) and len(proposer.pending["a"].lengths) == 3
    assert torch.equal(rows, torch.cat((slab[[0, 3, 6, 9]], other[[0]])))
    start, end, ids, rows = waiting(proposer, "b")
    assert (start, end, ids) == (5, 8, b.all_token_ids[6:9]) and torch.equal(rows, slab[[1, 4, 7]])
    start, end, ids, rows = waiting(proposer, "c")
    assert (start, end, ids) == (2, 4, c.all_token_ids[3:5]) and torch.equal(rows, torch.cat((slab[[10]], other[[1]])))
    # a step that skips a position (a run the head did not see): a starts again from there; c goes on
    proposer.log = [Rest([a, c], [9, 4], other, 2)]
    assert not proposer.log[0].continues(log[4], 1)
    EagleProposer._hand_out(proposer)
    assert waiting(proposer, "a")[:3] == (9, 10, a.all_token_ids[10:11])
    start, end, ids, rows = waiting(proposer, "c")
    assert (start, end, ids) == (2, 5, c.all_token_ids[3:6])
    assert torch.equal(rows, torch.cat((slab[[10]], other[[1, 3]])))
