"""StepInput: one step as arrays, all that a model runner needs to run its forward.

The driver's runner builds it from the SchedulerOutput; under tensor parallelism it is what
the other ranks receive (executor/distributed/workers.py): a few numpy arrays, never the
Request objects, which would be pickled to every rank every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class StepInput:
    input_ids: np.ndarray  # int64 [tokens]: every scheduled token, requests one after another
    positions: np.ndarray  # int64 [tokens]
    slot_mapping: np.ndarray  # int64 [tokens]: the KV slot each token's K/V goes to
    query_lens: np.ndarray  # int32 [requests]: tokens scheduled per request
    seq_lens: np.ndarray  # int32 [requests]: its context once this step's tokens are in
    block_table: np.ndarray  # int32 [requests, max blocks], zero-padded
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) blocks
    # the rows of the hidden states whose logits the step computes, one array per call, in
    # order (prompt logprobs, then the sampling rows); None: every row
    logits_rows: list[np.ndarray | None] = field(default_factory=list)
